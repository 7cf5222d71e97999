"""A policy that follows its file.

Every ``interval_s`` the file is stat'ed, and read if that moved. When it
changed and then stayed the same for one more poll, ``SETTLE_S`` later,
untouched (same text, same modification time: a file written in place is
never taken half-written), it is parsed and validated off the event loop, in a thread:
a 2 MB policy costs the gateway's requests nothing. A valid edit is swapped
in whole and kept in Redis as the fleet's last valid policy, which a
process that starts while the file is invalid comes up on. An invalid or
unreadable file changes nothing; ``error`` says why (without quoting the
file: ``PolicyError.public``) for as long as the file is in that state, and
clears when the file is readable and valid again, or back to the policy in
force.
"""

import asyncio
import multiprocessing
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from infergate.base import logs
from infergate.base.loops import Supervised
from infergate.policies.errors import PolicyError
from infergate.policies.loader import (
    MAX_POLICY_BYTES,
    PolicyFile,
    parse_policy,
    public_error,
    read_policy_file,
)
from infergate.policies.schema import Policy

log = logs.get(__name__)

# The poll while a changed file waits to be read again unchanged: an edit
# is in force within ``interval_s + SETTLE_S`` (0.75 s by default), and a
# process at rest wakes for the file twice a second, not four times.
SETTLE_S = 0.25

# A policy up to this size is parsed in a thread; a bigger one in a process
# of its own, so the parse never holds the GIL that the event loop needs
# (a thread parsing a 2 MB file stalled requests for seconds on a busy host).
IN_THREAD_BYTES = 64 * 1024

# Keeps a newly valid policy where every process can read it (Redis).
Keeper = Callable[[Policy, str], Awaitable[None]]


class LivePolicy:
    def __init__(
        self,
        policy: Policy,
        path: str | None = None,
        *,
        text: str | None = None,
        error: str | None = None,
        interval_s: float = 0.5,
        max_bytes: int = MAX_POLICY_BYTES,
    ) -> None:
        self._policy = policy
        # The model this process serves: its view of the policy (Policy.for_model).
        self.model: str | None = None
        self.path = Path(path) if path else None
        # Why the file is not the policy in force (None while it is, or is valid).
        self.error = error
        self.max_bytes = max_bytes
        self._active_text = text
        # A changed file, waiting to be read again unchanged (same text, same mtime).
        self._candidate: PolicyFile | None = None
        self._verdicts: dict[str, str | None] = {} if text is None else {text: None}
        self._listeners: list[Callable[[Policy], None]] = []
        self._refused: list[Callable[[], None]] = []
        self._keeper: Keeper | None = None
        self._lock = asyncio.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._kept = False
        # The file as stat saw it before it was last read: a poll that finds
        # it the same reads nothing (a read is a thread's hop, four times a
        # second in every process). ctime moves with any write or chmod.
        self._seen: tuple[int, int, int, int, int] | None = None
        self.interval_s = interval_s
        self.loop = Supervised("policy-watcher", self.check_file, interval_s)

    @property
    def current(self) -> Policy:
        """The policy in force (as the model this process serves sees it)."""
        policy = self._policy
        return policy if self.model is None else policy.for_model(self.model)

    def on_change(self, listener: Callable[[Policy], None]) -> None:
        self._listeners.append(listener)

    def on_refused(self, callback: Callable[[], None]) -> None:
        """Called each time a changed file is refused (for the metrics)."""
        self._refused.append(callback)

    def keep_with(self, keeper: Keeper) -> None:
        """Where to keep each newly valid policy (and the one in force at start)."""
        self._keeper = keeper

    async def check_file(self) -> bool:
        """One poll: True if a new valid policy was swapped in."""
        if not self._kept and self.error is None:
            await self.keep()  # a keep that failed earlier (Redis away) is tried again
        try:
            return await self._reload(settle=True)
        finally:
            settling = self._candidate is not None
            self.loop.interval_s = min(SETTLE_S, self.interval_s) if settling else self.interval_s

    async def reload(self) -> bool:
        """Read the file now (an admin asked); True if a new valid policy was swapped in."""
        return await self._reload(settle=False)

    async def _reload(self, settle: bool) -> bool:
        if self.path is None:
            return False
        async with self._lock:
            seen = _stat(self.path)
            if settle and self._candidate is None and seen is not None and seen == self._seen:
                return False  # (the file is as when last read: nothing to read)
            self._seen = seen
            try:
                read = await asyncio.to_thread(read_policy_file, self.path, self.max_bytes)
            except PolicyError as exc:
                self._candidate = None
                self._fail(public_error(exc))
                return False
            if read.text == self._active_text:
                self._candidate = None
                self._ok()
                return False
            if settle and read != self._candidate:
                self._candidate = read  # changed: take it once it reads the same again
                return False
            self._candidate = None
            return await self._apply(read.text)

    async def _apply(self, text: str) -> bool:
        if text in self._verdicts:  # seen before: same verdict, no second parse
            error = self._verdicts[text]
            if error is not None:
                self._fail(error)
                return False
        try:
            policy = await self._parse(text)
        except PolicyError as exc:
            self._verdicts = {text: public_error(exc)}
            self._fail(self._verdicts[text] or "")
            return False
        self._verdicts = {text: None}
        self._ok()
        self._active_text = text
        if policy.version == self.current.version:
            return False
        old = self.current.version
        self._policy = policy
        log.info(
            "policy.reloaded",
            old_version=old,
            version=policy.version,
            keys=len(policy.document.keys),
        )
        for listener in self._listeners:
            listener(self.current)
        self._kept = False
        await self.keep()
        return True

    async def _parse(self, text: str) -> Policy:
        if len(text) <= IN_THREAD_BYTES:
            return await asyncio.to_thread(parse_policy, text, str(self.path))
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, parse_policy, text, str(self.path))
        except PolicyError:
            raise
        except Exception:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None  # a broken pool is made anew next time
            raise

    async def keep(self) -> None:
        """Keep the policy in force where every process can read it: only a
        policy read from a file (the built-in example is never kept)."""
        if self._keeper is not None and self._active_text is not None and self.path is not None:
            await self._keeper(self._policy, self._active_text)
        self._kept = True

    def _ok(self) -> None:
        if self.error is not None:
            log.info("policy.file_ok", version=self.current.version)
        self.error = None

    def _fail(self, message: str) -> None:
        if message != self.error:
            log.error("policy.invalid", error=message, active_version=self.current.version)
            for callback in self._refused:
                callback()
        self.error = message

    def start(self) -> None:
        if self.path is not None:
            self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _stat(path: Path) -> tuple[int, int, int, int, int] | None:
    """What a change to the file moves (None if it cannot be stat'ed: read
    it, for the error): a stat of a local file, cheap enough for the loop."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)
