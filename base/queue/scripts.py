"""The Lua scripts of the data model, loaded once from the package and
registered once per Redis client (EVALSHA, with a reload on NOSCRIPT)."""

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

# Lua put before a script's own (Redis scripts cannot call one another),
# each file one concern: the scripts that read the published batching rule
# read it one way, those that hand a batch to an idle worker choose it one
# way, and every take forms a batch one way.
_TAKE = (
    "numbers",
    "rule",
    "frame",
    "budget",
    "give_back",
    "take_envelope",
    "take_pop",
    "take_form",
)
_ADMIT = (
    "numbers",
    "rule",
    "idle_worker",
    "frame",
    "budget",
    "window",
    "fair_tag",
    "hand_straight",
)
LIBRARIES = {
    "take_dispatch": _TAKE,
    "take_worker": _TAKE,
    "take_join": _TAKE,
    "take_withdrawn": _TAKE,
    "admit": (*_ADMIT, "admit_request"),
    "retry": ("idle_worker",),
    "settle": ("numbers", "budget", "give_back"),
    "enqueue_job": ("numbers", "fair_tag"),
    "finish_jobs": ("numbers", "budget", "give_back"),
    "cancel_job": ("numbers", "budget", "give_back"),
    "fleet": ("beats",),
    "heartbeats": ("beats",),
    "reap": ("lock", "beats"),
    "release_lock": ("lock",),
}


@cache
def source(name: str) -> str:
    """A script's text: its libraries, then its own."""
    return libraries(name) + "\n" + _file(name)


def libraries(name: str) -> str:
    """The Lua put before script ``name`` (a test entry over them too)."""
    return "\n".join(_file(n) for n in LIBRARIES.get(name, ()))


def _file(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name + ".lua").read_text("utf-8")


class Scripts:
    """One registered ``AsyncScript`` per Lua file, bound to one client."""

    def __init__(self, redis: Redis) -> None:
        def load(name: str) -> AsyncScript:
            return redis.register_script(source(name))

        self.admit = load("admit")
        self.settle = load("settle")
        self.fleet = load("fleet")
        self.heartbeats = load("heartbeats")
        self.take_dispatch = load("take_dispatch")
        self.take_worker = load("take_worker")
        self.take_join = load("take_join")
        self.take_withdrawn = load("take_withdrawn")
        self.offer_credit = load("offer_credit")
        self.ack_batch = load("ack_batch")
        self.ensure_credit = load("ensure_credit")
        self.requeue = load("requeue")
        self.retry = load("retry")
        self.reap = load("reap")
        self.release_lock = load("release_lock")
        self.enqueue_job = load("enqueue_job")
        self.finish_jobs = load("finish_jobs")
        self.charge_usage = load("charge_usage")
        self.cancel_job = load("cancel_job")
        self.hand_back = load("hand_back")
        self.pull_waiting = load("pull_waiting")

    async def load_all(self) -> None:
        """Load every script into Redis again (it forgot them: a restart, a failover)."""
        for script in vars(self).values():
            if isinstance(script, AsyncScript):
                await script.registered_client.script_load(script.script)


async def execute(
    redis: Redis, scripts: Scripts, build: Callable[[Pipeline], None], transaction: bool = True
) -> list[Any]:
    """Build a pipeline with ``build`` and execute it: one round trip. If
    Redis had forgotten a script it runs (those commands failed, the others
    ran), load every script and run the whole pipeline once more: callers
    build only pipelines that may run twice."""
    for attempt in (1, 2):
        async with redis.pipeline(transaction=transaction) as pipe:
            build(pipe)
            try:
                result: list[Any] = await pipe.execute()
                return result
            except NoScriptError:
                if attempt == 2:
                    raise
        await scripts.load_all()
    raise AssertionError("unreachable")


def evalsha(script: AsyncScript, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """The command that runs ``script``, for a pipeline or a transaction."""
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def queue_on(pipe: Pipeline, script: AsyncScript, keys: list[str], args: list[Any]) -> None:
    """Queue an EVALSHA of ``script`` on a pipeline. (Passing ``client=pipe``
    to the script instead makes every execute of the pipeline cost one more
    round trip, SCRIPT EXISTS; ``execute`` handles NOSCRIPT instead.)"""
    pipe.execute_command(*evalsha(script, keys, args))
