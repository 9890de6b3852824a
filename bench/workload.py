"""What ``tokenmill bench`` sends: request generators.

Every workload is a :class:`Workload`, a deterministic function of the request index ``i`` and
the seed (``make(i)`` builds request ``i`` with its own ``numpy`` generator seeded by
``(seed, i)``), so open- and closed-loop runs of any length get the same requests in the same
order.

Lengths (``--prompt-tokens``, ``--output-tokens``), in tokens, each request drawing its own:

- ``N`` or ``fixed:N`` — always N;
- ``uniform:A:B`` (or ``uniform:A-B``) — an integer uniformly in ``[A, B]``;
- ``lognormal:MEAN:SIGMA`` — ``exp(X)`` with ``X ~ Normal(mu, SIGMA)`` and
  ``mu = ln(MEAN) - SIGMA²/2`` (so the mean is MEAN), rounded, at least 1.

The output length is sent as ``max_tokens`` with ``ignore_eos`` (the default), so each answer is
exactly that long. Prompts are made of real English words so their token count is close to the
target: with a tokenizer (``--tokenizer``: a Hugging Face folder or ``tokenizer.json``) each
word's cost is measured and the text is fitted to the exact count of its own tokens; without
one a word counts as one token (true for the common words used here in most BPE
vocabularies). A chat template adds a few tokens around the content.

Shapes:

- synthetic — one user message of ``--prompt-tokens``;
- shared prefix (``--shared-prefix L:G[:volatile]``) — a system prompt of L tokens shared by
  groups of G consecutive requests (conversations, with ``--multi-turn``); ``volatile`` puts a
  per-request timestamp line (``Current time: ...``) at its very start, which defeats prefix
  caching exactly as a real deployment that stamps its system prompt does;
- multi-turn (``--multi-turn T[:C]``) — C conversations at a time, each growing over T turns: turn
  t re-sends turns 1..t-1 (user text and a synthetic assistant answer as long as that turn's
  output) plus a new user message; requests go turn by turn across the C conversations, then the
  next C conversations start;
- dataset (``--dataset FILE.jsonl``) — one request per line, cycled: ``{"prompt": "..."}`` or
  ShareGPT-style ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}``
  (sent up to and including the last human turn); an optional integer ``max_tokens`` on a line
  overrides ``--output-tokens``. A malformed line is a :class:`WorkloadError` naming the line.

For ``--endpoint completions`` the messages are joined into one prompt (contents separated by a
blank line).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

# Common English words; each is a single token (with its leading space) in most BPE vocabularies.
WORDS = (  # noqa: SIM905
    "the of and to in is was for on that with as by at from his her they this which be "
    "are have had not but what all were when we there can an your one more said if do will "
    "each about how up out them then she many some so these would other into has two time "
    "like him see could people than first been who its now my made over did down only way "
    "find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think "
    "also around another came come work three word must because does part even place well "
    "such here take why help put different away again old number great tell men say small "
    "every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few "
    "those always show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animal life enough took "
    "four head above kind began almost live page got earth need far hand high year mother "
    "light country father let night picture being study second soon story since white ever "
    "paper hard near sentence better best across during today however sure knew try told "
    "young sun thing whole hear example heard several change answer room sea against top "
    "turned learn point city play toward five himself usually money seen car morning"
).split()

_SPEC_RE = re.compile(r"^\s*(?:(fixed|uniform|lognormal)\s*:)?\s*([0-9.:\-\s]+?)\s*$")


class WorkloadError(ValueError):
    """A bad workload option or dataset line (one-line message)."""


# ----- lengths -----


@dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts: ``fixed`` (a), ``uniform`` [a, b], ``lognormal``
    (mean a, sigma b)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        mu = math.log(self.a) - self.b**2 / 2
        return max(1, round(float(rng.lognormal(mu, self.b))))

    @property
    def mean(self) -> float:
        return {"fixed": self.a, "uniform": (self.a + self.b) / 2}.get(self.kind, self.a)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}"


def parse_length(text: str, what: str = "length") -> LengthSpec:
    """``'128'``, ``'fixed:128'``, ``'uniform:64:256'``, ``'lognormal:128:0.5'`` → LengthSpec.

    Raises:
        WorkloadError: one line naming ``what`` and the value.
    """
    bad = f"bad {what} {text!r}"
    m = _SPEC_RE.match(str(text))
    if not m:
        raise WorkloadError(
            f"{bad}: expected N, fixed:N, uniform:A:B or lognormal:MEAN:SIGMA (tokens)"
        )
    kind = m.group(1) or "fixed"
    if re.search(r"(^|:)\s*-", m.group(2)):  # "-5", "uniform:-5:9": not a range separator
        raise WorkloadError(f"{bad}: token counts and sigma cannot be negative")
    parts = [p for p in re.split(r"[:\-]", m.group(2)) if p.strip()]
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise WorkloadError(f"{bad}: not a number") from None
    want = {"fixed": 1, "uniform": 2, "lognormal": 2}[kind]
    if len(nums) != want:
        raise WorkloadError(f"{bad}: {kind} takes {want} number{'s' * (want > 1)}")
    if kind in ("fixed", "uniform"):
        if any(n != int(n) or n < 1 for n in nums):
            raise WorkloadError(f"{bad}: token counts are whole numbers of at least 1")
        if kind == "uniform" and nums[0] > nums[1]:
            raise WorkloadError(f"{bad}: the low end is above the high end")
        return LengthSpec(kind, nums[0], nums[1] if kind == "uniform" else 0.0)
    if nums[0] < 1 or nums[1] <= 0 or nums[1] > 5:
        raise WorkloadError(f"{bad}: the mean must be at least 1 and sigma in (0, 5]")
    return LengthSpec(kind, nums[0], nums[1])


# ----- prompt text -----


class PromptMaker:
    """Word-salad prompts of a given token count (exact with a tokenizer, ≈ without)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.cost = np.ones(len(WORDS), dtype=np.int64)
        else:
            self.cost = np.array(
                [len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in WORDS]
            )
        self._ones = np.flatnonzero(self.cost == 1)
        if len(self._ones) == 0:
            self._ones = np.array([int(np.argmin(self.cost))])

    def count(self, text: str) -> int:
        """Tokens in ``text`` (the tokenizer's count, else words)."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, n_tokens: int, rng: np.random.Generator) -> str:
        """A text of about ``n_tokens`` tokens (exactly, with a tokenizer, but for rare
        merges across words)."""
        if n_tokens <= 0:
            return ""
        idx = rng.integers(0, len(WORDS), size=n_tokens)
        costs = np.cumsum(self.cost[idx])
        k = int(np.searchsorted(costs, n_tokens, side="left")) + 1  # words covering n
        picked = [int(i) for i in idx[:k]]
        total = int(costs[k - 1])
        while total > n_tokens and picked:  # the last word overshot: swap in one-token words
            total -= int(self.cost[picked.pop()])
        while total < n_tokens:
            picked.append(int(rng.choice(self._ones)))
            total += int(self.cost[picked[-1]])
        words = [WORDS[i] for i in picked]
        text = " ".join(words)
        if self.tokenizer is not None:  # the first word has no leading space: fix the count
            for _ in range(4):
                diff = self.count(text) - n_tokens
                if diff == 0:
                    break
                if diff > 0:
                    words = words[:-diff] or words[:1]
                else:
                    words += [WORDS[int(rng.choice(self._ones))] for _ in range(-diff)]
                text = " ".join(words)
        return text


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a Hugging Face folder or a ``tokenizer.json`` file.

    Raises:
        WorkloadError: missing or unreadable (one line).
    """
    from tokenizers import Tokenizer

    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise WorkloadError(f"--tokenizer {path}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise WorkloadError(f"--tokenizer {path}: cannot load: {first}") from None


# ----- requests -----


@dataclass
class BenchRequest:
    """One request: chat ``messages`` (also joined for the completions endpoint),
    ``max_tokens``, the prompt's estimated tokens (content only) and a ``tag`` saying where it
    came from (``prefix-3``, ``conv-2/turn-1``, ``line-7``)."""

    index: int
    messages: list[dict]
    max_tokens: int
    prompt_tokens: int
    tag: str = ""

    @property
    def prompt(self) -> str:
        return "\n\n".join(m["content"] for m in self.messages)

    def body(
        self,
        endpoint: str,
        model: str,
        *,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> dict:
        """The JSON body of a streamed request with usage at the end (``top_p`` only when
        below 1)."""
        b: dict = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": temperature,
        }
        if top_p < 1.0:
            b["top_p"] = top_p
        if ignore_eos:
            b["ignore_eos"] = True
        if endpoint == "chat":
            b["messages"] = self.messages
        else:
            b["prompt"] = self.prompt
        return b


@dataclass
class DatasetEntry:
    messages: list[dict]
    max_tokens: int | None = None
    line: int = 0


_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


def load_dataset(path: str | Path) -> list[DatasetEntry]:
    """Read a JSONL prompts file (see the module docstring); blank lines are skipped.

    Raises:
        WorkloadError: ``FILE:LINE: reason`` for the first bad line; a missing or empty file.
    """
    p = Path(path)
    if p.exists() and not p.is_dir() and not p.is_file():
        raise WorkloadError(f"--dataset {p}: not a regular file (a pipe or device?)")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"--dataset {p}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"--dataset {p}: is a folder, not a JSONL file") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"--dataset {p}: not UTF-8 text") from None
    except OSError as exc:
        raise WorkloadError(f"--dataset {p}: cannot read: {exc.strerror or exc}") from None
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        entries.append(_parse_line(line, n, p))
    if not entries:
        raise WorkloadError(f"--dataset {p}: no prompts in the file")
    return entries


def _parse_line(line: str, n: int, p: Path) -> DatasetEntry:
    where = f"{p}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise WorkloadError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise WorkloadError(f"{where}: unreadable JSON value ({str(exc).split(';')[0]})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    max_tokens = obj.get("max_tokens", obj.get("output_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise WorkloadError(f"{where}: max_tokens must be a whole number of at least 1")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
        return DatasetEntry([{"role": "user", "content": prompt}], max_tokens, n)
    conv = obj.get("conversations", obj.get("conversation"))
    if conv is None:
        raise WorkloadError(f"{where}: expected a 'prompt' or a ShareGPT 'conversations' list")
    if not isinstance(conv, list) or not conv:
        raise WorkloadError(f"{where}: 'conversations' must be a non-empty list")
    messages = []
    for k, turn in enumerate(conv, 1):
        if not isinstance(turn, dict):
            raise WorkloadError(f"{where}: conversation turn {k} is not an object")
        who = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        role = _ROLES.get(str(who).lower()) if who is not None else None
        if role is None:
            raise WorkloadError(f"{where}: conversation turn {k}: unknown speaker {who!r}")
        if not isinstance(value, str):
            raise WorkloadError(f"{where}: conversation turn {k}: 'value' must be a string")
        messages.append({"role": role, "content": value})
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise WorkloadError(f"{where}: the conversation has no human turn")
    messages = messages[: last_user + 1]
    if not messages[-1]["content"].strip():
        raise WorkloadError(f"{where}: the last human turn is empty")
    return DatasetEntry(messages, max_tokens, n)


@dataclass
class Workload:
    """Builds request ``i`` (deterministic in ``seed`` and ``i``); see the module docstring."""

    prompt_tokens: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 256))
    output_tokens: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 128))
    shared_prefix: tuple[int, int, bool] | None = None  # (L tokens, G requests, volatile)
    multi_turn: tuple[int, int] | None = None  # (T turns, C conversations at a time)
    dataset: list[DatasetEntry] | None = None
    seed: int = 0
    tokenizer: object = None
    tokenizer_id: str | None = None  # where the tokenizer came from (for the report)
    dataset_path: str | None = None
    start_time: datetime = field(default_factory=lambda: datetime.now(UTC))

    def __post_init__(self):
        if self.dataset is not None and self.multi_turn is not None:
            raise WorkloadError(
                "--multi-turn builds synthetic chats; it cannot be used with --dataset"
            )
        self.maker = PromptMaker(self.tokenizer)
        self._systems: dict[int, tuple[str, int]] = {}

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, *key])

    def _system(self, group: int) -> tuple[str, int]:
        if group not in self._systems:
            n = self.shared_prefix[0]
            self._systems[group] = (self.maker.text(n, self._rng(1, group)), n)
            if len(self._systems) > 4096:  # bounded: old groups are not revisited
                self._systems.pop(next(iter(self._systems)))
        return self._systems[group]

    def _with_system(self, i: int, group: int, messages: list[dict], tokens: int):
        if self.shared_prefix is None:
            return messages, tokens
        text, n = self._system(group)
        if self.shared_prefix[2]:  # volatile: a fresh timestamp in front of the shared text
            stamp = self.start_time + timedelta(milliseconds=i)
            text = f"Current time: {stamp.isoformat(timespec='milliseconds')}.\n{text}"
            n += self.maker.count(text[: text.index("\n")])
        return [{"role": "system", "content": text}, *messages], tokens + n

    def make(self, i: int) -> BenchRequest:
        """Request number ``i`` (0-based)."""
        rng = self._rng(0, i)
        if self.dataset is not None:
            entry = self.dataset[i % len(self.dataset)]
            out = entry.max_tokens or self.output_tokens.sample(rng)
            tokens = sum(self.maker.count(m["content"]) for m in entry.messages)
            group = i // self.shared_prefix[1] if self.shared_prefix else 0
            msgs, tokens = self._with_system(i, group, list(entry.messages), tokens)
            return BenchRequest(i, msgs, out, tokens, f"line-{entry.line}")
        if self.multi_turn is not None:
            turns, convs = self.multi_turn
            wave, j = divmod(i, turns * convs)
            turn, c = divmod(j, convs)
            conv = wave * convs + c
            msgs, tokens, out = [], 0, 1
            for t in range(turn + 1):
                trng = self._rng(2, conv, t)
                n_in, out = self.prompt_tokens.sample(trng), self.output_tokens.sample(trng)
                msgs.append({"role": "user", "content": self.maker.text(n_in, trng)})
                tokens += n_in
                if t < turn:
                    msgs.append({"role": "assistant", "content": self.maker.text(out, trng)})
                    tokens += out
            group = conv // self.shared_prefix[1] if self.shared_prefix else 0
            msgs, tokens = self._with_system(i, group, msgs, tokens)
            return BenchRequest(i, msgs, out, tokens, f"conv-{conv}/turn-{turn + 1}")
        n_in = self.prompt_tokens.sample(rng)
        out = self.output_tokens.sample(rng)
        msgs = [{"role": "user", "content": self.maker.text(n_in, rng)}]
        if self.shared_prefix is not None:
            group = i // self.shared_prefix[1]
            msgs, tokens = self._with_system(i, group, msgs, n_in)
            return BenchRequest(i, msgs, out, tokens, f"prefix-{group}")
        return BenchRequest(i, msgs, out, n_in, "synthetic")


