"""``loadtest/admit_replay.py`` reads admit calls back from ``redis-cli
monitor`` exactly: a real Redis, a real monitor, arguments with every kind
of byte the monitor escapes, and the call rebuilt word for word."""

import subprocess
from pathlib import Path

import redis
from infergate.loadtest.admit_replay import beside, merged, monitor_words, requests_of
from infergate.redis_server import RedisServer

from tests.helpers import wait_for

TRICKY = [b'{"id":"a\\"b"}', b"tab\there\nnew", b"\x00\x01\xff", "é ü".encode(), b"", b"x y"]


def test_an_admit_call_is_read_back_from_the_monitor_word_for_word(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # Two requests, as admit.lua reads a call: ARGV[1] how many, each one's
    # counts of keys and arguments, then their keys, then their arguments.
    keys = [b"{t}:w1", b"{t}:fq", b"{t}:w2"]
    argv = [b"2", b"2", b"4", b"1", b"2", *TRICKY]
    seen = tmp_path / "monitor.txt"
    client = redis.Redis.from_url(redis_server.url)
    sha = client.script_load("return 1")
    with seen.open("w") as out:
        monitor = subprocess.Popen(
            [beside(redis_server.proc.pid, "redis-cli"), "-p", str(redis_server.port), "monitor"],
            stdout=out,
        )
        try:
            wait_for(lambda: seen.read_bytes().startswith(b"OK"), 10.0, "the monitor")
            client.evalsha(sha, len(keys), *keys, *argv)
            wait_for(lambda: b'"EVALSHA"' in seen.read_bytes(), 10.0, "the call in the monitor")
        finally:
            monitor.terminate()
            monitor.wait()
            client.close()
    line = next(line for line in seen.read_text().splitlines() if '"EVALSHA"' in line)
    read = monitor_words(line)
    assert read == [b"EVALSHA", sha.encode(), str(len(keys)).encode(), *keys, *argv]
    requests = requests_of(read)
    assert [(r.keys, r.args) for r in requests] == [
        (keys[:2], TRICKY[:4]),
        (keys[2:], TRICKY[4:]),
    ]
    ((nkeys, rebuilt),) = merged([requests], 1)
    assert (nkeys, rebuilt) == (len(keys), [*keys, *argv])
