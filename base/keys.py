"""Every Redis key and channel name of a deployment, built in one place.

All names share one Redis Cluster hash tag, ``{ns}``, so every multi-key
script runs on one shard, and the same code runs on a single Redis, Sentinel
or Cluster.
"""

import hashlib

from infergate.base.tiers import TIERS


class Keys:
    """Key names under one namespace, e.g. ``{infergate}:queue:free``."""

    def __init__(self, namespace: str = "infergate") -> None:
        if not namespace or any(c in namespace for c in "{}: "):
            raise ValueError(
                f"namespace {namespace!r} must be non-empty without '{{', '}}', ':' or spaces"
            )
        self.namespace = namespace
        self.prefix = "{" + namespace + "}:"
        self.batches = self.prefix + "batches"
        self.ready = self.prefix + "ready"
        self.doorbell = self.prefix + "doorbell"
        self.last_dispatch = self.prefix + "last-dispatch"
        self.batch_rule = self.prefix + "batch-rule"
        self.stats = self.prefix + "stats"
        self.cancelled = self.prefix + "cancelled"
        self.dead_letter = self.prefix + "dead-letter"
        self.reaper_lock = self.prefix + "reaper-lock"
        self.quota_prefix = self.prefix + "quota"
        self.policy = self.prefix + "policy"
        self.scale_signal = self.prefix + "scale-signal"
        self.scale_history = self.prefix + "scale-history"
        self.queues = tuple(self.queue(t) for t in TIERS)
        # Fair queuing inside a tier: its requests wait in one sorted set,
        # scored by each one's start tag (its key's virtual time), beside a
        # hash of the tier's virtual time and each waiting key's state
        # (``admit.lua``, ``take.lua``). ``queue:{tier}`` (a list) is taken
        # first: a requeue's front, and what a gateway of an earlier version queued.
        self.fair_queues = tuple(self.fair_queue(t) for t in TIERS)
        self.fair_states = tuple(self.fair_state(t) for t in TIERS)
        # Asynchronous jobs: their own queues (after every synchronous one), one
        # record per job, the queued count per key, and the channel that says
        # which jobs just finished (for long polls on any gateway).
        self.job_queues = tuple(self.job_queue(t) for t in TIERS)
        self.job_prefix = self.prefix + "job:"
        self.jobs_queued = self.prefix + "jobs-queued"
        self.jobs_done = self.prefix + "jobs-done"
        self.input_prefix = self.prefix + "input:"

    def queue(self, tier: str) -> str:
        return self.prefix + "queue:" + tier

    def fair_queue(self, tier: str) -> str:
        return self.prefix + "fq:" + tier

    def fair_state(self, tier: str) -> str:
        return self.prefix + "fair:" + tier

    def job_queue(self, tier: str) -> str:
        return self.prefix + "jobs:" + tier

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def input(self, gateway_id: str, request_id: str) -> str:
        """A long input, kept beside its envelope (``queue/inputs.py``);
        request ids are random per gateway."""
        return self.input_prefix + gateway_id + ":" + request_id

    def cache(self, digest: str, fingerprint: str) -> str:
        """An answer kept for an input digest, under the model that gave it."""
        model = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        return self.prefix + "cache:" + model + ":" + digest

    def usage(self, hour: int) -> str:
        """What each key used in one hour (epoch ms // 3,600,000): ``queue/usage.py``."""
        return self.prefix + "usage:" + str(hour)

    def inflight(self, dispatcher_id: str) -> str:
        return self.prefix + "inflight:" + dispatcher_id

    def credits(self, dispatcher_id: str) -> str:
        """Credits a dispatcher holds while it forms a batch (returned if it dies)."""
        return self.prefix + "credits:" + dispatcher_id

    def handoff(self, worker_id: str) -> str:
        """Batches handed off with this worker's credit, for it alone to pull."""
        return self.prefix + "batches:" + worker_id

    def processing(self, worker_id: str) -> str:
        return self.prefix + "processing:" + worker_id

    def last_step(self, worker_id: str) -> str:
        """The token of a worker's last take (``take.lua``): a repeat is known."""
        return self.prefix + "step:" + worker_id

    def heartbeat(self, role: str, process_id: str) -> str:
        return self.prefix + "hb:" + role + ":" + process_id

    def members(self, role: str) -> str:
        """The set of process ids of one role that have ever registered."""
        return self.prefix + "members:" + role

    def reply_channel(self, gateway_id: str) -> str:
        return self.prefix + "reply:" + gateway_id
