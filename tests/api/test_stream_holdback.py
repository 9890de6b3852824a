"""Stop strings on a real server (issue 19, item 4): a stream is withheld only while its tail
may still become a stop string, and the store records how long the server itself withheld the
first text (``requests.text_holdback_ms``), so the diagnoser can tell that from a proxy."""

from __future__ import annotations

import json

import duckdb
import httpx
import pytest
from server_proc import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NEVER = "<<this stop string is sixty characters long and never occurs>>"[:60]
BODY = {
    "model": MODEL,
    "prompt": "The history of bread",
    "max_tokens": 40,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


def _stream(url: str, rid: str, **extra) -> list[str]:
    """The text of each content chunk of one streamed completion, in order."""
    texts = []
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**BODY, **extra},
        headers={"x-request-id": rid},
        timeout=300,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("text"):
                    texts.append(choices[0]["text"])
    return texts


def test_long_stop_string_streams_token_by_token_and_holdback_is_recorded(tmp_path, smollm2_dir):
    assert len(NEVER) == 60
    server = Server(tmp_path, "--model", str(smollm2_dir))
    try:
        plain = _stream(server.url, "plain")
        never = _stream(server.url, "never", stop=[NEVER])
        # a stop string that begins with the first token's text: that text is withheld until
        # the second token departs from the stop string, then released with it
        partial = _stream(server.url, "partial", stop=[plain[0] + "\x00" * 20])
    finally:
        server.stop()
    # before the fix: one content chunk at the end; now about one per token
    assert len(plain) >= 30
    assert never == plain
    assert "".join(partial) == "".join(plain)
    assert partial[0].startswith(plain[0] + plain[1])
    con = duckdb.connect(str(tmp_path / "tokenmill-data" / "traces.duckdb"), read_only=True)
    rows = dict(
        con.execute(
            "SELECT client_request_id, {'ttft': first_token_ns, 'text': first_text_ns, "
            "'held': text_holdback_ms} FROM requests"
        ).fetchall()
    )
    assert rows["plain"]["text"] == rows["plain"]["ttft"] and rows["plain"]["held"] == 0
    assert rows["never"]["text"] == rows["never"]["ttft"] and rows["never"]["held"] == 0
    assert rows["partial"]["text"] > rows["partial"]["ttft"] and rows["partial"]["held"] > 0
