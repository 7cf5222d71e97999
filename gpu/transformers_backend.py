"""The real backend: a ``transformers`` causal LM on torch, CUDA when present.

The only module that imports torch or transformers. ``infer`` tokenizes the
batch with left padding, generates greedily (deterministic) up to
``max_new_tokens`` and returns each input's continuation. Any failure in the
model call is raised as ``BackendError`` so the worker can isolate the input
that caused it.
"""

from typing import Any

from infergate.gpu.backend import BackendError, OneAtATime, check_batch


class TransformersBackend:
    name = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        gguf_file: str | None = None,
        max_new_tokens: int = 16,
        max_input_tokens: int = 512,
        device: str | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **extra)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **extra)
        self.model = model.to(self.device).eval()
        self.max_new_tokens = max_new_tokens
        # Greedy decoding: the output follows from the model, the file and these.
        self.fingerprint = (
            f"transformers/{model_path}/{gguf_file}/{max_new_tokens}/{max_input_tokens}"
        )
        self.max_input_tokens = max_input_tokens
        self._one_at_a_time = OneAtATime()

    def infer(self, inputs: list[str]) -> list[str]:
        check_batch(inputs)
        with self._one_at_a_time:
            try:
                return self._generate(inputs)
            except (RuntimeError, ValueError, IndexError) as exc:
                raise BackendError(
                    f"model call failed: {type(exc).__name__}: {str(exc)[:200]}"
                ) from exc

    def _generate(self, inputs: list[str]) -> list[str]:
        enc = self.tokenizer(
            inputs,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_input_tokens,
        ).to(self.device)
        with self._torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        texts: list[str] = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return texts
