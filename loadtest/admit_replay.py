"""What ``admit.lua`` itself costs Redis: the admit calls a running stack
sends (captured with MONITOR for a second of open-loop load of distinct
inputs), replayed on an idle Redis of their own, pipelined, for Redis's CPU
a call and a request.

Live, a script's time also holds the cold caches of a Redis woken between
other processes, and runs vary by a sixth; replayed, only the script's own
work is left, steady to a few per cent, so a change to the script can be
told from noise. ``--script`` replays the same calls on another
``admit.lua`` (one that reads the same arguments); ``--merge K`` joins K
captured calls into one, as a busier gateway sends them. Between rounds the
fair queues, states and the doorbell are emptied and the long inputs
written again (what that costs is measured alone, on empty queues, and
taken off); the quota windows are kept, as live, so a policy whose limits
the replay exceeds measures refusals (each trial says how its last round
went).

    python -m infergate.loadtest.admit_replay [--script FILE] [--merge 4]
"""

import argparse
import contextlib
import hashlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import redis
from infergate.base.ports import free_port
from infergate.base.queue.scripts import source
from infergate.loadtest.redis_cost import bench, stack_arguments
from infergate.loadtest.sweep import cpu_s, local_stack

ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", '"': b'"', "\\": b"\\"}


class Request(NamedTuple):
    keys: list[bytes]
    args: list[bytes]


def monitor_words(line: str) -> list[bytes]:
    """The quoted words of one line of ``redis-cli monitor`` (its escapes undone)."""
    words, at = [], line.find('"')
    while 0 <= at < len(line):
        word, at = bytearray(), at + 1
        while line[at] != '"':
            if line[at] == "\\" and line[at + 1] == "x":
                word.append(int(line[at + 2 : at + 4], 16))
                at += 4
            elif line[at] == "\\":
                word += ESCAPES.get(line[at + 1], line[at + 1].encode())
                at += 2
            else:
                word += line[at].encode()
                at += 1
        words.append(bytes(word))
        at = line.find('"', at + 1)
    return words


def requests_of(words: list[bytes]) -> list[Request]:
    """An admit call's requests (``admit.lua``: ARGV[1] how many, then each
    one's counts of keys and arguments, then its keys and its arguments)."""
    nkeys = int(words[2])
    keys, argv = words[3 : 3 + nkeys], words[3 + nkeys :]
    count = int(argv[0])
    out, k, a = [], 0, 1 + 2 * count
    for r in range(count):
        nk, na = int(argv[1 + 2 * r]), int(argv[2 + 2 * r])
        out.append(Request(keys[k : k + nk], argv[a : a + na]))
        k, a = k + nk, a + na
    return out


def beside(redis_pid: int, program: str) -> str:
    """``program`` (redis-cli, redis-server) from the folder of the running
    ``redis-server`` of ``redis_pid``."""
    return str(Path(f"/proc/{redis_pid}/exe").resolve().with_name(program))


def capture(args: argparse.Namespace) -> tuple[list[list[Request]], str]:
    """One second of a stack's admit calls, under the load, and the
    ``redis-server`` that served them."""
    sha = _sha("admit")
    with (
        local_stack(sys.executable, args.workers, args.gateways, 100, args.policy) as stack,
        tempfile.TemporaryFile("w+") as out,
    ):
        load = threading.Thread(target=bench, args=(args, stack.url, 5.0))
        load.start()
        time.sleep(2.5)
        monitor = subprocess.Popen(
            [beside(stack.redis_pid, "redis-cli"), "-p", str(stack.redis_port), "monitor"],
            stdout=out,
            text=True,
        )
        time.sleep(1.0)
        monitor.terminate()
        monitor.wait()
        load.join()
        out.seek(0)
        calls = [
            requests_of(words)
            for line in out
            if '"EVALSHA"' in line and (words := monitor_words(line))[1] == sha
        ]
        return calls, beside(stack.redis_pid, "redis-server")


