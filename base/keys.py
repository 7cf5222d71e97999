"""Every Redis key and channel name of a deployment, built in one place.

All names share one Redis Cluster hash tag, ``{ns}``, so every multi-key
script runs on one shard, and the same code runs on a single Redis, Sentinel
or Cluster.

Each model a deployment serves has its own key space (``{ns}:m:{model}:``):
its queues, fair state, batches, workers and dispatchers, jobs queues, cache
and usage, so a flood on one model never touches another's. The model named
``default`` (the one model of a policy without ``models``) keeps the bare
prefix, so a single-model deployment's keys are those of earlier versions.
What is the deployment's own stays under the bare prefix whatever the model:
a key's quotas (one allowance across models), the policy's copy, each
gateway's reply channel, the jobs' records, notices and counts per key, and
the requests cancelled (ids are unique across models; a gateway serves every
model and reads one channel).
"""

import hashlib

from infergate.base.tiers import TIERS

DEFAULT_MODEL = "default"
MODEL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MODEL_NAME_MAX = 64


def check_model_name(name: str) -> str:
    """A model's name: 1-64 of letters, digits, ``.``, ``_`` and ``-`` (it is
    part of Redis key names and of metric labels)."""
    if not 1 <= len(name) <= MODEL_NAME_MAX or not set(name) <= MODEL_NAME_CHARS:
        raise ValueError(
            f"model name {name[:80]!r} must be 1-{MODEL_NAME_MAX} letters, digits, dots, "
            "underscores or dashes"
        )
    return name


class Keys:
    """Key names under one namespace and model, e.g. ``{infergate}:queue:free``
    or ``{infergate}:m:large:queue:free``."""

    def __init__(self, namespace: str = "infergate", model: str = DEFAULT_MODEL) -> None:
        if not namespace or any(c in namespace for c in "{}: "):
            raise ValueError(
                f"namespace {namespace!r} must be non-empty without '{{', '}}', ':' or spaces"
            )
        self.namespace = namespace
        self.model = check_model_name(model)
        # The deployment's own names (``root``), and the model's.
        self.root = "{" + namespace + "}:"
        self.prefix = self.root if model == DEFAULT_MODEL else self.root + "m:" + model + ":"
        self.batches = self.prefix + "batches"
        self.ready = self.prefix + "ready"
        self.doorbell = self.prefix + "doorbell"
        self.last_dispatch = self.prefix + "last-dispatch"
        self.batch_rule = self.prefix + "batch-rule"
        self.stats = self.prefix + "stats"
        self.cancelled = self.root + "cancelled"
        self.dead_letter = self.prefix + "dead-letter"
        self.reaper_lock = self.prefix + "reaper-lock"
        self.quota_prefix = self.root + "quota"
        self.policy = self.root + "policy"
        # Workers warming up (a real model loads, then runs its first batches
        # for seconds or minutes), each until when it says so: ``up`` waits on.
        self.warming = self.root + "warming"
        # A token set once per Redis (per shard): changed after a subscription
        # dropped, that Redis lost its contents (a restart without them).
        self.epoch = self.root + "epoch"
        self.scale_signal = self.prefix + "scale-signal"
        self.scale_history = self.prefix + "scale-history"
        self.queues = tuple(self.queue(t) for t in TIERS)
        # Fair queuing inside a tier: its requests wait in one sorted set,
        # scored by each one's start tag (its key's virtual time), beside a
        # hash of the tier's virtual time and each waiting key's state
        # (``admit.lua``, ``take_*.lua``). ``queue:{tier}`` (a list) is taken
        # first: a requeue's front, and what a gateway of an earlier version queued.
        self.fair_queues = tuple(self.fair_queue(t) for t in TIERS)
        self.fair_states = tuple(self.fair_state(t) for t in TIERS)
        # Asynchronous jobs: their own queues (after every synchronous one), one
        # record per job, the queued count per key, and the channel that says
        # which jobs just finished (for long polls on any gateway).
        self.job_queues = tuple(self.job_queue(t) for t in TIERS)
        # ...fair-queued as a tier's requests are (``jfq:``, ``jfair:``):
        # ``jobs:{tier}`` (a list) is taken first, a requeue's front, and what
        # a gateway of an earlier version queued.
        self.job_fair_queues = tuple(self.job_fair_queue(t) for t in TIERS)
        self.job_fair_states = tuple(self.job_fair_state(t) for t in TIERS)
        self.job_prefix = self.root + "job:"
        self.jobs_queued = self.root + "jobs-queued"
        self.jobs_done = self.root + "jobs-done"
        self.input_prefix = self.prefix + "input:"

    def queue(self, tier: str) -> str:
        return self.prefix + "queue:" + tier

    def fair_queue(self, tier: str) -> str:
        return self.prefix + "fq:" + tier

    def fair_state(self, tier: str) -> str:
        return self.prefix + "fair:" + tier

    def job_queue(self, tier: str) -> str:
        return self.prefix + "jobs:" + tier

    def job_fair_queue(self, tier: str) -> str:
        return self.prefix + "jfq:" + tier

    def job_fair_state(self, tier: str) -> str:
        return self.prefix + "jfair:" + tier

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def give_back(self, gateway_id: str, request_id: str) -> str:
        """A withdrawn request's reservation, for the take that drops it
        (``give_back.lua``)."""
        return self.prefix + "give-back:" + gateway_id + ":" + request_id

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

    def withdrawn(self, worker_id: str) -> str:
        """Marks a worker's credit taken off ``ready`` while its backend runs
        another shard's batch (``take_join.lua``)."""
        return self.prefix + "withdrawn:" + worker_id

    def processing(self, worker_id: str) -> str:
        return self.prefix + "processing:" + worker_id

    def last_step(self, worker_id: str) -> str:
        """The token of a worker's last take (``take_*.lua``): a repeat is known."""
        return self.prefix + "step:" + worker_id

    def heartbeat(self, role: str, process_id: str) -> str:
        return self.prefix + "hb:" + role + ":" + process_id

    def members(self, role: str) -> str:
        """The set of process ids of one role that have ever registered."""
        return self.prefix + "members:" + role

    def reply_channel(self, gateway_id: str) -> str:
        return self.root + "reply:" + gateway_id

    def of_model(self, model: str) -> "Keys":
        """The same deployment's names for another model."""
        return self if model == self.model else Keys(self.namespace, model)
