"""``kserve-v2:URL``: a model behind the Open Inference Protocol (KServe v2),
what Triton, KServe and MLServer speak: the batch as one BYTES tensor of
strings in one ``infer`` call, one BYTES string per input back.

The model's name is an option (``model``, and ``version`` if it has
several); its input and output tensors are read off its metadata
(``GET /v2/models/{model}``) the first time it answers: the one BYTES input
(or ``input``), and the first BYTES output (or ``output``), with the shape
the model declares (``[-1]`` or ``[-1, 1]``: the batch on the first
dimension). Its health is ``/v2/models/{model}/ready``. Such a model
neither samples nor stops at a request's ``max_tokens``: the gateway
refuses both with 400.
"""

from typing import Any

from infergate.gpu.backend import (
    BackendError,
    Unusable,
    Upstream,
    check_batch,
    clip_words,
)
from infergate.gpu.backends.remote import Remote
from infergate.policies.backends import MAX_TOKENS, SAMPLING


class Tensors:
    """The model's input and output as its metadata declares them."""

    def __init__(self, metadata: Any, options: dict[str, Any]) -> None:
        inputs = _bytes_tensors(metadata, "inputs")
        outputs = _bytes_tensors(metadata, "outputs")
        self.input = _named(inputs, options.get("input"), "input")
        self.output = _named(outputs, options.get("output"), "output")
        shape = self.input.get("shape") or [-1]
        # The batch on the first dimension; any other must be 1 (one string an input).
        if not isinstance(shape, list) or any(d not in (-1, 1) for d in shape[1:]):
            raise Unusable(
                f"the input {self.input['name']!r} has the shape {shape}: want [-1] or [-1, 1]"
            )
        self.rank = len(shape)

    def shape(self, count: int) -> list[int]:
        return [count] + [1] * (self.rank - 1)


def _bytes_tensors(metadata: Any, side: str) -> list[dict[str, Any]]:
    tensors = metadata.get(side) if isinstance(metadata, dict) else None
    if not isinstance(tensors, list):
        raise Unusable(f"the model's metadata lists no {side}")
    return [t for t in tensors if isinstance(t, dict) and t.get("datatype") == "BYTES"]


def _named(tensors: list[dict[str, Any]], name: str | None, side: str) -> dict[str, Any]:
    if name is not None:
        for tensor in tensors:
            if tensor.get("name") == name:
                return tensor
        raise Unusable(f"the model has no BYTES {side} named {name!r}")
    if side == "input" and len(tensors) != 1:
        raise Unusable(f"the model has {len(tensors)} BYTES inputs; name one (options: input)")
    if not tensors:
        raise Unusable(f"the model has no BYTES {side}")
    return tensors[0]


class KServeBackend:
    name = "kserve-v2"

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.model = str(options["model"])
        version = options.get("version")
        self.model_url = f"{url}/v2/models/{self.model}" + (
            f"/versions/{version}" if version else ""
        )
        self.remote = Remote(url, options, f"{self.model_url}/ready")
        self.upstream: Upstream | None = self.remote
        self.options = options
        self.lacks: frozenset[str] = frozenset({SAMPLING, MAX_TOKENS})
        self.fingerprint = f"kserve-v2/{url}/{self.model}/{version or ''}"
        self._tensors: Tensors | None = None

    def infer(self, inputs: list[str]) -> list[str]:
        check_batch(inputs)
        remote = self.remote

        async def attempt(timeout_s: float) -> Any:
            tensors = self._tensors
            if tensors is None:  # (read once, from the first answer)
                tensors = self._tensors = Tensors(
                    await remote.get(self.model_url, timeout_s), self.options
                )
            body = {
                "inputs": [
                    {
                        "name": tensors.input["name"],
                        "shape": tensors.shape(len(inputs)),
                        "datatype": "BYTES",
                        "data": list(inputs),
                    }
                ],
                "outputs": [{"name": tensors.output["name"]}],
            }
            return await remote.post(f"{self.model_url}/infer", body, timeout_s)

        answer = remote.call(inputs, attempt)
        return self._outputs(answer, len(inputs))

    def infer_sampled(self, inputs: list[str], temperatures: list[float]) -> list[str]:
        if any(temperatures):
            raise BackendError("a kserve-v2 model does not sample")
        return self.infer(inputs)

    def clip(self, text: str, max_tokens: int) -> tuple[str, int]:
        return clip_words(text, max_tokens)

    def _outputs(self, answer: Any, count: int) -> list[str]:
        name = self._tensors.output["name"] if self._tensors else None
        outputs = answer.get("outputs") if isinstance(answer, dict) else None
        tensor = next(
            (t for t in outputs or [] if isinstance(t, dict) and t.get("name") == name), None
        )
        if tensor is None:
            raise BackendError(f"the server's answer has no output {name!r}")
        data = _flat(tensor.get("data"))
        if len(data) != count:
            raise BackendError(f"the server returned {len(data)} outputs for {count} inputs")
        for i, out in enumerate(data):
            if not isinstance(out, str):
                raise BackendError(f"output {i} is {type(out).__name__}, not a string")
        return data


def _flat(data: Any) -> list[Any]:
    """A tensor's data in row-major order (the protocol allows it nested)."""
    if not isinstance(data, list):
        return []
    out: list[Any] = []
    for item in data:
        out.extend(_flat(item) if isinstance(item, list) else [item])
    return out
