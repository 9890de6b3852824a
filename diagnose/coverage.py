"""Which rules a store lets the diagnoser assess, and for the rest, what is missing.

Every rule declares the signal families it reads (``Rule.reads``), and every family the store
tables it needs (``Family.needs``). A store made by ``tokenmill collect`` from another engine
holds that engine's requests (from its spans) and metric samples, but no per-step records or
device samples of ours: a rule that reads those cannot be judged there, and the report says so
("not assessed: needs per-step records, which this vLLM store does not hold") instead of a
silent "no problems found". A table the store lacks columns of (a store written before them)
counts the same way. A family that ran from its fallback (``Signals.sources``: the engine's
scraped metrics standing in for our step records) counts as fed.
"""

from __future__ import annotations

import duckdb

from tokenmill.telemetry.readers import store_engine

from .signals import FAMILIES_BY_NAME, Signals

#: what each table holds, in the words of the report
TABLE_WORDS = {
    "requests": "per-request rows",
    "engine_steps": "per-step records (engine_steps)",
    "device_samples": "device samples",
    "events": "server events",
}


def _empty_tables(con: duckdb.DuckDBPyConnection, tables: set[str]) -> set[str]:
    out = set()
    for t in sorted(tables):
        try:
            (has_rows,) = con.execute(f"SELECT EXISTS (SELECT 1 FROM {t})").fetchone()
        except duckdb.Error:  # a table the store lacks entirely
            has_rows = False
        if not has_rows:
            out.add(t)
    return out


def not_assessed(con: duckdb.DuckDBPyConnection, sig: Signals, rules) -> dict[str, str]:
    """``{rule id: reason}`` for every rule of ``rules`` that reads a family the store cannot
    feed: columns it lacks (``sig.unavailable``) or a table with no rows at all."""
    fed = sig.sources  # families that ran from their fallback
    needed = {t for r in rules for n in r.reads if n not in fed for t in FAMILIES_BY_NAME[n].needs}
    empty = _empty_tables(con, needed)
    engine = store_engine(con)
    who = f"this {engine} store does not hold" if engine else "this store does not hold"
    out = {}
    for rule in rules:
        lacking: set[str] = set()
        for name in rule.reads:
            if name in fed:
                continue
            fam = FAMILIES_BY_NAME[name]
            if name in sig.unavailable:
                lacking |= {c.split(".")[0] for c in sig.unavailable[name]}
            lacking |= set(fam.needs) & empty
        if lacking:
            words = ", ".join(TABLE_WORDS.get(t, t) for t in sorted(lacking))
            out[rule.id] = f"needs {words}, which {who}"
    return out
