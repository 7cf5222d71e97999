"""What a key's requests cost its model's GPU, learned from their answers,
for the fair queue (fair share by measured cost): a request's cost is its
input characters, times its key's measured GPU time per character over the
model's. So a key whose requests cost four times more per character
(short prompts with long answers) moves its fair tag four times as fast,
and takes a quarter of the slots while others wait. A key not answered
here yet is charged its characters. Each gateway learns from the answers
it receives; decaying sums forget a key's old requests (some hundred count),
and its line the calls they were in (some hundred).
A GPU budget's reservation follows the calls the key's own requests were
in: another key moves it only by sharing those calls, where it moves the
key's measured share, and so its charge, alike; a key with none measured
here has no line (``reservations.gpu_bound``)."""

from collections import deque
from typing import NamedTuple

from infergate.base import wire

# Each answer's weight in a key's sums decays by this per later answer of
# the key; in the model's, per later answer of any key.
KEY_MEMORY = 0.99
MODEL_MEMORY = 0.999
# Keys remembered (when full, the first remembered is forgotten).
MOST_KEYS = 10_000
# A key's cost per character is held within this factor of the model's.
MOST_FACTOR = 64.0
# A call past these (µs, tokens) is none a worker measured: a result
# planted in Redis (a day's call; a hundred requests of a million tokens).
MOST_CALL_US = 86_400 * 10**6
MOST_CALL_TOKENS = 2**40
# The calls a line knows it has added, the latest (answers of a call come
# together, or nearly: a late reply's, a follower's, a job's read again).
RECENT_CALLS = 64


class MeasuredCall(NamedTuple):
    """The backend call a request was answered in, as its answer says: its
    tokens, weighed as its worker weighs a new token (``tokens_of``)."""

    batch_id: str
    tokens: int
    us: int
    new_token_weight: float = 1.0

    @classmethod
    def of(cls, result: wire.Result) -> "MeasuredCall":
        """The call a result says it was in (its tokens weighed where its
        worker weighs them; a worker of an earlier release weighs none)."""
        if result.weighed_call_tokens > 0:
            weighed, weight = result.weighed_call_tokens, result.new_token_weight
            return cls(result.batch_id, weighed, result.infer_ms * 1000, weight)
        return cls(result.batch_id, result.call_tokens, result.infer_ms * 1000)


class CallLine:
    """A call's time against its tokens (input and weighed output, one more each):
    decaying sums of 1, x, y, x², xy, for a least-squares line; how far
    over the line the calls have been (``over``, a factor, back toward 1
    as calls within it follow); the largest input and output bounds of a
    request answered in them (tokens: ``reservations.py``) and the
    slowest call; and the sizes the line was fitted to, the smallest
    call and the largest, forgotten as the sums forget the calls (one
    large request, then thousands of tiny ones, let a large one be drawn
    from the tiny ones' mean). A call is added once however many of the
    key's requests it answered (a batch of a hundred forgot the rest). A
    bound is drawn in the calls' units with the largest weight of a new
    token among the calls it remembers (its workers may weigh them apart:
    one just started alone weighs one)."""

    def __init__(self, memory: float) -> None:
        self.memory = memory
        self.sums = [0.0] * 5
        self.over = 1.0
        self.largest_input = 0
        self.largest_output = 0
        self.slowest_us = 0
        self.smallest_call = float("inf")
        self.largest_call = 0.0
        self.new_token_weight = 1.0
        self._recent: deque[str] = deque()  # (in the order added; a set to look in)
        self._recent_set: set[str] = set()

    def add(self, call: MeasuredCall, bound: tuple[int, int] = (0, 0)) -> None:
        """A call with a request in it of at most ``bound`` tokens of input
        and of output, added unless it is one of the recent calls."""
        self.largest_input = max(self.largest_input, bound[0])
        self.largest_output = max(self.largest_output, bound[1])
        if call.batch_id:
            if call.batch_id in self._recent_set:
                return  # (another of the key's requests in a call added)
            self._recent.append(call.batch_id)
            self._recent_set.add(call.batch_id)
            if len(self._recent) > RECENT_CALLS:
                self._recent_set.discard(self._recent.popleft())
        m = self.memory
        remembered = 1.0 + (self.new_token_weight - 1.0) * m
        self.new_token_weight = max(wire.held_weight(call.new_token_weight), remembered)
        x, y = float(call.tokens), float(call.us)
        n, sx, sy, sxx, sxy = self.sums
        self.sums = [n * m + 1.0, sx * m + x, sy * m + y, sxx * m + x * x, sxy * m + x * y]
        self.smallest_call = min(self.smallest_call / m, x)
        self.largest_call = max(self.largest_call * m, x)
        self.slowest_us = max(self.slowest_us, call.us)
        fixed_us, per_token_us = self.fit() or (0.0, 0.0)
        on_line = fixed_us + per_token_us * x  # (``time_us``: none is larger)
        self.over = 1.0 + (self.over - 1.0) * m
        if on_line > 0:
            self.over = max(self.over, y / on_line)

    def tokens_of(self, input_tokens: int, output_tokens: int) -> int:
        """A request's tokens in the calls' units (``wire.weighed``)."""
        return wire.weighed(input_tokens, output_tokens, self.new_token_weight)

    def fit(self) -> tuple[float, float] | None:
        """A call's time (µs) as its fixed part and its part per token; with
        calls all of one size, or no slope, a mean call's time as the fixed
        part, and none per token (a key cannot train its line below a
        call's time); None before any call."""
        n, sx, sy, sxx, sxy = self.sums
        if n <= 0 or sx <= 0:
            return None
        spread = n * sxx - sx * sx
        if spread <= 1e-9 * n * sxx:
            return sy / n, 0.0
        per_token = (n * sxy - sx * sy) / spread
        if per_token <= 0:
            return sy / n, 0.0
        return max((sy - per_token * sx) / n, 0.0), per_token

    def time_us(self, tokens: float) -> float:
        """What a call of ``tokens`` takes by the line (0 before any call):
        within the sizes it was fitted to, the line's time; below them, its
        time at the smallest (a call takes no less for fewer tokens); past
        them, its time at the largest in proportion (a part per token is
        at most a call's time over its tokens). A line says nothing of
        sizes it was not fitted to: calls of one size have no slope, and
        near sizes on a busy machine a slope of noise, whose fixed part
        may come out as none; and a key that trained its line on one word
        of emoji may send as many bytes in many more tokens."""
        fit = self.fit()
        if fit is None:
            return 0.0
        fixed_us, per_token_us = fit
        largest = max(self.largest_call, 1.0)
        within = min(max(tokens, self.smallest_call), largest)
        return (fixed_us + per_token_us * within) * max(1.0, tokens / largest)


