"""What every long-running process is configured with (flags or
``INFERGATE_*``/``REDIS_URL``); each role's settings add their own fields."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessSettings:
    process_id: str
    redis_url: str
    namespace: str = "infergate"
    # The model this process serves (its key space: base/keys.py); a gateway
    # serves every model of the policy and leaves this as it is.
    model: str = "default"
    heartbeat_interval_ms: int = 250
    heartbeat_ttl_ms: int = 1_000
