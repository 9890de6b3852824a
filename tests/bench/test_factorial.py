"""``bench/factorial.py``'s plans (every run's bench steps and server flags accepted by the
commands' own parsers, 35-50 s of traffic, a fault of at least 25 s, ids unique, every fault at
every magnitude in the small plan, a twin per shape, the split by shape) and
``bench/generalization.py``'s metrics on small hand-made inputs."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pytest

from tokenmill.bench import factorial as fx
from tokenmill.bench import generalization as gen

ROOT = Path(__file__).resolve().parents[2]
SMALL = fx.plan("small")
FULL = fx.plan("full")


def test_the_small_plan_is_every_shape_s_twin_and_each_fault_once_per_shape():
    ids = [r.id for r in SMALL]
    assert len(ids) == len(set(ids)) == len(fx.SHAPES) * (1 + len(fx.FAULTS)) == 91
    assert {r.id for r in SMALL if r.labels["fault"] is None} == {
        f"f-{s}-healthy" for s in fx.SHAPES
    }
    seen = Counter((r.labels["fault"], r.labels["magnitude"]) for r in SMALL if r.labels["fault"])
    assert set(seen) == {(f, m) for f in fx.FAULTS for m in fx.MAGNITUDES}
    # tune shapes first, then the held-out ones
    splits = [r.split for r in SMALL]
    assert splits == sorted(splits, key=lambda s: s != "tune")
    assert ids[0] == "f-closed-healthy"
    assert "f-tenants-kv_pressure-severe" in ids


def test_the_full_plan_and_its_filters():
    assert len(FULL) == len(fx.SHAPES) * (1 + 3 * len(fx.FAULTS)) == 247
    assert len({r.id for r in FULL}) == 247
    only = fx.plan("full", shapes=["long"], faults=["overload"], magnitudes=["severe"])
    assert [r.id for r in only] == ["f-long-overload-severe"]
    held = fx.plan("small", split="heldout")
    assert {r.labels["shape"] for r in held} == set(fx.HELDOUT_SHAPES)
    assert [r.id for r in fx.plan("small", faults=["healthy"])] == [
        f"f-{s}-healthy" for s in (*fx.TUNE_SHAPES, *fx.HELDOUT_SHAPES)
    ]


def test_the_split_is_by_shape_and_labels_carry_shape_fault_magnitude():
    for r in FULL:
        lb = r.labels
        assert r.split == ("tune" if lb["shape"] in fx.TUNE_SHAPES else "heldout")
        if lb["fault"] is None:
            assert r.id == f"f-{lb['shape']}-healthy"
            assert lb["magnitude"] is None and r.expect == [] and r.fault_start_s is None
        else:
            assert r.id == f"f-{lb['shape']}-{lb['fault']}-{lb['magnitude']}"
            own = list(fx.FAULTS[lb["fault"]].expect)
            if (lb["shape"], lb["fault"]) == ("pd", "kv_pressure"):
                # the decode side's pool: the P/D ratio is as right a name
                own.insert(1, "pd_ratio_imbalance")
            assert r.expect == own
            assert r.fault_start_s == lb["fault_window_s"][0] > 0


def test_every_planned_run_parses_and_lasts_35_to_50_s():
    """Each step through ``tokenmill bench``'s own parser and checks, each server flag list
    through ``tokenmill serve``'s and the engine config's validation (full plan)."""
    bad = {r.id: fx.check_run(r) for r in FULL}
    assert not {k: v for k, v in bad.items() if v}
    for r in FULL:
        win = r.labels["fault_window_s"]
        if win:
            assert win[1] - win[0] >= fx.MIN_FAULT_S, r.id
        assert 35 <= fx.traffic_s(r) <= 50, r.id


def test_a_fault_lies_on_its_twin_s_traffic_unchanged():
    """A faulted run sends its shape's twin's steps first, the same bytes, and adds its own."""
    twins = {r.labels["shape"]: r for r in FULL if r.labels["fault"] is None}
    for r in FULL:
        twin = twins[r.labels["shape"]]
        assert r.scenario.steps[: len(twin.scenario.steps)] == twin.scenario.steps
        assert r.scenario.server[: len(twin.scenario.server)] == twin.scenario.server
    assert (
        fx.make_run("open", "overload", "mild").scenario == by_id("f-open-overload-mild").scenario
    )  # deterministic


def by_id(rid):
    return next(r for r in FULL if r.id == rid)


def test_the_checks_refuse_what_the_commands_refuse():
    assert fx.check_bench_args(["--concurrency", "2", "--phases", "steady:40s"]) is None
    assert "No such option" in fx.check_bench_args(["--concurency", "2"])
    assert fx.check_bench_args(["--concurrency", "1", "--request-rate", "2", "--phases", "a:5s"])
    assert fx.check_bench_args(["--concurrency", "1", "--phases", "steady:forever"])
    assert fx.check_bench_args(
        ["--concurrency", "1", "--num-requests", "3", "--prompt-tokens", "uniform:9:3"]
    )
    assert fx.check_server_args(["--quantization", "int8", "--no-enable-chunked-prefill"]) is None
    assert fx.check_server_args(["--quantization", "int3"])
    assert fx.check_server_args(["--speculative-config", '{"method": "eagle"}'])
    assert fx.check_server_args(["--num-gpu-blocks-override", "0"])


def test_magnitudes_grow_the_fault():
    def p(shape, fault, mag):
        return by_id(f"f-{shape}-{fault}-{mag}").params["fault"]

    for shape in fx.SHAPES:
        hogs = [p(shape, "neighbour", m)["procs"] for m in fx.MAGNITUDES]
        assert hogs == [1, 2, 4]
        assert [p(shape, "periodic", m)["busy_s"] for m in fx.MAGNITUDES] == [0.4, 0.8, 1.5]
        pools = [p(shape, "kv_pressure", m)["blocks"] for m in fx.MAGNITUDES]
        rates = [p(shape, "overload", m)["rate"] for m in fx.MAGNITUDES]
        assert rates == sorted(rates) and rates[0] < rates[-1], shape
        assert [p(shape, "prefill_interference", m)["long_prompt"] for m in fx.MAGNITUDES] == [
            500,
            1000,
            1800,
        ]
        assert [p(shape, "prefix_miss", m)["prefix"] for m in fx.MAGNITUDES] == [150, 300, 500]
        # the pool holds the shape's own requests and one of the fault's at every magnitude
        for m, blocks in zip(fx.MAGNITUDES, pools, strict=True):
            q = p(shape, "kv_pressure", m)
            assert q["own_blocks"] < blocks < q["own_blocks"] + q["fault_blocks"], (shape, m)


def test_the_split_and_the_tune_shapes_magnitudes():
    """Every shape looked at is a tune shape (dp, pd and mixed since they were scored); the
    held-out ones come after them, so adding them left the tune shapes' small-plan magnitudes
    (by their index) as they were."""
    assert tuple(fx.SHAPES) == (*fx.TUNE_SHAPES, *fx.HELDOUT_SHAPES)
    assert len(fx.TUNE_SHAPES) == 11 and fx.TUNE_SHAPES[8:] == ("dp", "pd", "mixed")
    assert fx.HELDOUT_SHAPES == ("sysprompt", "budget")
    ids = {r.id for r in SMALL}
    assert {
        "f-closed-neighbour-mild",
        "f-spec-neighbour-moderate",
        "f-spec-overload-moderate",
    } <= ids
    assert {"f-dp-neighbour-severe", "f-pd-kv_pressure-severe", "f-mixed-prefix_miss-mild"} <= ids
    assert {"f-sysprompt-neighbour-severe", "f-budget-neighbour-mild"} <= ids
    assert {r.split for r in SMALL if r.labels["shape"] in ("dp", "pd", "mixed")} == {"tune"}


def test_kv_pressure_on_two_replicas_is_each_replica_s():
    """On dp the pool flag is each replica's: it holds a replica's share of the shape's
    requests (the larger half) and the fault sends 4-5 long answers per replica."""
    closed, dp = by_id("f-closed-kv_pressure-severe"), by_id("f-dp-kv_pressure-severe")
    q = dp.params["fault"]
    assert q["replicas"] == 2 and "replicas" not in closed.params["fault"]
    clients = dp.params["shape"]["clients"]
    assert q["own_blocks"] == math.ceil(math.ceil(clients / 2) * 9 * 1.25)
    step = dp.scenario.steps[-1]["args"]
    assert step[step.index("--concurrency") + 1] == str(2 * q["clients"])
    server = dp.scenario.server
    assert server[:2] == ["--data-parallel-size", "2"]
    assert server[2:] == ["--num-gpu-blocks-override", str(q["blocks"])]


def test_kv_pressure_on_pd_caps_the_decode_side():
    """The decode core holds whole requests; the prefill side keeps its default pool."""
    r = by_id("f-pd-kv_pressure-moderate")
    blocks = str(r.params["fault"]["blocks"])
    assert r.scenario.server == [
        "--disaggregation",
        "prefill=1,decode=1",
        "--decode-num-gpu-blocks-override",
        blocks,
    ]
    assert fx.check_server_args(r.scenario.server) is None


def test_the_mixed_shape_and_its_overload_send_both_classes():
    """Two concurrent open-loop steps, ~80/20 short chats and 300-600-token prompts, each its
    own rate and seed; overload adds more of each in the same shares, to a capacity of the mix."""
    twin = by_id("f-mixed-healthy")

    def opt(args, name):
        return args[args.index(name) + 1]

    short, long_ = (st["args"] for st in twin.scenario.steps)
    assert opt(short, "--prompt-tokens") == "uniform:32:96"
    assert opt(long_, "--prompt-tokens") == "uniform:300:600"
    assert opt(short, "--seed") != opt(long_, "--seed")
    rates = [float(opt(a, "--request-rate")) for a in (short, long_)]
    assert 0.5 <= sum(rates) <= 0.71 and rates[1] / sum(rates) == pytest.approx(0.2, abs=0.01)
    base = fx.base_of("mixed")
    cap = fx.base_capacity_rps(base)
    assert base.rate_rps < 0.5 * cap  # under capacity
    assert cap < fx.capacity_rps((32, 96), (16, 48))
    over = by_id("f-mixed-overload-severe")
    extra = over.scenario.steps[2:]
    assert [opt(st["args"], "--prompt-tokens") for st in extra] == [
        "uniform:32:96",
        "uniform:300:600",
    ]
    total = over.params["fault"]["rate"]
    extra_rates = [float(opt(st["args"], "--request-rate")) for st in extra]
    assert sum(extra_rates) == pytest.approx(total, abs=0.01)
    assert total + base.rate_rps == pytest.approx(4.0 * cap, abs=0.02)


def test_the_sysprompt_shape_shares_one_system_prompt_and_its_overload_its_length():
    """One open-loop step whose requests all open with one 300-400-token system prompt: the
    pool kv_pressure leaves holds its blocks once; overload's extra requests carry a system
    prompt of the same length under their own seed; the capacity is the questions'."""
    twin = by_id("f-sysprompt-healthy")

    def opt(args, name):
        return args[args.index(name) + 1]

    [step] = twin.scenario.steps
    system = twin.params["shape"]["system_prompt"]
    assert 300 <= system <= 400 and opt(step["args"], "--shared-prefix") == f"{system}:1000"
    assert opt(step["args"], "--prompt-tokens") == "uniform:16:64"
    assert twin.scenario.server == []
    q = by_id("f-sysprompt-kv_pressure-severe").params["fault"]
    assert q["own_blocks"] == math.ceil(1.25 * (math.ceil(system / 16) + 6 * (7 + 1)))
    base = fx.base_of("sysprompt")
    assert fx.base_capacity_rps(base) == fx.capacity_rps((16, 64), (16, 48))
    over = by_id("f-sysprompt-overload-mild")
    extra = over.scenario.steps[-1]["args"]
    assert opt(extra, "--shared-prefix") == f"{system}:1000"
    assert opt(extra, "--seed") != opt(step["args"], "--seed")
    # the prefix-miss fault's own system prompt changes every request
    miss = by_id("f-sysprompt-prefix_miss-moderate").scenario.steps[-1]["args"]
    assert opt(miss, "--shared-prefix").endswith(":volatile")