class CostModel:
    """One model's measured cost per input character, and each key's; and
    its cost per token (what a GPU budget reserves, ``reservations.py``)."""

    def __init__(self) -> None:
        self._keys: dict[str, list[float]] = {}  # key id: [GPU µs, characters], decaying
        self._model = [0.0, 0.0]
        self._key_calls: dict[str, CallLine] = {}  # the calls each key's requests were in

    def answered(
        self,
        key_id: str,
        chars: int,
        gpu_us: int,
        call: MeasuredCall | None = None,
        bound: tuple[int, int] = (0, 0),
    ) -> None:
        """A request of the key's with ``chars`` input characters (and at
        most ``bound`` tokens of input and of output) used ``gpu_us`` of
        ``call``."""
        if gpu_us <= 0:
            return  # (a cached or joined answer: the GPU did not run it)
        sums = self._keys.get(key_id)
        if sums is None:
            if len(self._keys) >= MOST_KEYS:
                forgotten = next(iter(self._keys))
                del self._keys[forgotten]
                self._key_calls.pop(forgotten, None)
            sums = self._keys[key_id] = [0.0, 0.0]
        if call is not None:
            self.learned(key_id, call, bound)
        for held, memory in ((sums, KEY_MEMORY), (self._model, MODEL_MEMORY)):
            held[0] = held[0] * memory + gpu_us
            held[1] = held[1] * memory + chars + 1

    def learned(self, key_id: str, call: MeasuredCall, bound: tuple[int, int]) -> None:
        """A call one of the key's requests (at most ``bound`` tokens of
        input and of output) was in, for its line alone (a job's: its fair
        cost is learned from requests)."""
        if not (0 < call.tokens <= MOST_CALL_TOKENS and 0 < call.us <= MOST_CALL_US):
            return  # (none measured, or planted)
        own = self._key_calls.get(key_id)
        if own is None:
            if len(self._key_calls) >= MOST_KEYS:  # (a key of jobs alone has no sums)
                del self._key_calls[next(iter(self._key_calls))]
            own = self._key_calls[key_id] = CallLine(KEY_MEMORY)
        own.add(call, bound)

    def call_line(self, key_id: str) -> CallLine | None:
        """The calls ``key_id``'s requests were in (a GPU reservation's
        line, ``reservations.gpu_bound``); None before any."""
        return self._key_calls.get(key_id)

    def expected(self, key_id: str, chars: int) -> int:
        """The fair queue's cost of a request of ``chars`` input characters."""
        sums = self._keys.get(key_id)
        model_us, model_chars = self._model
        if sums is None or model_us <= 0:
            return max(1, chars)
        factor = (sums[0] / sums[1]) / (model_us / model_chars)
        factor = min(max(factor, 1 / MOST_FACTOR), MOST_FACTOR)
        return max(1, round((chars + 1) * factor))