def _sha(name: str) -> bytes:
    return hashlib.sha1(source(name).encode()).hexdigest().encode()


def merged(calls: list[list[Request]], k: int) -> list[tuple[int, list[bytes]]]:
    """The calls, K captured ones joined into each, as EVALSHA's numkeys and words."""
    out = []
    for i in range(0, len(calls), k):
        requests = [r for call in calls[i : i + k] for r in call]
        words = [key for r in requests for key in r.keys]
        nkeys = len(words)
        words.append(str(len(requests)).encode())
        for r in requests:
            words += (str(len(r.keys)).encode(), str(len(r.args)).encode())
        words += [a for r in requests for a in r.args]
        out.append((nkeys, words))
    return out


@contextlib.contextmanager
def idle_redis(server: str) -> Iterator[tuple[redis.Redis, int]]:
    """A ``redis-server`` of its own (nothing kept on disk), and its pid."""
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    try:
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                client.ping()
                break
            time.sleep(0.05)
        yield client, process.pid
    finally:
        client.close()
        process.terminate()
        process.wait()


def replay(args: argparse.Namespace, calls: list[list[Request]], server: str) -> None:
    requests = [r for call in calls for r in call]
    # (a request that queues: its windows, then its fair queue, doorbell and fair state)
    queued = [r for r in requests if len(r.keys) > int(r.args[0])]
    queues = {r.keys[int(r.args[0]) + i] for r in queued for i in (0, 1, 2)}
    inputs = {r.keys[-1] for r in requests if len(r.keys) > int(r.args[0]) + 3}
    script = Path(args.script).read_text() if args.script else source("admit")
    sent = merged(calls, args.merge)
    with idle_redis(server) as (client, pid):
        sha = client.script_load(script)
        long_input = b"x" * args.input_chars

        def reset() -> None:
            pipe = client.pipeline(transaction=False)
            if queues:
                pipe.delete(*queues)
            if inputs:
                pipe.mset(dict.fromkeys(inputs, long_input))
            pipe.execute()

        def one_round() -> list[object]:
            reset()
            pipe = client.pipeline(transaction=False)
            for nkeys, words in sent:
                pipe.evalsha(sha, nkeys, *words)
            return pipe.execute(raise_on_error=False)

        one_round()  # (warm-up)
        print(
            f"{len(sent)} calls, {len(requests) / len(sent):.2f} requests a call"
            f" (merge {args.merge})"
        )
        for _ in range(args.trials):
            before = cpu_s(pid)
            for _ in range(args.rounds):
                replies = one_round()
            spent = cpu_s(pid) - before
            before = cpu_s(pid)
            for _ in range(args.rounds):
                reset()
            spent -= cpu_s(pid) - before
            print(
                f"  {spent / (args.rounds * len(sent)) * 1e6:7.1f} µs a call"
                f" {spent / (args.rounds * len(requests)) * 1e6:6.1f} µs a request;"
                f" the last round: {outcomes(replies)}"
            )


def outcomes(replies: list[object]) -> str:
    """How the requests of a round went (the quota windows are not emptied
    between rounds: with tight limits, refusals are what is measured)."""
    seen = {"queued": 0, "refused": 0, "failed": 0}
    for call in replies:
        for reply in call if isinstance(call, list) else [call]:
            went = reply[0] == 1 if isinstance(reply, list) else None
            seen["queued" if went else "failed" if went is None else "refused"] += 1
    return ", ".join(f"{count} {what}" for what, count in seen.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.loadtest.admit_replay")
    p.add_argument("--script", help="another admit.lua to replay the calls on")
    p.add_argument("--merge", type=int, default=1, help="captured calls joined into one")
    p.add_argument("--rounds", type=int, default=30, help="replays of every call a trial")
    p.add_argument("--trials", type=int, default=3)
    stack_arguments(p)
    args = p.parse_args(argv)
    calls, server = capture(args)
    if not calls:
        raise SystemExit("no admit call was captured")
    replay(args, calls, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
