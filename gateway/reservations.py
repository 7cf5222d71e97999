"""What a request reserves of its key's token limits and budgets, before
a tokenizer has seen it, and of its GPU budget, before it runs. Tokens: its
input's tokens bounded from above (a byte-level or byte-fallback
tokenizer's token is at least one byte of UTF-8; special tokens and a
chat's template add a few), plus the most output tokens it may get: its
max_tokens, or else its model's bound, which the worker then cuts its
output to. GPU time: for those tokens, by the line of the calls the key's
requests were measured in, with a margin, and above it as far as calls
have been; a request of a key with none measured, or far larger than any
measured, is not estimated: it takes what is left of the budget, and runs
as the key's only one until it is measured. What it did not use
goes back once it is answered
(``Quota.settle``), so a key's token limit or budget is never overshot by
what it admits; a request that used more than its bound (a model's own
chat template adding a long system prompt, a call slower than measured)
is charged the excess then."""

from infergate.base import wire
from infergate.gateway.costs import CallLine
from infergate.policies.backends import generates_up_to
from infergate.policies.schema import Model

# Special tokens (a BOS, an EOS) and a chat template's per message.
TEMPLATE_TOKENS = 16
# A batch's time before any worker measured one (the fleet's default).
GPU_UNMEASURED_MS = 100.0
# A GPU reservation's margin over what a call of it alone is measured to take.
GPU_MARGIN = 1.5
# What is left of a GPU budget that a reservation over it takes at least
# (``gpu_least``) is at most this share of the budget: another key's calls,
# which may raise a key's line, cannot lock it out of more than the last.
LEAST_AT_MOST = 0.1
# How far past the largest request measured a GPU reservation is drawn
# (in proportion to that one's), and what it is further (µs): more than a
# budget of one GPU has in 200 days, so it takes what is left.
BEYOND_MEASURED = 2.0
GPU_UNKNOWN_US = 2**44
# The most a reservation or a settlement asks of a limit or budget, in its
# unit (a result planted in Redis may say anything; the scripts count to
# 2^50 and read nothing past 18 digits).
MOST_AMOUNT = GPU_UNKNOWN_US


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
    return _held((result.input_tokens or bound) + result.tokens)


def gpu_bound(
    input_tokens: int, output_tokens: int, line: CallLine | None, beyond: float = BEYOND_MEASURED
) -> int:
    """The GPU time (µs) a request of at most ``input_tokens`` and
    ``output_tokens`` reserves: what a call of it alone would take, by the
    line fitted to the calls measured (its fixed part and its part per
    token; a call's time is shared by tokens, so in any call its share is
    less; ``CallLine.time_us``), as far over it as calls have been, with
    a margin; past the largest input or output of a request measured, in
    proportion, up to ``beyond`` times; further, or before any of the
    key's is measured, ``GPU_UNKNOWN_US`` (what is left: a line is no
    bound far from what it was fitted to, nor another key's for this
    key's). Input and output apart: a key that measured only short
    answers has not measured what a long one costs. A request that used
    more is charged the excess when it is answered."""
    if line is None or line.largest_input <= 0:  # (none measured: no call added)
        return GPU_UNKNOWN_US
    past = max(input_tokens / line.largest_input, output_tokens / max(line.largest_output, 1), 1.0)
    if past > beyond:
        return GPU_UNKNOWN_US
    within = line.tokens_of(
        min(input_tokens, line.largest_input), min(output_tokens, line.largest_output)
    )
    return _held(GPU_MARGIN * line.over * line.time_us(within) * past)


def gpu_job_bound(input_tokens: int, output_tokens: int, line: CallLine | None) -> int:
    """What a job reserves: ``gpu_bound``, in proportion however far past
    the largest request measured (a job teaches its line only once its
    result is read, which may be long after: jobs estimated as what is
    left would run one at a time); before any is, what is left. Its
    excess is charged when it finishes."""
    return gpu_bound(input_tokens, output_tokens, line, beyond=float("inf"))


def gpu_least(line: CallLine | None, slowest_batch_ms: float) -> int:
    """The least a lone request's GPU reservation over what is left of a
    budget may be cut to (``Counter.least``; at most ``LEAST_AT_MOST`` of
    the budget): what the largest request of the key's measured would
    reserve (before any, the fleet's slowest batch, or a tenth of a second,
    with the margin); so only a request estimated past what is left, where
    that still covers the key's largest, is cut (the period's last request)."""
    least = GPU_UNKNOWN_US
    if line is not None:
        least = gpu_bound(line.largest_input, line.largest_output, line)
    if least == GPU_UNKNOWN_US:
        least = round(GPU_MARGIN * (slowest_batch_ms or GPU_UNMEASURED_MS) * 1000)
    return least


def gpu_used(result: wire.Result) -> int:
    """The GPU time (µs) an answered request used: its share of its batch
    (none for an answer it joined or found in the cache)."""
    return _held(result.gpu_us) if result.served_by == "model" else 0


def _held(amount: float) -> int:
    """An amount held to 0-``MOST_AMOUNT`` (NaN: the most)."""
    return round(amount) if 0 <= amount <= MOST_AMOUNT else (0 if amount < 0 else MOST_AMOUNT)
