"""The worked examples of docs/how-to-add.md, applied to a copy of the tree and run: each
diff marked ``<!-- checked: NAME -->`` there must apply as it is written and do what the page
says with no other file touched."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "how-to-add.md"
#: what a copy of the package needs (the tests, the data and the docs stay behind)
LEFT_OUT = (".git", ".venv", "tests", "benchmarks", "build", "docs", "*.egg-info", "__pycache__")


def checked_diffs() -> dict[str, str]:
    """``{name: unified diff}`` of the page's checked examples."""
    found = re.findall(r"<!-- checked: (\S+) -->\s*```diff\n(.*?)```", DOC.read_text(), re.S)
    return dict(found)


def files_of(diff: str) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff, re.M)


def patched_copy(tmp_path: Path, diff: str) -> Path:
    """A copy of the package with ``diff`` applied; its parent goes on PYTHONPATH."""
    pkg = tmp_path / "tokenmill"
    shutil.copytree(ROOT, pkg, ignore=shutil.ignore_patterns(*LEFT_OUT))
    out = subprocess.run(["git", "apply", "--verbose", "-"], input=diff, text=True, cwd=pkg,
                         capture_output=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tmp_path


def run_python(tree: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_page_has_its_checked_examples():
    assert set(checked_diffs()) >= {"request-column", "proxy-knob"}


def test_a_request_column_reaches_every_producer_from_two_files(tmp_path):
    diff = checked_diffs()["request-column"]
    assert sorted(files_of(diff)) == ["telemetry/latency.py", "telemetry/rows.py"]
    tree = patched_copy(tmp_path, diff)
    out = run_python(
        tree,
        f"""
        import numpy as np
        import tokenmill.telemetry.latency as latency
        assert latency.__file__.startswith({str(tree)!r}), latency.__file__
        from tokenmill.engine.api.timeline import RequestTimeline
        from tokenmill.engine.config import EngineConfig
        from tokenmill.plan.predict import result_rows
        from tokenmill.plan.simulate import Setup, simulate
        from tokenmill.plan.step_cost import TERMS, Fit, PathFit, ModelShape, StepCostModel
        from tokenmill.plan.workload import ReplayWorkload
        from tokenmill.proxy.observe import Exchange
        from tokenmill.telemetry.otlp_receiver import station_rows
        from tokenmill.telemetry.rows import RequestRow, span_row
        from tokenmill.telemetry.schema import struct_ddl
        from tokenmill.telemetry.spans import request_row

        T0, MS = 1_800_000_000_000_000_000, 1_000_000
        assert "generation_ms DOUBLE" in struct_ddl("requests", RequestRow)
        # the server: first token at 200 ms, the answer's end at 500 ms
        tl = RequestTimeline(arrival_ns=T0, method="POST", path="/v1/chat/completions")
        tl.stats.first_token_ns, tl.stats.output_tokens = T0 + 200 * MS, 2
        tl.token_ns.extend([T0 + 200 * MS, T0 + 260 * MS])
        served = request_row(tl, "ab" * 16, {{}}, T0 + 500 * MS)["generation_ms"]
        # the proxy: the same times, seen at the client's side of the upstream
        ex = Exchange(arrival_ns=T0, endpoint="chat", trace_id="ab" * 16, span_id="cd" * 8,
                      upstream="http://u", token_ns=[T0 + 200 * MS, T0 + 260 * MS],
                      end_ns=T0 + 500 * MS, completion_tokens=2)
        proxied = ex.request_row()["generation_ms"]
        # the OTLP receiver: vLLM's request span, TTFT 0.2 s of an E2E of 0.5 s
        vllm = span_row(trace_id="ab" * 16, span_id="cd" * 8, parent_span_id=None,
                        name="llm_request", kind="SERVER", start_ns=T0, end_ns=T0 + 500 * MS,
                        status_code="OK", attributes={{"gen_ai.latency.time_to_first_token": 0.2,
                        "gen_ai.latency.e2e": 0.5, "gen_ai.usage.completion_tokens": 2}})
        received = station_rows(vllm)[1]["generation_ms"]
        # the planner: one request alone, 20 ms of prefill then 11 ms a decode, 2 ms after it
        coef, zero = np.array([10.0, 1.0, 0.1, 0.0, 0.0, 0.0]), np.zeros(len(TERMS))
        model = StepCostModel(
            shape=ModelShape(linear_params=1000, lm_head_params=100, attn_flop_per_pair=4,
                        layers=1, kv_bytes_per_token=1),
            paths={{"eager": PathFit(Fit(coef, coef, coef), Fit(zero, zero, zero))}},
            native_rows=None, gap_ms=0.0, threads=0, holdout={{}},
            steps={{"eager_decode": 100, "with_prefill": 100, "all": 200}},
            ranges={{"max_decode_batch": 64, "max_prefill_tokens": 2048}})
        w = ReplayWorkload(arrival_s=np.array([0.0]), input_tokens=np.array([100]),
                     output_tokens=np.array([10]), max_tokens=np.array([10]), tenants=[""],
                     block_hashes=[[]], pre_engine_s=0.005, post_engine_s=0.002, block_size=16)
        result = simulate(w, Setup(EngineConfig(), num_blocks=1000), model)
        planned = result_rows(w, result).execute("SELECT generation_ms FROM requests").fetchone()[0]
        print(served, proxied, received, planned)
        """,
    )
    served, proxied, received, planned = (float(x) for x in out.split())
    assert served == pytest.approx(300.0) and proxied == pytest.approx(300.0)
    assert received == pytest.approx(300.0)
    assert planned == pytest.approx(9 * 11 + 2)  # nine decodes after the first token, then 2 ms


def test_a_proxy_knob_is_one_field_and_its_use(tmp_path):
    diff = checked_diffs()["proxy-knob"]
    assert files_of(diff) == ["proxy/cli.py"]
    tree = patched_copy(tmp_path, diff)
    out = run_python(
        tree,
        """
        import os, subprocess, sys
        from tokenmill.engine.settings import from_options
        from tokenmill.proxy.cli import ProxyConfig
        cfg = from_options(ProxyConfig, {"upstream": "http://127.0.0.1:9", "scrape_timeout": "2m"})
        print(cfg.seconds("scrape_timeout"))
        env = {**os.environ, "COLUMNS": "200"}
        help = subprocess.run([sys.executable, "-m", "tokenmill.engine.cli", "proxy", "--help"],
                              capture_output=True, text=True, env=env, check=True).stdout
        line = next(x for x in help.splitlines() if "--scrape-timeout" in x)
        print(" ".join(line.replace("│", " ").split()))
        """,
    )
    seconds, help_line = out.splitlines()
    assert float(seconds) == 120.0
    assert help_line.startswith("--scrape-timeout DURATION Longest wait for one /metrics answer")
    assert "[default: 5s]" in help_line
