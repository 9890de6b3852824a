"""One rule in one place: every rule is one module of ``tokenmill.diagnose.rules`` holding its
detector, thresholds, text and console signals, registered once; its runbook, the runbook index
and docs/diagnosis.md follow the registry, and no other module of the diagnoser or the console
names a rule."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from importlib import resources
from pathlib import Path

import duckdb
import pandas as pd
from synth_store import Phase, write_store

import tokenmill.diagnose.rules as rules_pkg
from tokenmill.diagnose.rules import RULES, RULES_BY_ID, Param, Rule

ROOT = Path(__file__).resolve().parents[2]
IDS = [r.id for r in RULES]


def test_ids_are_unique_and_indexed():
    assert len(IDS) == len(set(IDS)) == len(RULES_BY_ID)
    assert list(RULES_BY_ID) == IDS
    for rid in IDS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", rid), rid


def test_every_rule_module_is_registered_once_and_holds_its_rule():
    modules = sorted(
        m.name for m in pkgutil.iter_modules(rules_pkg.__path__) if not m.name.startswith("_")
    )
    assert modules == sorted(IDS), "a rule module is not in RULES, or RULES names a non-module"
    for rule in RULES:
        mod = importlib.import_module(f"tokenmill.diagnose.rules.{rule.id}")
        assert mod.RULE is rule, rule.id
        assert isinstance(rule, Rule)
        # the detector lives in the rule's own module, not in a shared one
        assert rule.detect.__module__ == mod.__name__, rule.id


def test_rule_fields_are_complete():
    for rule in RULES:
        assert rule.title and rule.symptom and rule.causes and rule.checks and rule.knob, rule.id
        assert rule.params, rule.id
        src = inspect.getsource(importlib.import_module(rule.detect.__module__))
        for name, param in rule.params.items():
            assert isinstance(param, Param) and param.source, (rule.id, name)
            assert isinstance(param.default, int | float), (rule.id, name)
            # a threshold nobody reads is a threshold that lies
            assert f'p["{name}"]' in src, (rule.id, name, "threshold not used by its detector")
        for other in (*rule.explains, *rule.explains_when):
            assert other in RULES_BY_ID and other != rule.id, (rule.id, other)
        assert rule.runbook == f"runbooks/{rule.id}.md"
        assert rule.evidence_signals, rule.id
        assert len(set(rule.evidence_signals)) == len(rule.evidence_signals), rule.id


def test_every_rule_has_a_runbook_and_an_index_row_in_registry_order():
    runbooks = resources.files("tokenmill.runbooks")
    shipped = sorted(
        p.name[: -len(".md")]
        for p in runbooks.iterdir()
        if p.name.endswith(".md") and p.name != "README.md"
    )
    assert shipped == sorted(IDS), "a runbook without a rule, or a rule without a runbook"
    for rid in IDS:
        assert runbooks.joinpath(f"{rid}.md").read_text().startswith(f"# {rid}"), rid
    index = runbooks.joinpath("README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|.*\| \[(\w+)\.md\]\((\w+)\.md\) \|$", index, re.M)
    assert [r[0] for r in rows] == IDS, "runbooks/README.md: one row per rule, in RULES order"
    for rid, text, link in rows:
        assert rid == text == link, (rid, text, link)


def test_diagnosis_doc_lists_exactly_the_registry():
    text = (ROOT / "docs" / "diagnosis.md").read_text()
    (count,) = re.findall(r"It then runs (\d+) rules", text)
    assert int(count) == len(RULES), "docs/diagnosis.md: the rule count"
    m = re.search(r"^Rules: (.*?)\.\n\n", text, re.M | re.S)
    assert m, "docs/diagnosis.md: the 'Rules: ...' paragraph"
    listed = re.findall(r"`(\w+)`", m.group(1))
    expected = "Rules: " + ", ".join(f"`{r}`" for r in IDS) + "."
    assert listed == IDS, f"docs/diagnosis.md's rule list should read (rewrapped):\n{expected}"


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_no_other_diagnoser_or_console_module_names_a_rule():
    """A rule's data (evidence signals included) lives in its module; the console and the rest of
    the diagnoser read it from the registry instead of keeping their own per-rule tables."""
    outside = [
        p
        for folder in ("diagnose", "dashboard")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.parent != ROOT / "diagnose" / "rules"
    ]
    assert outside
    for path in outside:
        named = _string_constants(path) & set(IDS)
        assert not named, f"{path.relative_to(ROOT)} names rule(s) {sorted(named)}"


def test_evidence_signals_are_window_signals_and_the_console_shows_them(tmp_path):
    from tokenmill.dashboard import data
    from tokenmill.diagnose.signals import load

    path = tmp_path / "gpu.duckdb"
    # two data-parallel replicas of two tensor-parallel ranks: the per-replica and per-rank
    # signals exist only where there are several; then a disaggregated stretch (the per-side
    # signals exist only with engine_steps.role)
    busy = Phase(duration_s=20, gpu=True, replicas=2, tp_size=2, collective_share=0.1)
    pd_line = Phase(duration_s=10, gpu=True, kv_transfer_ms=5, pd_busy=(0.5, 0.5))
    phases = [busy, pd_line, Phase(duration_s=10, rate_per_s=0)]
    write_store(path, phases, seed=3)
    con = duckdb.connect(str(path), read_only=True)
    try:
        sig = load(con)
    finally:
        con.close()
    known = set().union(*(w.values for w in sig.windows))
    for rule in RULES:
        unknown = set(rule.evidence_signals) - known
        assert not unknown, (rule.id, sorted(unknown), "not a per-window signal")
        # the console charts exactly the rule's own list when every signal has values
        windows = pd.DataFrame({n: [1.0] for n in rule.evidence_signals})
        assert data.evidence_signals(rule.id, windows) == list(rule.evidence_signals)
    fallback = pd.DataFrame({n: [1.0] for n in ("ttft_p99", "itl_p99", "throughput_tok_s")})
    assert data.evidence_signals("no_such_rule", fallback) == list(fallback.columns)
