"""The team's own code as the backend (``python:pkg.module:attr``): a batch
function, an async one, a class built with the policy's options. What it
cannot be made from is one line and exit 2 before the worker joins; what
it does wrong at run time fails only the inputs it must, never the worker.
The code is ``tests/user_backends/fixture_model.py``, imported as a user's."""

import concurrent.futures
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from infergate.base.ports import free_port
from infergate.gpu.backend import BackendError, Unusable
from infergate.gpu.backends.python_code import PythonBackend
from infergate.policies.backends import MAX_TOKENS, SAMPLING
from infergate.redis_server import RedisServer

from tests.helpers import SECRETS, Cluster, as_yaml, ask_with_demo_key, http, policy, wait_for
from tests.upstreams import answers

USER_CODE = Path(__file__).parent / "user_backends"


@pytest.fixture(autouse=True)
def _user_code_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(USER_CODE))


# -- made once, as the worker starts ------------------------------------------


def test_a_batch_function_an_async_one_a_class_and_a_factory() -> None:
    fn = PythonBackend("fixture_model:batchstring", {})
    assert fn.infer(["a", "b"]) == ["fn:a", "fn:b"]
    assert fn.lacks == {SAMPLING, MAX_TOKENS}
    assert fn.fingerprint == "python/fixture_model:batchstring"
    assert PythonBackend("fixture_model:abatch", {}).infer(["é"]) == ["async:é"]
    cls = PythonBackend("fixture_model:Reverser", {"prefix": "p", "delay_ms": 0})
    assert cls.infer(["abc"]) == ["p:cba"]
    assert cls.infer_sampled(["ab", "ab"], [0.0, 0.5]) == ["p:ba", "p:ba~0.5"]
    assert cls.clip("p:cba", 2) == ("p:", 2)
    assert cls.lacks == frozenset()
    assert cls.fingerprint == "reverser/p"  # (its own, as it names its version)
    assert PythonBackend("fixture_model:make_reverser", {}).infer(["ab"]) == ["made:ba"]


@pytest.mark.parametrize(
    ("target", "options", "says"),
    [
        ("nomodule:fn", {}, "cannot import nomodule: ModuleNotFoundError"),
        ("fixture_model:missing", {}, "fixture_model has no attribute 'missing'"),
        ("fixture_model:needs_two", {}, "takes 2 arguments: a batch function takes one"),
        ("fixture_model:batchstring", {"prefix": "x"}, "is a batch function: it takes no options"),
        (
            "fixture_model:Reverser",
            {"colour": "red"},
            "building fixture_model:Reverser failed: TypeError",
        ),
        ("fixture_model:USER_CODE_MISSING", {}, "has no attribute"),
    ],
)
def test_what_cannot_be_made_says_what_to_fix(target: str, options: dict, says: str) -> None:
    with pytest.raises(Unusable, match=says):
        PythonBackend(target, options)


@pytest.mark.parametrize(
    ("marker", "says"),
    [
        ("__raise__", "RuntimeError: the model cannot read this input"),
        ("__count__", "returned 1 outputs for 2 inputs"),
        ("__type__", "output 0 is int, not a string"),
    ],
)
def test_a_call_that_breaks_the_contract_is_a_backend_error(marker: str, says: str) -> None:
    with pytest.raises(BackendError, match=says):
        PythonBackend("fixture_model:batchstring", {}).infer(["fine", marker])


def test_a_worker_that_cannot_make_its_backend_exits_2_before_joining(
    redis_url: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "infergate",
            "worker",
            "--backend",
            "python:fixture_model:needs_two",
        ],
        env={"PYTHONPATH": str(USER_CODE), "REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "infergate worker: python backend: fixture_model:needs_two takes 2 arguments: a batch "
        "function takes one, the list of inputs"
    ]
    # (it never joined: all it left is its word that it was warming up, for seconds)
    assert redis.Redis.from_url(redis_url).keys("*") in ([], [b"{infergate}:warming"])


# -- serving, through a real stack ----------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Cluster]:
    doc = policy()
    doc["models"] = {
        "fn": {"backend": "python:fixture_model:batchstring"},
        "rev": {"backend": "python:fixture_model:Reverser", "options": {"prefix": "pol"}},
    }
    with Cluster(
        tmp_path_factory.mktemp("python-backend"),
        module_redis.url,
        as_yaml(doc),
        models={"fn": 1, "rev": 1},
        env={"PYTHONPATH": str(USER_CODE)},
    ) as c:
        yield c
        c.assert_workers_whole()


def _infer(c: Cluster, text: str, model: str, **extra: object) -> tuple[int, dict]:
    status, _, body = c.infer("paid", text, model=model, **extra)
    return status, body


def test_a_batch_function_serves_and_a_breach_fails_only_its_input(cluster: Cluster) -> None:
    texts = [f"input {i}" for i in range(12)] + ["bad __raise__", "short __count__", "n __type__"]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda t: _infer(cluster, t, "fn"), texts))
    for text, (status, body) in zip(texts, answers, strict=True):
        if "__" in text:
            assert status == 500, body
            assert body["error"]["code"] == "INFERENCE_FAILED"
        else:
            assert status == 200, body
            assert body["output"] == f"fn:{text}"
            assert body["metadata"]["model_version"] == "python/fixture_model:batchstring"
    assert "cannot read this input" in answers[12][1]["error"]["message"]


def test_what_a_function_cannot_do_is_refused_with_400(cluster: Cluster) -> None:
    status, body = _infer(cluster, "hi", "fn", parameters={"temperature": 0.7})
    assert status == 400
    assert body["error"]["message"] == (
        "the model 'fn' does not sample: send parameters.temperature 0 (or none)"
    )
    status, body = _infer(cluster, "hi", "fn", parameters={"max_tokens": 3})
    assert status == 400
    assert "cannot stop at a number of tokens" in body["error"]["message"]


