"""What a request reserves of its key's token limits and budgets, before
a tokenizer has seen it, and of its GPU budget, before it runs. Tokens: its
input's tokens bounded from above (a byte-level or byte-fallback
tokenizer's token is at least one byte of UTF-8; special tokens and a
chat's template add a few), plus the most output tokens it may get: its
max_tokens, or else its model's bound, which the worker then cuts its
output to. GPU time: a whole batch's. What it did not use goes back once
it is answered (``Quota.settle``), so a key's token limit or budget is
never overshot by what it admits; a request that used more than its bound
(a model's own chat template adding a long system prompt, a batch slower
than the slowest yet) is charged the excess then."""

from infergate.base import wire
from infergate.policies.backends import generates_up_to
from infergate.policies.schema import Model

# Special tokens (a BOS, an EOS) and a chat template's per message.
TEMPLATE_TOKENS = 16
# A batch's time before any worker measured one (the fleet's default).
GPU_UNMEASURED_MS = 100.0


def input_bound(text: str, conversation: str | None = None) -> int:
    """The most tokens the input can be: the text the model reads (a chat
    as the policy's template renders it), or a chat's messages as JSON,
    which is longer than what a model's own template renders of them,
    whichever is longer."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if conversation is not None:
        size = max(size, len(conversation.encode("utf-8", "surrogatepass")))
    return size + TEMPLATE_TOKENS


def output_bound(max_tokens: int, model: Model) -> int:
    """The most output tokens: the request's max_tokens, or its model's."""
    if max_tokens > 0:
        return max_tokens
    return generates_up_to(model) or model.max_new_tokens


def used(result: wire.Result, bound: int) -> int:
    """The tokens an answered request used: the worker's count of its input
    (``bound`` where none was made: a cached or joined answer) and output."""
    return (result.input_tokens or bound) + result.tokens


def gpu_bound(slowest_batch_ms: float) -> int:
    """The most GPU time (µs) a request may use: a whole batch's, as the
    slowest serving worker measured one (it may run alone), or a tenth of
    a second before any did; a request that used more is charged the
    excess when it is answered."""
    return round((slowest_batch_ms if slowest_batch_ms > 0 else GPU_UNMEASURED_MS) * 1000)


def gpu_used(result: wire.Result) -> int:
    """The GPU time (µs) an answered request used: its share of its batch
    (none for an answer it joined or found in the cache)."""
    return result.gpu_us if result.served_by == "model" else 0
