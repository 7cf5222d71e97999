"""A policy that follows its file: edits are picked up within a second,
validated, and swapped in whole; an invalid edit changes nothing and is
kept as ``error`` (logged, and shown in /v1/status) until fixed."""

from collections.abc import Callable
from pathlib import Path

from infergate.base import logs
from infergate.base.loops import Supervised
from infergate.policies.errors import PolicyError
from infergate.policies.loader import parse_policy
from infergate.policies.schema import Policy

log = logs.get(__name__)


class LivePolicy:
    def __init__(self, policy: Policy, path: str | None = None, interval_s: float = 0.25) -> None:
        self.current = policy
        self.path = Path(path) if path else None
        self.error: str | None = None
        self.interval_s = interval_s
        self._seen_text: str | None = None
        self._listeners: list[Callable[[Policy], None]] = []
        self.loop = Supervised("policy-watcher", self._watch, interval_s)

    def on_change(self, listener: Callable[[Policy], None]) -> None:
        self._listeners.append(listener)

    def reload(self) -> bool:
        """Read the file now; returns True if a new valid policy was swapped in."""
        if self.path is None:
            return False
        try:
            text = self.path.read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            self._fail(f"{self.path}: cannot read the policy: {exc}")
            return False
        if text == self._seen_text:
            return False
        self._seen_text = text
        try:
            policy = parse_policy(text, str(self.path))
        except PolicyError as exc:
            self._fail(str(exc))
            return False
        self.error = None
        if policy.version == self.current.version:
            return False
        old = self.current.version
        self.current = policy
        log.info(
            "policy.reloaded",
            old_version=old,
            version=policy.version,
            keys=len(policy.document.keys),
        )
        for listener in self._listeners:
            listener(policy)
        return True

    def _fail(self, message: str) -> None:
        if message != self.error:
            log.error("policy.invalid", error=message, active_version=self.current.version)
        self.error = message

    def start(self) -> None:
        if self.path is not None:
            self._seen_text = self.path.read_text("utf-8") if self.path.exists() else None
            self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()

    async def _watch(self) -> None:
        self.reload()
