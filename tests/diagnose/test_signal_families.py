"""Signal families (``diagnose/signals/``) and the rules that read them (``Rule.reads``,
``Rule.needs``).

What each rule reads is found in its module's source (``ast``): ``.get("key")`` on a window, on
``sig.overall`` and on ``sig.baseline`` (keys from a module constant a loop walks included),
the keys ``_worst``/``_varies``/``sig.busy()`` read for it, its ``evidence_signals``, and the
``Signals`` attributes a family makes (``device_kind``, ``decode_seqs_sql``, the errors by
type). Every such key must be yielded by a family the rule declares, and the rule declares no
family it does not read. Each family yields exactly the keys it declares on synthetic stores
(``tests/helpers/synth_store.py``), reads only the columns it declares (its SQL parsed by DuckDB), and
a store without one of its columns gives its keys as None instead of an error. The rules' own
queries (run on their symptom's store) read only columns their families or ``Rule.needs``
declare.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import zlib
from functools import cache
from pathlib import Path

import duckdb
import pytest
from synth_store import Phase, write_store

from tokenmill.diagnose.findings import evaluate, hint_note
from tokenmill.diagnose.rules import RULES, RULES_BY_ID
from tokenmill.diagnose.signals import (
    BASELINE_KEYS,
    FAMILIES,
    FAMILIES_BY_NAME,
    load,
    make_scope,
)

ROOT = Path(__file__).resolve().parents[2]

# what the shared helpers read for the rule that calls them (diagnose/rules/_common.py,
# Signals.busy in diagnose/signals/window.py): busy windows have arrivals or completions
BUSY_KEYS = ("arrivals", "completions")
# Signals attributes a family computes
ATTRIBUTE_FAMILY = {
    "device_kind": "devices",
    "decode_seqs_sql": "steps",
    "errors_by_window": "completions",
    "errors_by_type": "completions",
}
# names rules give dicts that are not signals: their params, the config event, a census row,
# errors by type, another finding's evidence
NOT_SIGNALS = {"p", "cfg", "d", "by_type", "evidence", "numbers", "reqs"}
# the columns load() itself reads before any family (the range, the traffic, the warm-up, the
# config event) and the trace ids a finding's examples are
CORE = {
    "requests": {"arrival_ns", "end_ns", "finish_reason", "error_type", "trace_id"},
    "engine_steps": {"start_ns", "end_ns"},
    "device_samples": {"time_ns", "kind"},
    "events": {"time_ns", "kind", "attributes"},
}


# ----- what a rule reads, from its source -----


@dataclasses.dataclass
class Reads:
    window: set[str] = dataclasses.field(default_factory=set)
    overall: set[str] = dataclasses.field(default_factory=set)
    baseline: set[str] = dataclasses.field(default_factory=set)
    attributes: set[str] = dataclasses.field(default_factory=set)
    # reads the analysis cannot resolve (file:line and why): a rule must read keys it can see
    unresolved: list[str] = dataclasses.field(default_factory=list)


def _is_sig_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "sig"
    )


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, (ast.Tuple, ast.List)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]
    return None


@cache
def rule_reads(rule_id: str) -> Reads:
    """The keys and attributes rule ``rule_id`` reads (see the module docstring)."""
    path = ROOT / "diagnose" / "rules" / f"{rule_id}.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    out = Reads()
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name) and (vals := _strings(node.value)) is not None:
                consts[t.id] = vals
    loops: dict[str, list[str]] = {}  # loop variable -> the string constants it walks
    aliases: dict[str, str] = {}  # o = sig.overall
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            it = node.iter
            vals = consts.get(it.id) if isinstance(it, ast.Name) else _strings(it)
            if vals is not None:
                loops[node.target.id] = vals
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            for attr in ("overall", "baseline", "config"):
                if isinstance(t, ast.Name) and _is_sig_attr(node.value, attr):
                    aliases[t.id] = attr

    def where(node) -> str:
        return f"{path.name}:{node.lineno}"

    for node in ast.walk(tree):
        if _is_sig_attr(node, getattr(node, "attr", "")) and node.attr in ATTRIBUTE_FAMILY:
            out.attributes.add(node.attr)
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("_worst", "_varies"):
            key = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                out.unresolved.append(f"{where(node)}: {f.id} with a key that is not a string")
                continue
            out.window.add(key.value)
            if f.id == "_worst":
                out.window.update(BUSY_KEYS)
            continue
        if _is_sig_attr(f, "busy"):
            out.window.update(BUSY_KEYS)
            continue
        if not (isinstance(f, ast.Attribute) and f.attr == "get" and node.args):
            continue
        recv, arg = f.value, node.args[0]
        if isinstance(recv, ast.Name) and recv.id in aliases:
            kind = aliases[recv.id]
        elif isinstance(recv, ast.Attribute) and isinstance(recv.value, ast.Name):
            kind = recv.attr if recv.value.id == "sig" else "?"
        elif isinstance(recv, ast.Name):
            kind = "other" if recv.id in NOT_SIGNALS else "window"
        else:
            kind = "?"
        if kind in ("config", "sources", "other", "errors_by_window", "errors_by_type"):
            continue
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            keys = [arg.value]
        elif isinstance(arg, ast.Name) and arg.id in loops:
            keys = loops[arg.id]
        else:
            out.unresolved.append(f"{where(node)}: .get() of a key the test cannot see")
            continue
        if kind == "?":
            out.unresolved.append(f"{where(node)}: .get({keys[0]!r}) on an unknown receiver")
        elif kind == "window":
            out.window.update(keys)
        elif kind in ("overall", "baseline"):
            getattr(out, kind).update(keys)
        else:
            out.unresolved.append(f"{where(node)}: .get({keys[0]!r}) on sig.{kind}")
    out.window.update(RULES_BY_ID[rule_id].evidence_signals)
    return out


def _yielders() -> tuple[dict[str, str], dict[str, str]]:
    """key -> the family that yields it, per window and overall."""
    window = {k: f.name for f in FAMILIES for k in f.window_keys}
    overall = {k: f.name for f in FAMILIES for k in f.overall_keys}
    return window, overall


def families_read(rule_id: str) -> set[str]:
    """The families whose keys or attributes the rule reads (unknown keys left out)."""
    r = rule_reads(rule_id)
    window, overall = _yielders()
    fams = {window[k] for k in r.window | r.baseline if k in window}
    fams |= {overall[k] for k in r.overall if k in overall}
    return fams | {ATTRIBUTE_FAMILY[a] for a in r.attributes}


def test_the_analysis_sees_what_rules_read():
    """The source analysis itself: known reads of a few rules, through every path."""
    r = rule_reads("host_bound_steps")  # a loop over a module constant, sig.busy(), _worst
    assert {"schedule_ms_mean", "detokenize_ms_mean", "host_share_of_step"} <= r.window
    assert {"arrivals", "completions", "gpu_util_mean"} <= r.window
    assert r.baseline == {"step_ms_p50"} and "device_kind" in r.attributes
    q = rule_reads("quantization_no_gain")  # o = sig.overall
    assert {"compute_bound_prefill_share", "decode_weight_byte_share"} <= q.overall
    e = rule_reads("error_spike")  # sig.baseline, evidence_signals, errors by window
    assert e.baseline == {"error_rate", "throughput_tok_s"}
    assert {"errors_by_window", "errors_by_type"} <= e.attributes
    assert "sampled_tokens" in e.overall  # o = sig.overall inside a branch
    for rule in RULES:
        assert not rule_reads(rule.id).unresolved, rule_reads(rule.id).unresolved


@pytest.mark.parametrize("rule_id", [r.id for r in RULES])
def test_every_key_a_rule_reads_is_yielded_by_a_family_it_declares(rule_id):
    rule = RULES_BY_ID[rule_id]
    unknown = set(rule.reads) - set(FAMILIES_BY_NAME)
    assert not unknown, f"{rule_id} reads families that do not exist: {sorted(unknown)}"
    declared = [FAMILIES_BY_NAME[n] for n in rule.reads]
    window = {k for f in declared for k in f.window_keys}
    overall = {k for f in declared for k in f.overall_keys}
    r = rule_reads(rule_id)
    yielders, overall_yielders = _yielders()
    # (what is read, the family that yields it)
    missing = [(f"window {k}", yielders.get(k)) for k in sorted(r.window - window)]
    missing += [(f"overall {k}", overall_yielders.get(k)) for k in sorted(r.overall - overall)]
    missing += [
        (f"baseline {k}", "not in BASELINE_KEYS") for k in sorted(r.baseline - set(BASELINE_KEYS))
    ]
    missing += [(f"baseline {k}", yielders.get(k)) for k in sorted(r.baseline - window)]
    missing += [
        (f"Signals.{a}", ATTRIBUTE_FAMILY[a])
        for a in sorted(r.attributes)
        if ATTRIBUTE_FAMILY[a] not in rule.reads
    ]
    assert not missing, f"{rule_id} reads keys no family in its reads= yields: {dict(missing)}"


@pytest.mark.parametrize("rule_id", [r.id for r in RULES])
def test_a_rule_declares_only_the_families_it_reads(rule_id):
    rule = RULES_BY_ID[rule_id]
    assert len(set(rule.reads)) == len(rule.reads), rule.reads
    assert set(rule.reads) == families_read(rule_id), (
        f"{rule_id}: reads={sorted(rule.reads)}, its source reads {sorted(families_read(rule_id))}"
    )


# ----- the families themselves -----


def test_family_keys_never_overlap():
    names = [f.name for f in FAMILIES]
    assert len(set(names)) == len(names)
    for attr in ("window_keys", "overall_keys"):
        keys = [k for f in FAMILIES for k in getattr(f, attr)]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        assert not dup, f"{attr} yielded by more than one family: {dup}"
    for f in FAMILIES:
        assert set(f.needs) | set(f.optional) <= set(CORE), f.name
        for table, cols in f.needs.items():
            assert cols and len(set(cols)) == len(cols), (f.name, table)


def test_baseline_keys_are_window_keys():
    window, _ = _yielders()
    assert set(BASELINE_KEYS) <= set(window), set(BASELINE_KEYS) - set(window)


HEALTHY = Phase(duration_s=30)
# one store for most families: client TTFTs recorded, drafts verified
STORES: dict[str, list[Phase]] = {
    "single": [HEALTHY.but(client_ttft_factor=2.0, running=4, spec_k=3, spec_accept_rate=0.5)],
    "dp": [HEALTHY.but(replicas=2)],
    "tp": [HEALTHY.but(tp_size=2, collective_share=0.2, straggler_rank=1, straggler_slowdown=2)],
    "pd": [HEALTHY.but(kv_transfer_ms=5, pd_busy=(0.3, 0.4), kv_wait_ms=3)],
}
STORE_OF = {"replicas": "dp", "ranks": "tp", "collectives": "tp", "pd": "pd", "kv_transfer": "pd"}


def _stores(tmp_path_factory, folder: str, phases: dict[str, list[Phase]]):
    """``get(name)``: the path of a store of ``phases[name]``, written on first use (seeded by
    the name) in a fresh ``folder``."""
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            path = tmp_path_factory.mktemp(folder) / f"{name}.duckdb"
            write_store(path, phases[name], seed=zlib.crc32(name.encode()) % 1000)
            paths[name] = path
        return paths[name]

    return get


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return _stores(tmp_path_factory, "families", STORES)


class Recorder:
    """A DuckDB connection that keeps the SQL run through ``execute``."""

    def __init__(self, con):
        self._con = con
        self.sql: list[str] = []

    def execute(self, sql, params=None):
        self.sql.append(sql)
        return self._con.execute(sql) if params is None else self._con.execute(sql, params)

    def __getattr__(self, name):
        return getattr(self._con, name)


_PARSER = duckdb.connect()


def _walk(node, out: dict):
    if isinstance(node, dict):
        if node.get("class") == "COLUMN_REF":
            out["columns"].add(node["column_names"][-1].lower())
        if node.get("type") == "BASE_TABLE":
            out["tables"].add(node["table_name"].lower())
        for v in node.values():
            _walk(v, out)
    elif isinstance(node, list):
        for v in node:
            _walk(v, out)


def columns_read(store_columns: dict[str, frozenset[str]], sqls: list[str]) -> dict[str, set]:
    """``table -> columns`` the statements read: DuckDB's parse of each, its column references
    that are columns of a table the statement names."""
    out: dict[str, set] = {}
    for sql in sqls:
        tree = json.loads(_PARSER.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
        assert not tree.get("error"), (tree, sql)
        refs = {"columns": set(), "tables": set()}
        _walk(tree, refs)
        for table in refs["tables"] & set(store_columns):
            out.setdefault(table, set()).update(refs["columns"] & store_columns[table])
    return out


def _undeclared(read: dict[str, set], allowed: dict[str, set]) -> dict[str, list]:
    return {
        t: sorted(cols - allowed.get(t, set()))
        for t, cols in read.items()
        if cols - allowed.get(t, set())
    }


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_a_family_yields_exactly_its_declared_keys_and_reads_only_its_columns(store_path, name):
    family = FAMILIES_BY_NAME[name]
    con = duckdb.connect(str(store_path(STORE_OF.get(name, "single"))), read_only=True)
    scope = make_scope(con)
    assert not family.missing(scope), family.missing(scope)
    rec = Recorder(con)
    got = family.compute(dataclasses.replace(scope, con=rec))
    yielded = {k for v in got.windows.values() for k in v}
    assert yielded == set(family.window_keys), (
        f"undeclared {sorted(yielded - set(family.window_keys))}, "
        f"never yielded {sorted(set(family.window_keys) - yielded)}"
    )
    assert set(got.overall) == set(family.overall_keys)
    allowed = {t: set(family.needs.get(t, ())) | set(family.optional.get(t, ())) for t in CORE}
    undeclared = _undeclared(columns_read(scope.columns, rec.sql), allowed)
    assert not undeclared, f"{name} reads columns it does not declare: {undeclared}"
    # what it needs, it reads (optional columns may go unread on this store; the range's own
    # columns, the warm-up's, only where the store has one)
    read = columns_read(scope.columns, rec.sql)
    unread = {t: set(cols) - read.get(t, set()) - CORE[t] for t, cols in family.needs.items()}
    assert not any(unread.values()), f"{name} declares columns it never reads: {unread}"
    con.close()


def _copy_without(path: Path, table: str, column: str) -> duckdb.DuckDBPyConnection:
    """An in-memory copy of the store at ``path`` whose ``table`` lacks ``column``."""
    con = duckdb.connect()
    con.execute(f"ATTACH '{path}' AS src (READ_ONLY)")
    tables = [
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_catalog = 'src'"
        ).fetchall()
    ]
    for t in tables:
        drop = f" EXCLUDE ({column})" if t == table else ""
        con.execute(f'CREATE TABLE main."{t}" AS SELECT *{drop} FROM src.main."{t}"')
    con.execute("DETACH src")
    return con


def _column_to_drop(family) -> tuple[str, str]:
    """A column of ``family`` that load() itself can do without, needed by as few other
    families as possible."""
    cands = [(t, c) for t, cols in family.needs.items() for c in cols if c not in CORE[t]]
    return min(cands, key=lambda tc: sum(tc[1] in f.needs.get(tc[0], ()) for f in FAMILIES))


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_a_store_without_a_familys_column_gives_none_for_its_keys(store_path, name):
    family = FAMILIES_BY_NAME[name]
    table, column = _column_to_drop(family)
    con = _copy_without(store_path(STORE_OF.get(name, "single")), table, column)
    sig = load(con)  # never an error
    if sig.sources.get(name):  # its fallback stands in, from a table the store still has
        assert sig.sources[name] == family.fallback.name and name not in sig.unavailable
        con.close()
        return
    assert f"{table}.{column}" in sig.unavailable[name]
    for w in sig.windows:
        assert all(w.values[k] is None for k in family.window_keys), (w.index, w.values)
    assert all(sig.overall[k] is None for k in family.overall_keys)
    # the families that do not need the column still run
    others = {f.name for f in FAMILIES if column not in f.needs.get(table, ()) and f.name != name}
    assert not others & set(sig.unavailable), others & set(sig.unavailable)
    con.close()


def test_a_full_store_leaves_no_family_out(store_path):
    con = duckdb.connect(str(store_path("single")), read_only=True)
    sig = load(con)
    assert sig.unavailable == {}
    con.close()


# ----- the rules' own queries -----


@pytest.fixture(scope="module")
def symptom_store(tmp_path_factory):
    from test_diagnose_rules import SCENARIOS

    return _stores(tmp_path_factory, "symptoms", SCENARIOS)


@pytest.mark.parametrize("rule_id", [r.id for r in RULES])
def test_a_rules_own_queries_read_only_declared_columns(symptom_store, rule_id):
    """The rule on its symptom's store (detector, the test behind the finding, its example
    requests, its hint) through a recording connection: every column its SQL reads is one its
    families or its ``needs`` declare."""
    rule = RULES_BY_ID[rule_id]
    con = duckdb.connect(str(symptom_store(rule_id)), read_only=True)
    sig = load(con)
    rec = Recorder(con)
    sig.con = rec
    finding = evaluate(rule, sig)
    assert finding is not None, f"{rule_id} silent on its symptom"
    hint_note(rule, sig)
    read = columns_read(make_scope(con).columns, rec.sql)
    allowed = {t: set(rule.needs.get(t, ())) | CORE.get(t, set()) for t in {*CORE, *rule.needs}}
    for name in rule.reads:
        family = FAMILIES_BY_NAME[name]
        for t in CORE:
            allowed[t] |= set(family.needs.get(t, ())) | set(family.optional.get(t, ()))
    undeclared = _undeclared(read, allowed)
    assert not undeclared, f"{rule_id}: add to its needs= {undeclared}"
    con.close()


def test_rule_needs_name_real_columns(store_path):
    con = duckdb.connect(str(store_path("single")), read_only=True)
    cols = make_scope(con).columns
    con.close()
    for rule in RULES:
        for table, names in rule.needs.items():
            assert table in cols and set(names) <= cols[table], (rule.id, table, names)
    assert inspect.signature(type(RULES[0])).parameters["reads"].default == ()
