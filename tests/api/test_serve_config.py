"""``tokenmill serve``'s configuration: ``--config FILE`` (YAML, keys are the flag names), the
``TOKENMILL_<OPTION>`` environment variables, and their order (command line, then environment,
then file, then defaults). Each case stops at a check that runs before any model loads, so the
value that reached the server is read from its one-line answer."""

from __future__ import annotations

import os
import subprocess
import sys

MISSING = "/nonexistent/model"


def serve(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.engine.cli", "serve", *args],
        capture_output=True, text=True, timeout=120, env={**base, **(env or {})}, cwd=cwd,
    )  # fmt: skip


def refused(proc) -> bool:
    """The non-loopback refusal: the host reached the server."""
    return proc.returncode == 2 and "refusing to serve 0.0.0.0" in proc.stderr


def test_a_config_file_sets_server_and_engine_options(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("host: 0.0.0.0\nmax-num-seqs: 3\n")
    assert refused(serve("--config", str(cfg), "--model", MISSING))
    # an engine option from the file reaches the option's own check
    cfg.write_text("max_num_seqs: 0\n")
    proc = serve("--config", str(cfg), "--model", MISSING)
    assert proc.returncode == 2 and "'--max-num-seqs'" in proc.stderr, proc.stderr
    # the command line wins over the file
    cfg.write_text("host: 0.0.0.0\n")
    proc = serve("--config", str(cfg), "--host", "127.0.0.1", "--model", MISSING)
    assert proc.returncode == 1 and "does not exist" in proc.stderr, proc.stderr


def test_environment_variables_set_every_option_and_beat_the_file(tmp_path):
    assert refused(serve("--model", MISSING, env={"TOKENMILL_HOST": "0.0.0.0"}))
    proc = serve("--model", MISSING, env={"TOKENMILL_MAX_NUM_SEQS": "0"})
    assert proc.returncode == 2 and "'--max-num-seqs'" in proc.stderr, proc.stderr
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("host: 127.0.0.1\n")
    assert refused(serve("--config", str(cfg), "--model", MISSING,
                         env={"TOKENMILL_HOST": "0.0.0.0"}))  # fmt: skip


def test_a_bad_config_file_is_one_line(tmp_path):
    cases = {
        "hots: 0.0.0.0\n": "unknown option(s) hots",
        "- a\n- b\n": "must be a mapping",
        "host: [unclosed\n": "cannot read",
    }
    for text, needle in cases.items():
        cfg = tmp_path / "bad.yaml"
        cfg.write_text(text)
        proc = serve("--config", str(cfg))
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    proc = serve("--config", str(tmp_path / "absent.yaml"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr
