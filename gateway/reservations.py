"""What a request reserves of its key's token limits and budgets, before
a tokenizer has seen it, and of its GPU budget, before it runs. Tokens: its
input's tokens bounded from above (a byte-level or byte-fallback
tokenizer's token is at least one byte of UTF-8; special tokens and a
chat's template add a few), plus the most output tokens it may get: its
max_tokens, or else its model's bound, which the worker then cuts its
output to. GPU time: for those tokens, at the model's measured time per
token, with a margin. What it did not use goes back once it is answered
(``Quota.settle``), so a key's token limit or budget is never overshot by
what it admits; a request that used more than its bound (a model's own
chat template adding a long system prompt, a call slower than measured)
is charged the excess then."""

from infergate.base import wire
from infergate.policies.backends import generates_up_to
from infergate.policies.schema import Model

# Special tokens (a BOS, an EOS) and a chat template's per message.
TEMPLATE_TOKENS = 16
# A batch's time before any worker measured one (the fleet's default).
GPU_UNMEASURED_MS = 100.0
# A GPU reservation's margin over what a call of it alone is measured to take.
GPU_MARGIN = 1.5


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


def gpu_bound(tokens: int, call_line: tuple[float, float] | None, slowest_batch_ms: float) -> int:
    """The GPU time (µs) a request of at most ``tokens`` tokens (input and
    output) reserves: what a call of it alone would take, by the line fitted
    to the calls measured (its fixed part and its part per token; a call's
    time is shared by tokens, so in any call its share is less), with a
    margin; before any call was measured, a whole batch's, the slowest's
    (a tenth of a second before one is). A request that used more is
    charged the excess when it is answered."""
    if call_line is None:
        return round((slowest_batch_ms if slowest_batch_ms > 0 else GPU_UNMEASURED_MS) * 1000)
    fixed_us, per_token_us = call_line
    return round(GPU_MARGIN * (fixed_us + per_token_us * (tokens + 1)))


def gpu_least(slowest_call_us: int, slowest_batch_ms: float, calls: int = 1) -> int:
    """The least a GPU reservation over what is left of a budget may be
    cut to (``Counter.least``): the slowest call measured (this gateway's,
    or the fleet's slowest batch), with the margin (a tenth of a second
    before either is), for each of the ``calls`` it may run in; so only a
    request estimated longer than any call is cut, and one cut reserves
    what any call took."""
    slowest = max(slowest_call_us, slowest_batch_ms * 1000) or GPU_UNMEASURED_MS * 1000
    return round(GPU_MARGIN * slowest * calls)


def gpu_used(result: wire.Result) -> int:
    """The GPU time (µs) an answered request used: its share of its batch
    (none for an answer it joined or found in the cache)."""
    return result.gpu_us if result.served_by == "model" else 0
