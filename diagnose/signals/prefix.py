"""Family ``prefix``: the prefix cache's hit rate per window of arrival (cached prompt tokens
over prompt tokens); and the prompt-hash statistics ``prefix_cache_miss`` runs itself
(:func:`prefix_block_stats`, :func:`prefix_head_stats`, :func:`engine_block_size`)."""

from __future__ import annotations

from tokenmill.telemetry.recorded_config import read_recorded_config

from .requests import arrival_family

_SELECT = """
    sum(cached_tokens)::DOUBLE / nullif(sum(input_tokens), 0) AS prefix_hit_rate"""


FAMILY = arrival_family("prefix", _SELECT, ("prefix_hit_rate",), "cached_tokens", "input_tokens")


def prefix_block_stats(
    con, since_ns: int, until_ns: int, min_shared_blocks: int = 4, early_blocks: int = 4
) -> dict[str, float | int]:
    """How many prompts share a long run of blocks with other prompts but differ in one early
    block (a timestamp or id near the top of a system prompt).

    Uses ``requests.prompt_block_hashes`` (per-block content hashes of the prompt, not
    chained). For each early block position ``e < early_blocks``, prompts are grouped by their
    next ``min_shared_blocks`` blocks; ``prompts`` counts those whose group holds another prompt
    (the prompts that share a run of blocks at all: unrelated prompts beside them could never
    hit the cache, and do not dilute the share), ``shared_tail_differs_first`` those whose
    group holds other prompts whose block ``e`` differs. Such prompts miss the prefix cache by construction: its keys chain from
    block 0, so one differing early block makes every later block a miss.

    Returns ``{"prompts", "shared_tail_differs_first", "share", "hit_rate", "block",
    "block_size"}`` for the position where the pattern is strongest (``hit_rate``: the
    prefix-cache hit rate of the differing prompts alone, None without them; ``block_size``:
    tokens per hashed block).
    """
    k = int(min_shared_blocks)
    size = engine_block_size(con)
    best = {
        "prompts": 0,
        "shared_tail_differs_first": 0,
        "share": 0.0,
        "hit_rate": None,
        "block": None,
    }
    for e in range(int(early_blocks)):
        row = con.execute(
            f"""
            WITH r AS (
                SELECT prompt_block_hashes AS h, coalesce(cached_tokens, 0) AS cached,
                       input_tokens FROM requests
                WHERE arrival_ns >= ? AND arrival_ns < ? AND len(prompt_block_hashes) > {e + k}),
            t AS (SELECT h[{e + 2}:{e + k + 1}] AS tail, count(DISTINCT h[{e + 1}]) AS firsts,
                         count(*) AS n, sum(cached) AS cached, sum(input_tokens) AS tokens
                  FROM r GROUP BY tail)
            SELECT coalesce(sum(n) FILTER (WHERE n > 1), 0),
                   coalesce(sum(n) FILTER (WHERE firsts > 1), 0),
                   sum(cached) FILTER (WHERE firsts > 1) / sum(tokens) FILTER (WHERE firsts > 1)
            FROM t
            """,
            [since_ns, until_ns],
        ).fetchone()
        prompts, differs = int(row[0]), int(row[1])
        share = differs / prompts if prompts else 0.0
        if share > best["share"]:
            best = {
                "prompts": prompts,
                "shared_tail_differs_first": differs,
                "share": share,
                "hit_rate": None if row[2] is None else float(row[2]),
                "block": e,
            }
    return {**best, "block_size": size}


def prefix_head_stats(
    con, since_ns: int, until_ns: int, min_share: float = 0.5
) -> dict[str, int | float | None]:
    """Prompts that share a prefix shorter than one KV block with other prompts, and no full
    block: the prefix cache, which reuses whole blocks, can give them nothing.

    Uses ``requests.prompt_head_hashes`` (hashes of each prompt's first block_size/4, /2, 3/4
    tokens). For each head length, from the longest, prompts are grouped by that head's hash;
    a prompt counts when its group holds another prompt and its first full block (if it has
    one) is shared with no other prompt.

    Returns ``{"prompts", "sharing", "share", "head_tokens", "block_size"}`` for the longest
    head length (tokens) that at least ``min_share`` of the prompts share (``head_tokens``
    None and ``sharing`` 0 when none; ``prompts``: prompts with head hashes; tokens per block
    from the config event).
    """
    size = engine_block_size(con)
    step = max(1, size // 4)
    best = {"prompts": 0, "sharing": 0, "share": 0.0, "head_tokens": None, "block_size": size}
    for i in range(len(range(step, size, step)), 0, -1):
        prompts, sharing = con.execute(
            f"""
            WITH r AS (
                SELECT prompt_head_hashes[{i}] AS head,
                       CASE WHEN len(prompt_block_hashes) > 0 THEN prompt_block_hashes[1] END AS b0
                FROM requests WHERE arrival_ns >= ? AND arrival_ns < ?
                    AND prompt_head_hashes IS NOT NULL),
            g AS (SELECT head IS NOT NULL AND count(*) OVER (PARTITION BY head) > 1 AS shares_head,
                         b0 IS NOT NULL AND count(*) OVER (PARTITION BY b0) > 1 AS shares_block
                  FROM r)
            SELECT count(*), count(*) FILTER (WHERE shares_head AND NOT shares_block) FROM g
            """,
            [since_ns, until_ns],
        ).fetchone()
        share = sharing / prompts if prompts else 0.0
        if prompts and share >= min_share:
            return {
                "prompts": prompts,
                "sharing": sharing,
                "share": share,
                "head_tokens": step * i,
                "block_size": size,
            }
        best["prompts"] = prompts
    return best


def engine_block_size(con) -> int:
    """Tokens per KV block (and per prompt hash block) from the latest ``config`` event;
    the engine's default (16) for a store without one."""
    return read_recorded_config(con).block_size
