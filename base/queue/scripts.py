"""The Lua scripts of the data model, loaded once from the package and
registered once per Redis client (EVALSHA, with a reload on NOSCRIPT)."""

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


@cache
def source(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name + ".lua").read_text("utf-8")


class Scripts:
    """One registered ``AsyncScript`` per Lua file, bound to one client."""

    def __init__(self, redis: Redis) -> None:
        def load(name: str) -> AsyncScript:
            return redis.register_script(source(name))

        self.admit = load("admit")
        self.take = load("take")
        self.handoff = load("handoff")
        self.offer_credit = load("offer_credit")
        self.ack_batch = load("ack_batch")
        self.ensure_credit = load("ensure_credit")
        self.requeue = load("requeue")
        self.retry = load("retry")
        self.reaper_lock = load("reaper_lock")
        self.enqueue_job = load("enqueue_job")
        self.finish_jobs = load("finish_jobs")
        self.cancel_job = load("cancel_job")