def parse_shared_prefix(text: str) -> tuple[int, int, bool]:
    """``'L:G'`` or ``'L:G:volatile'`` → (L, G, volatile). Raises WorkloadError."""
    parts = [p.strip() for p in str(text).split(":")]
    bad = f"bad --shared-prefix {text!r}"
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2].lower() != "volatile"):
        raise WorkloadError(f"{bad}: expected L:G or L:G:volatile (prefix tokens : group size)")
    try:
        length, group = int(parts[0]), int(parts[1])
    except ValueError:
        raise WorkloadError(f"{bad}: L and G are whole numbers") from None
    if length < 1 or group < 1:
        raise WorkloadError(f"{bad}: L and G must be at least 1")
    return length, group, len(parts) == 3


def parse_multi_turn(text: str) -> tuple[int, int]:
    """``'T'`` or ``'T:C'`` → (turns, conversations at a time; default 16). Raises
    WorkloadError."""
    parts = [p.strip() for p in str(text).split(":")]
    bad = f"bad --multi-turn {text!r}"
    if len(parts) not in (1, 2):
        raise WorkloadError(f"{bad}: expected TURNS or TURNS:CONVERSATIONS")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise WorkloadError(f"{bad}: whole numbers expected") from None
    if any(n < 1 for n in nums):
        raise WorkloadError(f"{bad}: turns and conversations must be at least 1")
    return nums[0], nums[1] if len(nums) == 2 else 16
