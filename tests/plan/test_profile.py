"""The profile sweep's levels (``plan/profile.py``): batch sizes up to ``max_num_seqs``, each
prompt length clipped to the context, no more requests at once than the KV pool holds."""

import re

import pytest

from tokenmill.plan.profile import ProfileError, batch_sizes, check_profile, plan_levels
from tokenmill.telemetry.recorded_config import RecordedConfig


def test_batch_sizes_double_up_to_max_num_seqs():
    assert batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(1) == [1]


def test_levels_fit_the_context_and_the_pool():
    cfg = RecordedConfig(max_num_seqs=16, max_model_len=400, block_size=16)
    # 90% of 240 blocks: 3456 tokens; 128 + 32 tokens fit 21 at once, 367 + 32 fit 8
    assert plan_levels(cfg, 240) == [
        (128, 1), (128, 2), (128, 4), (128, 8), (128, 16),
        (367, 1), (367, 2), (367, 4), (367, 8),
    ]  # fmt: skip


def test_a_profile_of_another_setup_is_refused():
    mine = RecordedConfig(recorded=True, model="m", quantization="int8")
    check_profile(mine, RecordedConfig(recorded=True, model="m", quantization="int8"), "p")
    for other, says in (
        (RecordedConfig(recorded=True, model="m", quantization=None), "quantization None"),
        (RecordedConfig(recorded=True, model="n", quantization="int8"), "model 'n'"),
        (RecordedConfig(), "records no engine config"),
    ):
        with pytest.raises(ProfileError, match=re.escape(says)):
            check_profile(mine, other, "p")


def test_a_server_that_lists_no_openai_model_is_one_line(tmp_path):
    """A real HTTP server that is not an OpenAI one (a static file server): a page of HTML, or
    JSON of another shape, where ``/v1/models`` should be, or no completion route; the sweep of
    either engine refuses in one line and writes no profile."""
    import functools
    import http.server
    import threading

    from tokenmill.plan.profile import run_sweep, sweep_upstream

    (tmp_path / "v1").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    cfg = RecordedConfig(max_num_seqs=2, max_model_len=400, block_size=16)
    try:
        for body, says in (
            ("<html>not here</html>", "answered 200 without an OpenAI model list"),
            ('["a list"]', "answered 200 without an OpenAI model list"),
            ('{"data": [{"object": "model"}]}', "answered 200 without an OpenAI model list"),
        ):
            (tmp_path / "v1" / "models").write_text(body)
            with pytest.raises(ProfileError, match=re.escape(says)):
                run_sweep(url, cfg, 100, budget_s=1)
            with pytest.raises(ProfileError, match=re.escape(says)):
                sweep_upstream(url, tmp_path / "rec.duckdb", 2, 2048, budget_s=1)
        # a model list, but every completion refused (the file server answers POST with 501)
        (tmp_path / "v1" / "models").write_text('{"data": [{"id": "m"}]}')
        with pytest.raises(ProfileError, match=f"every sweep request to {url} failed"):
            sweep_upstream(url, tmp_path / "rec.duckdb", 2, 2048, budget_s=1)
        for bad in ("http://127.0.0.1:99999", "http://[::1", "ftp://127.0.0.1:21", "http://:80"):
            with pytest.raises(
                ProfileError, match=re.escape(f"--url {bad!r} is not a server's URL")
            ):
                sweep_upstream(bad, tmp_path / "rec.duckdb", 2, 2048, budget_s=1)
        (tmp_path / "v1" / "models").unlink()
        with pytest.raises(ProfileError, match="answered 404 without an OpenAI model list"):
            sweep_upstream(url, tmp_path / "rec.duckdb", 2, 2048, budget_s=1)
        assert not (tmp_path / "rec.duckdb.profile.duckdb").exists()
    finally:
        httpd.shutdown()