def test_a_class_gets_the_policys_options_samples_and_counts_its_tokens(
    cluster: Cluster,
) -> None:
    status, body = _infer(cluster, "abc", "rev")
    assert (status, body["output"]) == (200, "pol:cba")
    assert body["metadata"]["tokens_used"] == len("pol:cba")  # (its own count: characters)
    status, body = _infer(cluster, "abc", "rev", parameters={"temperature": 0.5})
    assert (status, body["output"]) == (200, "pol:cba~0.5")
    status, body = _infer(cluster, "abcdef", "rev", parameters={"max_tokens": 5})
    assert (status, body["output"], body["metadata"]["tokens_used"]) == (200, "pol:f", 5)


# -- infergate backend check -----------------------------------------------------------


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infergate", "backend", "check", *args],
        env={"PYTHONPATH": str(USER_CODE), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_backend_check_passes_a_function_that_keeps_the_contract(tmp_path: Path) -> None:
    times = tmp_path / "times.json"
    out = _check(tmp_path, "python:fixture_model:batchstring", "--times-out", str(times))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: keeps the contract" in out.stdout
    assert "sampling: no, max_tokens: no" in out.stdout
    # ...and its batch times are what `plan` sizes the workers by.
    planned = subprocess.run(
        [sys.executable, "-m", "infergate", "plan", "--rps", "1000", "--backend-times", str(times)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "batches of up to 100 taking" in planned.stdout


def test_backend_check_says_a_times_file_it_cannot_write_in_one_line(tmp_path: Path) -> None:
    out = _check(tmp_path, "python:fixture_model:batchstring", "--times-out", "no/such/dir/t.json")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("infergate backend check: --times-out: "), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr  # (one line, no traceback)


def test_backend_check_says_a_backend_it_cannot_make_as_itself(tmp_path: Path) -> None:
    out = _check(tmp_path, "python:nomodule:fn")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("infergate backend check: python backend: cannot import"), (
        out.stderr
    )


def test_backend_check_catches_a_function_that_drops_an_output(tmp_path: Path) -> None:
    out = _check(tmp_path, "python:fixture_model:drops_one_of_many")
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "BREACH   a batch of 64: failed: the backend returned 63 outputs for 64 inputs"
        in out.stdout
    )
    assert "verdict: 2 breaches of the contract" in out.stdout  # (64 and 100)


def test_backend_check_of_code_that_cannot_be_made_exits_2(tmp_path: Path) -> None:
    out = _check(tmp_path, "python:fixture_model:needs_two")
    assert out.returncode == 2
    assert "takes 2 arguments" in out.stderr


def _readme_block(heading: str) -> list[str]:
    """The first ``sh`` block under ``heading`` in README.md, by line."""
    text = (Path(__file__).parent.parent / "README.md").read_text("utf-8")
    section = text.split(heading, 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()


def test_the_readmes_bring_your_model_runs_as_written(tmp_path: Path) -> None:
    """README's "Bring your model", pasted into a shell in a fresh folder:
    the contract check passes, and `up` serves the function (on a free
    port, through the flag's environment variable: the lines unchanged)."""
    lines = _readme_block("## Bring your model")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    *first, up = lines
    checked = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(first)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "verdict: keeps the contract" in checked.stdout
    port = free_port()
    stack = subprocess.Popen(
        ["bash", "-c", "exec " + up],
        cwd=tmp_path,
        env={**env, "INFERGATE_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: answers(f"http://127.0.0.1:{port}/readyz"), 60, "the stack")
        status, body = ask_with_demo_key(tmp_path / "keys.json", port, "hello")
        assert (status, body["output"]) == (200, "HELLO")
    finally:
        stack.send_signal(signal.SIGINT)
        assert stack.wait(40) == 0


def test_the_teams_code_that_never_returns_is_the_hang_timeouts(tmp_path: Path) -> None:
    """A call that never returns ends its worker (exit 3) past the hang
    timeout; the batch is run again elsewhere, then dead-lettered (500),
    and the other requests are served; a job runs on the team's code."""
    server = RedisServer().start()
    try:
        doc = policy(workers={"hang_timeout_ms": 1000, "max_attempts": 2})
        with Cluster(
            tmp_path,
            server.url,
            as_yaml(doc),
            workers=3,
            env={"PYTHONPATH": str(USER_CODE)},
            worker_args=["--backend", "python:fixture_model:batchstring"],
        ) as c:
            status, _, body = c.infer("paid", "stuck __hang__")
            assert (status, body["error"]["code"]) == (500, "INFERENCE_FAILED"), body
            wait_for(lambda: sum(not w.alive() for w in c.workers) == 2, 30, "two workers to exit")
            assert {w.proc.returncode for w in c.workers if not w.alive()} == {3}
            c.killed = [w for w in c.workers if not w.alive()]
            status, _, body = c.infer("paid", "served after the hang")
            assert (status, body["output"]) == (200, "fn:served after the hang")
            status, _, job = http(
                "POST",
                c.urls[0] + "/v1/jobs",
                {"input": "a job"},
                {"Authorization": f"Bearer {SECRETS['paid']}"},
            )
            assert status == 202, job
            status, _, done = http(
                "GET",
                f"{c.urls[0]}/v1/jobs/{job['job_id']}?wait_s=20",
                headers={"Authorization": f"Bearer {SECRETS['paid']}"},
            )
            assert (status, done["status"], done["result"]["output"]) == (
                200,
                "succeeded",
                "fn:a job",
            )
    finally:
        server.close()
