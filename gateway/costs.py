"""What a key's requests cost its model's GPU, learned from their answers,
for the fair queue (fair share by measured cost): a request's cost is its
input characters, times its key's measured GPU time per character over the
model's. So a key whose requests cost four times more per character
(short prompts with long answers) moves its fair tag four times as fast,
and takes a quarter of the slots while others wait. A key not answered
here yet is charged its characters. Each gateway learns from the answers
it receives; decaying sums forget a key's old requests (some hundred count)."""

# Each answer's weight in a key's sums decays by this per later answer of
# the key; in the model's, per later answer of any key.
KEY_MEMORY = 0.99
MODEL_MEMORY = 0.999
# Keys remembered (when full, the first remembered is forgotten).
MOST_KEYS = 10_000
# A key's cost per character is held within this factor of the model's.
MOST_FACTOR = 64.0


class CostModel:
    """One model's measured cost per input character, and each key's."""

    def __init__(self) -> None:
        self._keys: dict[str, list[float]] = {}  # key id: [GPU µs, characters], decaying
        self._model = [0.0, 0.0]

    def answered(self, key_id: str, chars: int, gpu_us: int) -> None:
        """A request of the key's with ``chars`` input characters used ``gpu_us``."""
        if gpu_us <= 0:
            return  # (a cached or joined answer: the GPU did not run it)
        sums = self._keys.get(key_id)
        if sums is None:
            if len(self._keys) >= MOST_KEYS:
                del self._keys[next(iter(self._keys))]
            sums = self._keys[key_id] = [0.0, 0.0]
        for held, memory in ((sums, KEY_MEMORY), (self._model, MODEL_MEMORY)):
            held[0] = held[0] * memory + gpu_us
            held[1] = held[1] * memory + chars + 1

    def expected(self, key_id: str, chars: int) -> int:
        """The fair queue's cost of a request of ``chars`` input characters."""
        sums = self._keys.get(key_id)
        model_us, model_chars = self._model
        if sums is None or model_us <= 0:
            return max(1, chars)
        factor = (sums[0] / sums[1]) / (model_us / model_chars)
        factor = min(max(factor, 1 / MOST_FACTOR), MOST_FACTOR)
        return max(1, round((chars + 1) * factor))
