"""A process's log lines, as an operator's collector reads them: one JSON
object a line, whatever a field holds."""

import json
import os
import subprocess
import sys

CODE = """
from infergate.base import logs
logs.configure("test", "t-1")
log = logs.get("test")
log.info("plain", n=3, ratio=0.5, none=None, items=[1, "a"], word="café")
log.warning("odd", big=2**80, thing=object())
log.warning("undecodable", text="\\udcff")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("failed")
"""


def test_each_event_is_one_json_line_with_its_fields() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "INFERGATE_LOG_FORMAT": "json"},
    )
    lines = done.stderr.splitlines()
    assert '"word":"café"' in lines[0]  # msgspec's (json.dumps writes "caf\\u00e9")
    plain, odd, undecodable, failed = map(json.loads, lines)
    assert plain["event"] == "plain"
    assert plain["level"] == "info"
    assert (plain["n"], plain["ratio"], plain["none"], plain["items"]) == (3, 0.5, None, [1, "a"])
    assert (plain["role"], plain["process_id"]) == ("test", "t-1")
    assert plain["timestamp"].endswith("Z")
    assert plain["word"] == "café"
    assert undecodable["text"] == "\udcff"
    assert odd["big"] == 2**80
    assert odd["thing"].startswith("<object object at")
    assert failed["level"] == "error"
    assert "ValueError: boom" in failed["exception"]