def test_the_budget_shape_keeps_its_step_budget_under_every_fault():
    """A step budget of 256 tokens on the twin and every faulted run, the prefill-interference
    runs' chunked prefill off beside it (the commands accept both)."""
    for r in FULL:
        if r.labels["shape"] != "budget":
            continue
        assert r.scenario.server[:2] == ["--max-num-batched-tokens", "256"], r.id
    r = by_id("f-budget-prefill_interference-severe")
    assert r.scenario.server == [
        "--max-num-batched-tokens",
        "256",
        "--no-enable-chunked-prefill",
    ]
    assert fx.check_server_args(r.scenario.server) is None
    [step] = by_id("f-budget-healthy").scenario.steps
    assert step["args"][step["args"].index("--prompt-tokens") + 1] == "uniform:32:448"


def test_the_tenants_shape_uses_the_tenants_file_s_keys():
    from tokenmill.engine.api.gateway import hash_key, load_tenants

    r = by_id("f-tenants-overload-mild")
    path = r.scenario.server[r.scenario.server.index("--tenants") + 1]
    tenants = load_tenants(path)
    keys = {t.key_sha256 for t in tenants.values()}
    for st in r.scenario.steps:
        key = st["args"][st["args"].index("--api-key") + 1]
        assert hash_key(key) in keys
    fault_key = r.scenario.steps[-1]["args"][1]
    assert fault_key == fx.tenant_key(fx.FAULT_TENANT)


