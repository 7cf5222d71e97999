"""The real backend: a ``transformers`` causal LM on torch, CUDA when present.

The only module that imports torch or transformers. A chat request's
messages go through the tokenizer's own chat template where it has one.
``infer`` tokenizes the batch with left padding, generates greedily
(deterministic), each row up to its request's ``max_tokens`` or else
``max_new_tokens`` (a call ends with its longest answer, not at the most
any row may make), and returns each input's continuation;
``infer_sampled`` samples each row at its own temperature (0: greedy) in
the same one call. Any failure in the model call is raised as
``BackendError`` so the worker can isolate the input that caused it.
"""

import copy
import json
import os
from typing import Any

from infergate.base import logs
from infergate.gpu.backend import (
    BackendError,
    OneAtATime,
    Upstream,
    check_batch,
    conversations_of,
    max_tokens_of,
)

log = logs.get(__name__)

# A byte-level tokenizer spreads one character over up to this many tokens.
CHARACTER_TOKENS = 4


class TransformersBackend:
    name = "transformers"
    lacks: frozenset[str] = frozenset()  # (it samples, and clips to max_tokens)
    upstream: Upstream | None = None

    def __init__(
        self,
        model_path: str,
        *,
        gguf_file: str | None = None,
        max_new_tokens: int = 16,
        max_input_tokens: int = 512,
        device: str | None = None,
    ) -> None:
        # Progress bars (the weights' download or conversion) stay out of the logs.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **extra)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Counting (``clip``, on the event loop) has a tokenizer of its own: a
        # call sets the shared Rust tokenizer's padding, so one made while a
        # batch is encoded in the backend thread unpads that batch.
        self._counting = copy.deepcopy(self.tokenizer)
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **extra)
        self.model = model.to(self.device).eval()
        self.max_new_tokens = max_new_tokens
        # An input is cut to what the model's positions leave for its output
        # (past them, its embedding lookup fails for every input of the batch).
        positions = getattr(model.config, "max_position_embeddings", None) or getattr(
            model.config, "n_positions", None
        )
        if positions:
            max_input_tokens = max(1, min(max_input_tokens, positions - max_new_tokens))
        self.max_input_tokens = max_input_tokens
        # Greedy decoding: the output follows from the model, the file and these.
        self.fingerprint = (
            f"transformers/{model_path}/{gguf_file}/{max_new_tokens}/{max_input_tokens}"
        )
        self._one_at_a_time = OneAtATime()
        # A chat request is rendered by the tokenizer's own template, if it has one.
        self.chat_template: str | None = getattr(self.tokenizer, "chat_template", None) or None
        log.info("transformers.chat_template", own=self.chat_template is not None)

    def infer(self, inputs: list[str]) -> list[str]:
        return self.infer_sampled(inputs, [])

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        """The output cut to ``max_tokens`` of the model's tokens, and its length in them."""
        ids = self._counting(text, add_special_tokens=False)["input_ids"]
        if 0 < max_tokens < len(ids):
            return self._whole_characters(text, ids, max_tokens)
        return text, len(ids)

    def _whole_characters(self, text: str, ids: list[int], count: int) -> tuple[str, int]:
        """The first ``count`` tokens decoded, stepping back while the cut
        splits a character: a byte-level tokenizer spreads one over up to four
        tokens, and half of one decodes to a replacement character."""
        head = ""
        for kept in range(count, max(count - CHARACTER_TOKENS, 0), -1):
            head = str(self._counting.decode(ids[:kept]))
            if not head.endswith("\ufffd") or text.startswith(head):
                return head, kept
        return head.rstrip("\ufffd"), kept

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        check_batch(inputs)
        with self._one_at_a_time:
            try:
                return self._generate(inputs, temperatures)
            except (RuntimeError, ValueError, IndexError) as exc:
                raise BackendError(
                    f"model call failed: {type(exc).__name__}: {str(exc)[:200]}"
                ) from exc

    def _prompts(self, inputs: list[str]) -> list[str]:
        """Each input as the model reads it: a chat's messages through the
        tokenizer's own chat template where it has one (the gateway's
        rendering otherwise)."""
        conversations = conversations_of(inputs)
        if self.chat_template is None or all(c is None for c in conversations):
            return list(inputs)
        return [
            text if conversation is None else self._rendered(conversation)
            for text, conversation in zip(inputs, conversations, strict=True)
        ]

    def _rendered(self, conversation: str) -> str:
        """A chat through the template, which may refuse it (roles that do
        not alternate): that conversation's failure, found by the split."""
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    json.loads(conversation), tokenize=False, add_generation_prompt=True
                )
            )
        except Exception as exc:  # (jinja2's TemplateError, a template's own raise)
            raise BackendError(
                f"the model's chat template refuses this conversation: {str(exc)[:200]}"
            ) from exc

    def _new_tokens(self, inputs: list[str]) -> list[int]:
        """The most new tokens each row makes: what its request asks for
        and enough more to end a character (each output is then cut to its
        own, at a character's start), or the model's bound."""
        return [
            min(asked + CHARACTER_TOKENS - 1, self.max_new_tokens)
            if asked > 0
            else self.max_new_tokens
            for asked in max_tokens_of(inputs)
        ]

    def _generate(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        enc = self.tokenizer(
            self._prompts(inputs),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_input_tokens,
        ).to(self.device)
        sampling: dict[str, Any] = {"do_sample": False}
        if any(t > 0 for t in temperatures):
            rows = self._torch.tensor(temperatures, device=self.device).unsqueeze(1)
            sampling = {
                "do_sample": True,
                "logits_processor": [_RowTemperature(rows)],
                # (no warper of the model's own generation config on top)
                "temperature": 1.0,
                "top_k": 0,
                "top_p": 1.0,
            }
        most = self._new_tokens(inputs)
        prompt_tokens = enc["input_ids"].shape[1]
        with self._torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=max(most),
                pad_token_id=self.tokenizer.pad_token_id,
                # (a row past its own most pads on, as one at its end of text)
                stopping_criteria=[
                    _RowDone(self._torch.tensor(most, device=self.device), prompt_tokens)
                ],
                **sampling,
            )
        new_tokens = out[:, prompt_tokens:]
        texts: list[str] = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return texts


class _RowDone:
    """Each row done once it has made its own most new tokens: a call whose
    longest-asking answer ended early runs no step for the others' extra
    (their outputs are cut to their own anyway)."""

    def __init__(self, most: Any, prompt_tokens: int) -> None:
        self.most = most  # (batch,)
        self.prompt_tokens = prompt_tokens

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        most = self.most
        if input_ids.shape[0] != most.shape[0]:  # (a model whose own config searches beams)
            most = most.repeat_interleave(input_ids.shape[0] // most.shape[0])
        return (input_ids.shape[1] - self.prompt_tokens) >= most


class _RowTemperature:
    """Each row's logits over its own temperature; a row at 0 keeps only its
    most likely token, so sampling it is greedy decoding."""

    def __init__(self, temperatures: Any) -> None:
        self.temperatures = temperatures  # (batch, 1)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        greedy = self.temperatures == 0
        scaled = scores / self.temperatures.clamp(min=1e-4)
        best = torch.full_like(scores, float("-inf")).scatter(
            -1, scores.argmax(-1, keepdim=True), 0.0
        )
        return torch.where(greedy, best, scaled)
