"""One admitted request on its way to a worker: what the request path
(``inference.py``) and what becomes of its reservation (``reserving.py``)
know of it."""

from dataclasses import dataclass

from infergate.gateway.models import ModelLane
from infergate.gateway.prompt_lists import ListCharge
from infergate.gateway.quota import Reservation
from infergate.gateway.sharing import Share
from infergate.policies import KeyEntry, Tier


@dataclass
class Request:
    """One admitted request on its way to a worker."""

    id: str
    key: KeyEntry
    tier: Tier
    lane: ModelLane
    text: str
    deadline_ms: int
    started: float
    share: Share | None
    # How many of its tier's requests may wait now (admission.Decision)
    allowance: float
    max_tokens: int = 0
    temperature: float = 0.0
    count_input: bool = False
    # The x-ratelimit-* headers, once the request's quota is charged: by its
    # first enqueue (the same round trip), or before it follows another, or
    # with its list of prompts (``charged``, until it queues: prompt_lists.py).
    quota_headers: dict[str, str] | None = None
    charged: "ListCharge | None" = None
    conversation: str | None = None
    # Its token limits' and budgets' reservation: the tokens it reserves,
    # the bound on its input within them, the GPU time (µs) it reserves,
    # and what was charged (given back in part once answered).
    reserve: int = 0
    input_bound: int = 0
    reserve_gpu_us: int = 0
    reservation: Reservation | None = None