def test_list_prints_the_plan(capsys):
    assert fx.main(["--list", "--shapes", "closed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "7 runs"
    assert all("INVALID" not in line for line in out)


# ----- the generalization metrics -----


def test_effect_buckets_at_their_edges():
    assert [gen.effect_bucket(x) for x in (None, 0.7, 1.29, 1.3, 1.99, 2.0, 3.9, 4.0, 40.0)] == [
        "unknown",
        "<1.3",
        "<1.3",
        "1.3-2",
        "1.3-2",
        "2-4",
        "2-4",
        ">4",
        ">4",
    ]


def test_effect_is_the_largest_ratio_the_twin_can_be_divided_by():
    run = {"decode_step_p50_ms": 60.0, "ttft_p99_ms": 300.0, "itl_p99_ms": 90.0}
    twin = {"decode_step_p50_ms": 30.0, "ttft_p99_ms": 250.0, "itl_p99_ms": 30.0}
    assert gen.effect(run, twin) == pytest.approx(3.0)
    assert gen.effect(run, {**twin, "itl_p99_ms": 0}) == pytest.approx(2.0)
    assert gen.effect(run, {**twin, "itl_p99_ms": None, "decode_step_p50_ms": None}) == (
        pytest.approx(1.2)
    )
    assert gen.effect(run, None) is None
    assert gen.effect(run, dict.fromkeys(gen.METRICS)) is None


def test_twins_match_by_shape_and_a_missing_twin_is_none():
    labels = [
        {"id": "f-open-healthy", "shape": "open", "fault": None},
        {"id": "f-open-overload-mild", "shape": "open", "fault": "overload"},
        {"id": "f-spec-periodic-severe", "shape": "spec", "fault": "periodic"},
    ]
    assert gen.match_twins(labels) == {
        "f-open-overload-mild": "f-open-healthy",
        "f-spec-periodic-severe": None,
    }
    assert gen.twin_id(labels[1]) == "f-open-healthy" and gen.twin_id(labels[0]) is None


def test_the_fault_window_on_the_twin_s_clock():
    run = {"fault_window_s": [8.5, 36.0], "steps_started_ns": 10**12}
    twin = {"steps_started_ns": 5 * 10**12}
    assert gen.window_ns(run) == (10**12 + 8_500_000_000, 10**12 + 36 * 10**9)
    assert gen.window_ns(run, relative_to=twin) == (
        5 * 10**12 + 8_500_000_000,
        5 * 10**12 + 36 * 10**9,
    )
    assert gen.window_ns({"fault_window_s": None, "steps_started_ns": 1}) is None


def _row(rid, shape, fault, mag, expect, findings, inconclusive=(), eff=None):
    return {
        "id": rid,
        "shape": shape,
        "fault": fault,
        "magnitude": mag,
        "expect": list(expect),
        "findings": list(findings),
        "inconclusive": list(inconclusive),
        "effect": eff,
    }


ROWS = [
    _row("f-a-healthy", "a", None, None, [], []),
    _row("f-b-healthy", "b", None, None, [], ["host_contention"]),
    _row("f-a-neighbour-mild", "a", "neighbour", "mild", ["host_contention"], [], ["x"], 1.1),
    _row(
        "f-a-periodic-severe",
        "a",
        "periodic",
        "severe",
        ["periodic_itl_spikes"],
        ["periodic_itl_spikes"],
        eff=5.0,
    ),
    _row(
        "f-b-neighbour-severe",
        "b",
        "neighbour",
        "severe",
        ["host_contention"],
        ["overload", "host_contention"],
        eff=2.5,
    ),
    _row(
        "f-b-overload-moderate",
        "b",
        "overload",
        "moderate",
        ["overload", "ttft_queueing"],
        ["ttft_queueing"],
        eff=None,
    ),
    _row("f-b-periodic-mild", "b", "periodic", "mild", ["periodic_itl_spikes"], [], eff=1.31),
]


def test_the_confusion_matrix_counts_the_first_finding_or_why_none():
    assert gen.confusion(ROWS) == {
        "neighbour": {"inconclusive-only": 1, "overload": 1},
        "overload": {"ttft_queueing": 1},
        "periodic": {"healthy": 1, "periodic_itl_spikes": 1},
    }


def test_the_summary_of_hand_made_rows():
    s = gen.summarize(ROWS)
    assert (s["runs"], s["faulted_runs"], s["twins"]) == (7, 5, 2)
    assert s["top1"] == {"runs": 5, "right": 2, "share": 0.4}
    assert s["recall"] == {"runs": 5, "right": 3, "share": 0.6}
    assert s["top1_by_shape"]["a"]["right"] == 1 and s["top1_by_shape"]["b"]["right"] == 1
    assert s["top1_by_shape"]["b"]["runs"] == 3
    assert s["twins_with_findings"] == {"f-b-healthy": ["host_contention"]}
    assert s["by_magnitude"]["mild"]["recall"] == {"runs": 2, "right": 0, "share": 0.0}
    assert s["by_magnitude"]["severe"]["recall"]["right"] == 2
    assert s["by_magnitude"]["severe"]["top1"]["right"] == 1
    assert s["by_magnitude"]["moderate"]["top1"] == {"runs": 1, "right": 1, "share": 1.0}
    by = {b: (v["runs"], v["right"]) for b, v in s["recall_by_effect"].items()}
    assert by == {"<1.3": (1, 0), "1.3-2": (1, 0), "2-4": (1, 1), ">4": (1, 1), "unknown": (1, 1)}
    md = gen.markdown(s, "heldout")
    assert "f-b-healthy: host_contention" in md
    assert "| neighbour |  | 1 | 1 |  |  |" in md  # inconclusive-only, overload


def test_the_blind_set_summary_by_first_expected_rule():
    res = lambda findings, inc=(): SimpleNamespace(  # noqa: E731
        findings=[(f, 0.9) for f in findings], inconclusive=list(inc)
    )
    rows = [
        gen.blind_row({"id": "healthy_int8", "expect": []}, res(["quantization_no_gain"])),
        gen.blind_row({"id": "healthy_rag", "expect": []}, res([], ["x"])),
        gen.blind_row(
            {"id": "surge", "expect": ["overload", "ttft_queueing"]}, res(["ttft_queueing"])
        ),
        gen.blind_row(
            {"id": "cron", "expect": ["periodic_itl_spikes", "host_contention"]},
            res(["host_bound_steps", "host_contention"]),
        ),
        gen.blind_row({"id": "proxy", "expect": ["client_server_ttft_gap"]}, res([], ["y"])),
    ]
    s = gen.summarize_blind(rows)
    assert (s["runs"], s["faulted_runs"], s["healthy_runs"]) == (5, 3, 2)
    assert s["top1"] == {"runs": 3, "right": 1, "share": 1 / 3}
    assert s["recall"]["right"] == 2  # cron: host_contention among its findings
    assert s["healthy_with_findings"] == {"healthy_int8": ["quantization_no_gain"]}
    assert s["confusion"] == {
        "client_server_ttft_gap": {"inconclusive-only": 1},
        "overload": {"ttft_queueing": 1},
        "periodic_itl_spikes": {"host_bound_steps": 1},
    }
    assert s["situations"]["healthy_rag"] == {
        "expect": [],
        "first": "inconclusive-only",
        "right": True,
    }
    assert [k for k, v in s["situations"].items() if v["right"]] == ["healthy_rag", "surge"]
    assert "| cron | periodic_itl_spikes, host_contention | host_bound_steps | no |" in (
        gen.markdown_blind(s)
    )


CORPUS = ROOT / "benchmarks" / "data" / "diagnosis_corpus"
TWO = (CORPUS / "healthy-0", CORPUS / "host_contention-1")


@pytest.mark.skipif(not all(p.is_dir() for p in TWO), reason="no recorded corpus runs")
def test_measure_reads_a_dump_over_a_window(tmp_path):
    dump = TWO[1] / "dump"
    whole = gen.measure(dump)
    assert all(whole[m] and whole[m] > 0 for m in gen.METRICS)
    [(t0,)] = duckdb.sql(
        f"SELECT min(start_ns) FROM read_parquet('{dump / 'engine_steps.parquet'}')"
    ).fetchall()
    assert gen.measure(dump, (0, 1)) == dict.fromkeys(gen.METRICS)
    part = gen.measure(dump, (t0, t0 + 10**10))
    assert part["decode_step_p50_ms"] > 0


@pytest.mark.skipif(not all(p.is_dir() for p in TWO), reason="no recorded corpus runs")
def test_the_benchmark_scores_a_corpus_with_a_missing_twin(tmp_path, capsys):
    """Two recorded runs relabelled as a shape's twin and a faulted run, and a faulted run of
    another shape without its twin: scored, the twinless one with no effect size."""
    corpus = tmp_path / "corpus"
    for src, rid, fault in (
        (TWO[0], "f-closed-healthy", None),
        (TWO[1], "f-closed-neighbour-severe", "neighbour"),
        (TWO[1], "f-procs-neighbour-mild", "neighbour"),
    ):
        shutil.copytree(src / "dump", corpus / rid / "dump")
        label = json.loads((src / "label.json").read_text())
        label.update(id=rid, shape=rid.split("-")[1], fault=fault, split="all")
        label.update(magnitude=rid.split("-")[-1] if fault else None)
        label["fault_window_s"] = [10.0, 35.0] if fault else None
        label["expect"] = ["host_contention"] if fault else []
        (corpus / rid / "label.json").write_text(json.dumps(label))
    spec = importlib.util.spec_from_file_location(
        "diagnosis_generalization", ROOT / "benchmarks" / "diagnosis_generalization.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "g.json"
    assert mod.main(["--corpus", str(corpus), "--split", "all", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    eff = {r["id"]: r["effect"] for r in data["runs"]}
    assert eff["f-procs-neighbour-mild"] is None and eff["f-closed-neighbour-severe"] > 1
    assert data["summary"]["recall_by_effect"]["unknown"]["runs"] == 1
    # the blind set alone (a recorded situation per folder, the corpus's label keys)
    blind = tmp_path / "blind"
    shutil.copytree(TWO[1] / "dump", blind / "noisy" / "dump")
    label = json.loads((TWO[1] / "label.json").read_text())
    label.update(id="noisy", family="noisy", split="blind")
    (blind / "noisy" / "label.json").write_text(json.dumps(label))
    capsys.readouterr()
    args = ["--corpus", str(tmp_path / "none"), "--blind", str(blind), "--out", str(out)]
    assert mod.main(args) == 0
    data = json.loads(out.read_text())
    assert data["summary"] is None and data["blind"]["summary"]["runs"] == 1
    assert data["blind"]["runs"][0]["fault"] == "host_contention"
    assert "Blind set: 1 situations (1 faulted, 0 healthy)" in capsys.readouterr().out
    assert mod.main(["--corpus", str(tmp_path / "none"), "--out", str(out)]) == 2
