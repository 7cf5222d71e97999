"""The Lua scripts of the data model, loaded once from the package and
registered once per Redis client (EVALSHA, with a reload on NOSCRIPT)."""

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


@cache
def source(name: str) -> str:
    return resources.files("dispatcher").joinpath("lua", name + ".lua").read_text("utf-8")


class Scripts:
    """One registered ``AsyncScript`` per Lua file, bound to one client."""

    def __init__(self, redis: Redis) -> None:
        self.enqueue: AsyncScript = redis.register_script(source("enqueue"))
        self.take: AsyncScript = redis.register_script(source("take"))
        self.handoff: AsyncScript = redis.register_script(source("handoff"))
        self.finish: AsyncScript = redis.register_script(source("finish"))
        self.requeue: AsyncScript = redis.register_script(source("requeue"))
        self.retry: AsyncScript = redis.register_script(source("retry"))
        self.ensure_credit: AsyncScript = redis.register_script(source("ensure_credit"))
