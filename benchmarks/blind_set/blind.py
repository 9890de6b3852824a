"""The blind set: load its scenario files by path with the project's own loader, and run them.

``tokenmill.bench.scenario.load(name)`` only reads ``bench/scenarios/``; :func:`load_path` points
that same loader at one file anywhere (nothing parsed twice, bench/scenario.py unchanged), and
:func:`~tokenmill.bench.scenario.run_scenario` runs the result exactly as ``tokenmill scenario run``
would. Run from the repository root, one situation at a time, alone on the machine::

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/blind_set/blind.py --check        # parse all
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/blind_set/blind.py --out /tmp/blind NAME ...
    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/blind_set/blind.py --out /tmp/blind --all

``--set DIR`` reads another set of the same layout (its YAML files and ``labels.json``, e.g.
``--set benchmarks/blind_set_2``); without it, this folder's set. Each run writes
``OUT/NAME/result.json`` (the runner's own) and appends one line to ``OUT/blind_results.jsonl``
with the top finding next to the label fixed in ``labels.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenmill.bench import scenario as _sc

HERE = Path(__file__).resolve().parent


def load_path(path: str | Path) -> _sc.Scenario:
    """The scenario in the YAML file ``path``, read by :func:`tokenmill.bench.scenario.load`.

    Raises:
        ScenarioError: no such file, or the file is malformed.
    """
    p = Path(path).resolve()
    if not p.is_file():
        raise _sc.ScenarioError(f"no scenario file {p}")
    saved = _sc._files
    _sc._files = lambda: {p.stem: p}
    try:
        return _sc.load(p.stem)
    finally:
        _sc._files = saved


def record(out: Path, scenarios: list[_sc.Scenario], model: str | None) -> int:
    """Each scenario's run on the real engine as a corpus run of split ``blind`` (the corpus's
    recorder: a run disturbed by another process is run again), its diagnosis left unread: the
    recorder's own diagnosis is dropped from the label and its log."""
    from tokenmill.bench.corpus import CorpusRun, generate

    runs = [CorpusRun(sc.name, sc.name, "blind", list(sc.expect), sc, {}, None) for sc in scenarios]
    generate(out, runs, model=model, log=lambda m: None if "top:" in m else print(m))
    for sc in scenarios:
        label = out / sc.name / "label.json"
        if label.exists():
            meta = json.loads(label.read_text())
            meta.pop("scenario_top", None)
            label.write_text(json.dumps(meta, indent=2) + "\n")
    return 0


def files(folder: Path = HERE) -> list[Path]:
    return sorted(Path(folder).glob("*.yaml"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="situations to run (file stems)")
    ap.add_argument("--all", action="store_true", help="run every situation")
    ap.add_argument("--check", action="store_true", help="only parse every file")
    ap.add_argument("--out", type=Path, default=Path("blind-out"))
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--set",
        type=Path,
        default=HERE,
        metavar="DIR",
        help="the set's folder: its *.yaml situations and labels.json (default: this folder)",
    )
    ap.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        help="record each situation's run as a Parquet dump with its label (DIR/NAME/dump, "
        "DIR/NAME/label.json; resumable) without diagnosing it: the set is scored once, later, "
        "by benchmarks/diagnosis_generalization.py --blind DIR",
    )
    a = ap.parse_args(argv)
    scs = {f.stem: load_path(f) for f in files(a.set)}
    labels = {x["name"]: x for x in json.loads((a.set / "labels.json").read_text())}
    assert set(labels) == set(scs), set(labels) ^ set(scs)
    for name, sc in scs.items():
        assert sc.name == name and sc.expect == labels[name]["expect"], name
    if a.check:
        print(
            f"{len(scs)} situations parse; labels match ({sum(not s.expect for s in scs.values())} healthy)"
        )
        return 0
    names = sorted(scs) if a.all else a.names
    if a.record:
        return record(a.record, [scs[n] for n in names], a.model)
    for name in names:
        res = _sc.run_scenario(scs[name], a.out / name, model=a.model)
        line = {
            "name": name,
            "expect": scs[name].expect,
            "top": res["top"],
            "passed": res["passed"],
            "found": [f["rule"] for f in res["findings"]],
        }
        with open(a.out / "blind_results.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
