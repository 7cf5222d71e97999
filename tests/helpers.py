"""Test helpers: a policy with known keys, and real infergate processes."""

import asyncio
import hashlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import yaml
from infergate.base import clock, wire
from infergate.base.keys import Keys
from infergate.base.ports import free_port

SECRETS = {
    "enterprise": "test-enterprise-secret",
    "paid": "test-paid-secret",
    "free": "test-free-secret",
    "disabled": "test-disabled-secret",
    "admin": "test-admin-secret",
}


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key_entry(key_id: str, tier: str, secret: str, **extra: Any) -> dict[str, Any]:
    return {"id": key_id, "tier": tier, "sha256": sha(secret), **extra}


# The tests' body limit: the enterprise tier's 4000 characters, 4 bytes
# each, and 1 KiB of JSON around them (the policy check's rule), fit.
MAX_BODY_BYTES = 17_408


def policy(
    *,
    deadline_ms: int = 10_000,
    max_batch_size: int = 100,
    pacing: bool = True,
    free_share: float = 0.0,
    extra_keys: tuple[dict[str, Any], ...] = (),
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """The tests' policy as data, with the known keys of ``SECRETS``.
    ``sections`` are merged in, one level deep: ``workers={"max_attempts": 2}``,
    or ``tiers={"free": {"rate_limits": ["2/minute"]}}``."""
    doc: dict[str, Any] = {
        "tiers": {
            tier: {
                "deadline_ms": deadline_ms,
                "max_input_chars": chars,
                "latency_budget_ms": min(deadline_ms, 5000),
                "min_batch_share": free_share if tier == "free" else 0.0,
            }
            for tier, chars in (("enterprise", 4000), ("paid", 2000), ("free", 1000))
        },
        "keys": [
            key_entry("ent", "enterprise", SECRETS["enterprise"]),
            key_entry("pai", "paid", SECRETS["paid"]),
            key_entry("fre", "free", SECRETS["free"]),
            key_entry("retired", "free", SECRETS["disabled"], disabled=True),
            key_entry("adm", "enterprise", SECRETS["admin"], admin=True),
            *extra_keys,
        ],
        "batching": {"max_batch_size": max_batch_size, "pacing": pacing},
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
    }
    for name, values in sections.items():
        if name == "tiers":
            for tier, fields in values.items():
                doc["tiers"][tier].update(fields)
        else:
            doc.setdefault(name, {}).update(values)
    return doc


def as_yaml(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def policy_yaml(**kwargs: Any) -> str:
    """``policy(**kwargs)`` as YAML text."""
    return as_yaml(policy(**kwargs))


def write_policy(path: Path, doc: dict[str, Any] | str) -> None:
    """Replace a policy file the way an editor or `kubectl` does: write, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc if isinstance(doc, str) else as_yaml(doc))
    tmp.replace(path)


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    """``wait_for`` on the test's event loop: ``predicate`` may be async."""
    deadline = time.monotonic() + timeout_s
    while not await _value(predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.01)


async def _value(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, hdrs, payload = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, payload = exc.code, dict(exc.headers), exc.read()
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    try:
        parsed = json.loads(payload) if payload else None
    except json.JSONDecodeError:
        parsed = payload
    return status, hdrs, parsed


def ask_with_demo_key(keys_json: Path, port: int, text: str) -> tuple[int, Any]:
    """POST ``text`` to a local stack with the paid demo key ``up --keys-out``
    wrote: the status and the body."""
    key = json.loads(keys_json.read_text())["paid"]
    status, _, body = http(
        "POST",
        f"http://127.0.0.1:{port}/v1/inference",
        {"input": text},
        {"Authorization": f"Bearer {key}"},
    )
    return status, body


def auth(tier: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + SECRETS[tier]}


def _env(extra: dict[str, str]) -> dict[str, str]:
    """The test's environment without any REDIS_URL of its own, plus ``extra``."""
    base = {
        k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("INFERGATE_")
    }
    # The simulated backend's failure markers are off unless turned on: tests turn them on.
    markers = {"INFERGATE_SIM_FAIL_MARKER": "__fail__", "INFERGATE_SIM_HANG_MARKER": "__hang__"}
    return {**base, "INFERGATE_LOG_FORMAT": "json", **markers, **extra}


class Proc:
    """A real infergate process (``python -m infergate ...``) with its log in a file."""

    def __init__(
        self, args: list[str], env: dict[str, str], log_path: Path, wrapper: Sequence[str] = ()
    ) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # ``wrapper``: a command that runs it, e.g. faketime with a skewed clock.
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "infergate", *args],
            env=_env(env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


class Stack:
    """``infergate up`` against the test's Redis, on a free port."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        *,
        workers: int | str = 4,
        gateways: int = 1,
        latency_ms: int = 100,
        policy: str | None = None,
        namespace: str = "infergate",
        extra_args: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis_url = redis_url
        self.gateways = gateways
        self.keys = Keys(namespace)
        args = [
            "up",
            "--port",
            str(self.port),
            "--workers",
            str(workers),
            "--gateways",
            str(gateways),
            "--sim-latency-ms",
            str(latency_ms),
            "--namespace",
            namespace,
            *(extra_args or []),
        ]
        if policy is not None:
            policy_path = tmp / f"policy-{self.port}.yaml"
            policy_path.write_text(policy)
            args += ["--policy", str(policy_path)]
        else:
            args += ["--keys-out", str(tmp / f"keys-{self.port}.json")]
        self.keys_path = tmp / f"keys-{self.port}.json"
        self.proc = Proc(args, {"REDIS_URL": redis_url}, tmp / f"up-{self.port}.log")
        try:
            wait_for(self.ready, 60, "the stack to be ready")
        except AssertionError:
            self.stop()
            raise AssertionError("stack did not start:\n" + self.proc.output()[-3000:]) from None

    def ready(self) -> bool:
        if not self.proc.alive():
            raise AssertionError("infergate up exited:\n" + self.proc.output()[-3000:])
        try:
            if http("GET", self.url + "/readyz", timeout=1)[0] != 200:
                return False
        except OSError:
            return False
        # ``up`` is ready once one gateway answers; the others may not be
        # listening yet, and the kernel spreads connections only over those that are.
        return self.gateways_beating() >= self.gateways

    def gateways_beating(self) -> int:
        """Gateways of this stack's namespace whose heartbeat is live (each
        beats only once serving, and it listens before it serves)."""
        client = redis.Redis.from_url(self.redis_url)
        try:
            ids = [m.decode() for m in client.smembers(self.keys.members("gateway"))]
            return sum(1 for i in ids if client.exists(self.keys.heartbeat("gateway", i)))
        finally:
            client.close()

    def infer(self, tier: str, text: str, **extra: Any) -> tuple[int, dict[str, str], Any]:
        return http("POST", self.url + "/v1/inference", {"input": text, **extra}, auth(tier))

    def stop(self) -> None:
        self.proc.stop()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def children_of(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class Cluster:
    """Components started one by one (as an operator would), sharing one
    policy file: gateways on their own ports, one dispatcher, workers that a
    test can kill and add."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        policy: str,
        *,
        gateways: int = 1,
        workers: int = 1,
        latency_ms: int = 100,
        dispatchers: int = 1,
        env: dict[str, str] | None = None,
        metrics: bool = False,
        policy_file: Path | None = None,
        models: dict[str, int] | None = None,
        worker_args: Sequence[str] = (),
        grpc: bool = False,
    ) -> None:
        """``models``: a dispatcher and this many workers for each model
        named (``--model-name``), in place of ``dispatchers`` and ``workers``;
        ``worker_args``: more flags for every worker (its backend); ``grpc``:
        each gateway serves the gRPC API too (on ``grpc_ports``)."""
        self.worker_args = list(worker_args)
        self.grpc = grpc
        self.grpc_ports: list[int] = []
        self.tmp = tmp
        # With metrics, each process serves /metrics on its own port: name -> port.
        self.metrics_ports: dict[str, int] | None = {} if metrics else None
        self.redis_url = redis_url
        self.latency_ms = latency_ms
        # ``policy_file``: the test laid the policy out itself (as Kubernetes mounts it).
        self.policy_path = policy_file or tmp / "policy.yaml"
        if policy_file is None:
            self.policy_path.write_text(policy)
        self.env = {"REDIS_URL": redis_url, **(env or {})}
        self.procs: list[Proc] = []
        self.workers: list[Proc] = []
        self.urls: list[str] = []
        self._n = 0
        try:
            self.dispatchers: list[Proc] = []
            for _ in range(0 if models else dispatchers):
                self.add_dispatcher()
            for name, count in (models or {}).items():
                self.add_dispatcher(model=name)
                for _ in range(count):
                    self.add_worker(model=name)
            for _ in range(0 if models else workers):
                self.add_worker()
            self.gateways: list[Proc] = []
            for _ in range(gateways):
                self.add_gateway()
            for url in self.urls:
                wait_for(lambda u=url: self._ready(u), 60, f"{url} to be ready")
                for name, count in (models or {}).items():
                    wait_for(
                        lambda u=url, m=name, n=count: self.serving(u, m) >= n,
                        60,
                        f"{count} workers of the model {name}",
                    )
        except BaseException:
            self.stop()
            raise

    def _start(self, args: list[str], name: str, wrapper: Sequence[str] = ()) -> Proc:
        self._n += 1
        if self.metrics_ports is not None:
            port = free_port()
            self.metrics_ports[f"{name}-{self._n}"] = port
            args = [*args, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        return Proc(args, self.env, self.tmp / f"{name}-{self._n}.log", wrapper)

    def _ready(self, url: str) -> bool:
        for p in self.procs + self.workers:
            if not p.alive() and p not in self.killed:
                raise AssertionError(f"{p.log_path.name} exited:\n" + p.output()[-2000:])
        try:
            return http("GET", url + "/readyz", timeout=1)[0] == 200
        except OSError:
            return False

    killed: list["Proc"] = []

    def serving(self, url: str, model: str) -> int:
        """The workers alive of one model, as a gateway sees them (/v1/status:
        its count, and its capacity from the gateway's own view of them)."""
        status, _, body = http("GET", f"{url}/v1/status?model={model}", headers=auth("admin"))
        if status != 200 or not body["capacity_rps"] > 0:
            return 0
        return int(body["workers_alive"])

    def add_worker(
        self, wrapper: Sequence[str] = (), model: str = "", args: Sequence[str] = ()
    ) -> Proc:
        named = ["--model-name", model] if model else []
        worker = self._start(
            [
                "worker",
                "--sim-latency-ms",
                str(self.latency_ms),
                "--policy",
                str(self.policy_path),
                *named,
                *self.worker_args,
                *args,
            ],
            f"worker-{model}" if model else "worker",
            wrapper,
        )
        self.workers.append(worker)
        return worker

    def add_dispatcher(self, model: str = "") -> Proc:
        named = ["--model-name", model] if model else []
        dispatcher = self._start(
            ["dispatcher", "--policy", str(self.policy_path), *named],
            f"dispatcher-{model}" if model else f"dispatcher{len(self.dispatchers)}",
        )
        self.procs.append(dispatcher)
        self.dispatchers.append(dispatcher)
        return dispatcher

    def add_gateway(self, wrapper: Sequence[str] = ()) -> str:
        """Start one more gateway on its own port; returns its URL (not waited on)."""
        port = free_port()
        more: list[str] = []
        if self.grpc:
            self.grpc_ports.append(free_port())
            more = ["--grpc-port", str(self.grpc_ports[-1])]
        gateway = self._start(
            ["gateway", "--port", str(port), "--policy", str(self.policy_path), *more],
            f"gateway{len(self.gateways)}",
            wrapper,
        )
        self.procs.append(gateway)
        self.gateways.append(gateway)
        self.urls.append(f"http://127.0.0.1:{port}")
        return self.urls[-1]

    def stop_workers(self) -> None:
        """SIGTERM every worker and wait for it: nothing takes work until one is added."""
        for worker in self.workers:
            worker.stop()
        self.killed = [*self.killed, *self.workers]

    def kill_worker(self) -> None:
        self.kill(next(w for w in self.workers if w.alive()))

    def kill(self, proc: Proc) -> None:
        """SIGKILL, as a crash would."""
        proc.proc.kill()
        proc.proc.wait(5)
        self.killed = [*self.killed, proc]

    def assert_workers_whole(self) -> None:
        """Every worker not killed on purpose is alive, and none printed a traceback."""
        for worker in self.workers:
            assert worker.alive() or worker in self.killed, worker.output()[-2000:]
            assert not re.search(r"^Traceback", worker.output(), re.M)

    def status(self, i: int = 0) -> Any:
        return http("GET", self.urls[i] + "/v1/status", headers=auth("admin"))[2]

    def infer(
        self, tier_or_secret: str, text: str, i: int = 0, **extra: Any
    ) -> tuple[int, dict[str, str], Any]:
        secret = SECRETS.get(tier_or_secret, tier_or_secret)
        return http(
            "POST",
            self.urls[i] + "/v1/inference",
            {"input": text, **extra},
            {"Authorization": "Bearer " + secret},
        )

    def stop(self) -> None:
        for p in self.procs + self.workers:
            p.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


KEYS = Keys()


def stats(client: redis.Redis, keys: Keys = KEYS) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}


def assert_redis_clean(client: redis.Redis, keys: Keys = KEYS) -> None:
    """No request is left in any list, and nothing per-request lives without a TTL."""
    lists = [*keys.queues, keys.batches]
    lists += [k.decode() for k in client.scan_iter(keys.prefix + "inflight:*")]
    lists += [k.decode() for k in client.scan_iter(keys.prefix + "processing:*")]
    lists += [k.decode() for k in client.scan_iter(keys.prefix + "batches:*")]
    assert {name: client.llen(name) for name in lists if client.llen(name)} == {}
    assert {q: client.zcard(q) for q in keys.fair_queues if client.zcard(q)} == {}
    # Fleet structure, bounded by the number of processes, not of requests.
    structural = (
        keys.stats,
        keys.ready,
        keys.dead_letter,
        keys.cancelled,
        keys.doorbell,
        keys.policy,
        keys.epoch,
        keys.warming,
    )
    per_process = (keys.prefix + "members:", keys.prefix + "credits:", keys.prefix + "step:")
    assert client.llen(keys.doorbell) <= 1
    for key in client.scan_iter("*"):
        name = key.decode()
        if client.ttl(name) == -1:
            assert name in structural or name.startswith(per_process), name


async def command_calls(store: Any, command: str) -> int:
    """How many times Redis has run ``command`` (``INFO commandstats``)."""
    stats = await store.redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def evalsha_calls(store: Any) -> int:
    """Script calls Redis has run."""
    return await command_calls(store, "evalsha")


async def queued(store: Any, tier: str) -> int:
    """What waits in a tier: its queue list and its fair queue."""
    keys = store.keys
    return int(await store.redis.llen(keys.queue(tier))) + int(
        await store.redis.zcard(keys.fair_queue(tier))
    )


def redis_clean(client: redis.Redis, keys: Keys = KEYS) -> bool:
    try:
        assert_redis_clean(client, keys)
    except AssertionError:
        return False
    return True


def busy_worker(client: redis.Redis, keys: Keys = KEYS) -> str | None:
    """The id of a worker with a batch in its processing list, if any."""
    for key in client.scan_iter(keys.prefix + "processing:*"):
        if client.llen(key):
            return key.decode().rsplit(":", 1)[1]
    return None


def paid_envelope(i: int) -> bytes:
    """Request ``r{i}`` of key ``k`` in paid, input ``in{i}``, 30 s to live."""
    now = clock.now_ms()
    return wire.encode(wire.Envelope(f"r{i}", "gw", "paid", "k", f"in{i}", now, now + 30_000))
