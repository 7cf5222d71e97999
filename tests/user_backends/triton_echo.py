"""A model behind Triton (through PyTriton), for the ``kserve-v2:``
backend's tests: BYTES in, BYTES out, upper-cased, each request one model
call (infergate forms the batches; Triton's dynamic batcher would merge
two workers' calls, and a raise would fail both). ``echo`` goes through
PyTriton's ``@batch`` (a wrong row count is its own 500); ``echo_raw``
answers each request itself, so ``__short__`` makes it answer one row too
few with a 200. ``__fail__`` makes either raise (the client sees 500). ``sleepy`` takes
``TRITON_SLEEP_MS`` (100) a call, whatever its size, as the contract's
GPU does (docs/performance.md measures the kserve-v2 backend with it).

    LD_LIBRARY_PATH=<python's lib dir> <venv>/bin/python triton_echo.py HTTP_PORT
"""

import os
import sys
import time

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def _upper(arr: np.ndarray) -> np.ndarray:
    flat = [t.decode() if isinstance(t, bytes) else str(t) for t in arr.reshape(-1)]
    if any("__fail__" in s for s in flat):
        raise ValueError("the model failed on an input")
    out = np.array([s.upper().encode() for s in flat], dtype=np.object_).reshape(arr.shape)
    if any("__short__" in s for s in flat):
        out = out[:-1]
    return out


@batch
def infer_batched(text: np.ndarray) -> dict[str, np.ndarray]:
    return {"text": _upper(text)}


def infer_raw(requests: list) -> list[dict[str, np.ndarray]]:
    return [{"text": _upper(r["text"])} for r in requests]


SLEEP_S = float(os.environ.get("TRITON_SLEEP_MS", "100")) / 1000


@batch
def infer_sleepy(text: np.ndarray) -> dict[str, np.ndarray]:
    time.sleep(SLEEP_S)
    return {"text": text}


def main() -> None:
    port = int(sys.argv[1])
    config = TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2)
    text = [Tensor(name="text", dtype=bytes, shape=(1,))]
    with Triton(config=config) as triton:
        for name, fn in (
            ("echo", infer_batched),
            ("echo_raw", infer_raw),
            ("sleepy", infer_sleepy),
        ):
            triton.bind(
                model_name=name,
                infer_func=fn,
                inputs=text,
                outputs=text,
                config=ModelConfig(max_batch_size=100, batcher=None),  # (no dynamic batcher)
                strict=False,
            )
        triton.serve()


if __name__ == "__main__":
    main()
