"""What every remote backend shares: HTTP calls from the backend's thread,
tried again within the batch's deadline, and the server's health.

A backend call runs in the worker's backend thread; its HTTP requests run
on an event loop of the backend's own (``LoopThread``), so one call may
send many requests at once (an engine answering each prompt apart) and the
worker's own loop never waits on a server. A server that cannot be reached,
times out at its own bound (not a batch's deadline), or says it is
unavailable (408, 429, 502-504, and 401/403/404: its credentials or model
name are wrong, or its model still loads) makes ``healthy`` false at once, which
the worker's heartbeat reports (admission counts it out); the request is
tried again with backoff until it is answered, its batch's deadline, or the
call's ``timeout_ms``, never past either. A 500 is tried once more, then
taken as the batch's fault (the worker splits it: one poisoned input fails
alone); any other 4xx is the batch's fault at once.
"""

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
from infergate.base import clock, logs
from infergate.gpu.backend import BackendError, UpstreamError, deadline_of
from infergate.policies.backends import DEFAULT_TIMEOUT_MS, upstream_headers

log = logs.get(__name__)
T = TypeVar("T")

UNAVAILABLE = frozenset({401, 403, 404, 408, 429, 502, 503, 504})
BACKOFF_FIRST_S = 0.05
BACKOFF_CAP_S = 1.0
PROBE_TIMEOUT_S = 2.0
# Error bodies are read this far, for the message.
ERROR_BODY_BYTES = 2_000


class LoopThread:
    """An event loop on a daemon thread of its own, started on first use."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name=self.name, daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` there and wait for it (from any other thread)."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()


class Answered(Exception):
    """A server's answer that is not a success (status, and what it said)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


class Remote:
    """One server a backend calls: its base URL, headers, bound and health."""

    def __init__(self, url: str, options: dict[str, Any], health_url: str | None) -> None:
        self.url = url
        self.timeout_ms = int(options.get("timeout_ms", DEFAULT_TIMEOUT_MS))
        # ValueError (the worker's start says so) if a named variable is unset.
        self.headers = {"Content-Type": "application/json", **upstream_headers(options)}
        self.health_url = health_url
        self.healthy = True
        self.io = LoopThread("backend-io")
        self._session: aiohttp.ClientSession | None = None

    # -- calls ---------------------------------------------------------------

    def call(self, inputs: list[str], attempt: Callable[[float], Awaitable[T]]) -> T:
        """``attempt(timeout_s)`` on the backend's loop, tried again as the
        module says, within the batch's deadline and ``timeout_ms``
        (blocking: called from the worker's backend thread)."""
        return self.io.run(self.attempts(inputs, attempt))

    async def attempts(self, inputs: list[str], attempt: Callable[[float], Awaitable[T]]) -> T:
        bound_s = self._bound_s(inputs)
        # A try cut short by the batch's deadline says nothing of the server.
        by_deadline = bound_s < self.timeout_ms / 1000.0
        started = asyncio.get_running_loop().time()
        backoff_s = BACKOFF_FIRST_S
        failed_500 = False
        while True:
            left_s = bound_s - (asyncio.get_running_loop().time() - started)
            try:
                result = await attempt(max(0.001, left_s))
            except Answered as exc:
                if exc.status in UNAVAILABLE:
                    self._down(exc)
                elif exc.status >= 500 and not failed_500:
                    failed_500 = True  # (once more: a blip, or this batch's fault)
                else:
                    self.healthy = True  # (it answered: the batch is at fault)
                    raise BackendError(f"the server refused the batch: {exc}") from None
                error: Exception = exc
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if not (by_deadline and isinstance(exc, TimeoutError)):
                    self._down(exc)
                error = exc
            else:
                self.healthy = True
                return result
            left_s = bound_s - (asyncio.get_running_loop().time() - started)
            if left_s <= backoff_s:
                raise UpstreamError(f"the model's server did not answer: {_describe(error)}")
            await asyncio.sleep(backoff_s)
            backoff_s = min(BACKOFF_CAP_S, backoff_s * 2)

    def _bound_s(self, inputs: list[str]) -> float:
        bound_s = self.timeout_ms / 1000.0
        deadline_ms = deadline_of(inputs)
        if deadline_ms:
            bound_s = min(bound_s, (deadline_ms - clock.now_ms()) / 1000.0)
        return max(0.001, bound_s)

    def _down(self, exc: Exception) -> None:
        if self.healthy:
            log.warning("upstream.down", url=self.url, error=_describe(exc))
        self.healthy = False

    async def post(self, url: str, body: Any, timeout_s: float) -> Any:
        """POST ``body`` as JSON; the decoded JSON answer (``Answered`` if
        not 2xx, BackendError if not JSON)."""
        session = self._session_here()
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, data=data, headers=self.headers, timeout=timeout) as resp:
            if resp.status >= 300:
                text = (await resp.content.read(ERROR_BODY_BYTES)).decode("utf-8", "replace")
                raise Answered(resp.status, text)
            raw = await resp.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BackendError(f"the server's answer is not JSON: {raw[:100]!r}") from None

    async def get(self, url: str, timeout_s: float) -> Any:
        """GET ``url``; its JSON (None if not JSON), ``Answered`` if not 2xx."""
        session = self._session_here()
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, headers=self.headers, timeout=timeout) as resp:
            raw = await resp.read()
            if resp.status >= 300:
                raise Answered(resp.status, raw[:ERROR_BODY_BYTES].decode("utf-8", "replace"))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def _session_here(self) -> aiohttp.ClientSession:
        if self._session is None:  # (made on the backend's loop, which it belongs to)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
                raise_for_status=False,
            )
        return self._session

    def close(self) -> None:
        """Close its connections (the worker leaving)."""
        if self._session is not None:
            session, self._session = self._session, None
            self.io.run(session.close())

    # -- health ----------------------------------------------------------------

    def probe(self) -> bool:
        """Whether the server answers now (its health URL, or any answer
        from its address); sets ``healthy``."""
        return self.io.run(self._probe())

    async def _probe(self) -> bool:
        try:
            if self.health_url is not None:
                await self.get(self.health_url, PROBE_TIMEOUT_S)
            else:
                await self._reachable()
        except Exception as exc:
            self._down(exc)
            return False
        if not self.healthy:
            log.info("upstream.up", url=self.url)
        self.healthy = True
        return True

    async def _reachable(self) -> None:
        """Any HTTP answer from the server's address will do."""
        session = self._session_here()
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        async with session.get(self.url, headers=self.headers, timeout=timeout) as resp:
            if resp.status in UNAVAILABLE - {404}:
                raise Answered(resp.status, "")


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:200]}" if not isinstance(exc, Answered) else text
