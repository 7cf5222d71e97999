"""Batch time of the transformers backend, the number the whole fleet's
capacity rests on (``workers x batch size / batch time``).

Builds a GPT-2 on disk with random weights (``--size small`` is GPT-2
small's shape: 12 layers, 768 wide, 12 heads; ``tiny`` is 2 x 32) so it
needs no download, then times ``infer`` for each batch size after a warm-up.

    python -m infergate.gpu.bench --size small --device cuda --json-out gpu.json
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"tiny": (2, 32, 2), "small": (12, 768, 12)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infergate.gpu.bench")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--batches", default="1,10,50,100")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import torch
    from infergate.gpu.backends.transformers_backend import TransformersBackend
    from infergate.gpu.tiny_model import build_tiny_gpt2

    n_layer, n_embd, n_head = SIZES[args.size]
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_gpt2(Path(tmp), n_layer=n_layer, n_embd=n_embd, n_head=n_head)
        backend = TransformersBackend(tmp, max_new_tokens=args.new_tokens, device=args.device)
    report: dict[str, object] = {
        "device": backend.device,
        "device_name": torch.cuda.get_device_name(0)
        if backend.device.startswith("cuda")
        else "cpu",
        "torch": torch.__version__,
        "size": args.size,
        "new_tokens": args.new_tokens,
        "batches": {},
    }
    backend.infer(["warm up"] * 4)
    for size in (int(x) for x in args.batches.split(",")):
        inputs = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(size)]
        times = []
        for _ in range(args.repeat):
            if backend.device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            outputs = backend.infer(inputs)
            if backend.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1000)
            assert len(outputs) == size
        median = statistics.median(times)
        report["batches"][str(size)] = {  # type: ignore[index]
            "median_ms": round(median, 1),
            "min_ms": round(min(times), 1),
            "inputs_per_s": round(size * 1000 / median, 1),
        }
        print(
            f"batch {size:>3}: median {median:8.1f} ms  min {min(times):8.1f} ms  {size * 1000 / median:9.1f} inputs/s"
        )
    print(json.dumps(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
