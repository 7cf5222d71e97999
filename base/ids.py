"""Random ids: requests, batches, jobs, steps.

``os.urandom`` is one ``getrandom`` system call per call, and a gateway
makes two ids a request (about 3% of its CPU at 1,000 req/s on this
project's 2-core test machine). Ids are cut from a pool of the same kernel
randomness instead, refilled 4 KiB at a time: as unguessable as before
(a job id still carries 128 random bits), one system call per few hundred
ids. A forked child starts with an empty pool, so it never repeats its
parent's ids.
"""

import os
import threading

_POOL_BYTES = 4096


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the worker's backend thread makes ids too
        self._bytes = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            at = self._at
            if at + n > len(self._bytes):
                self._bytes, at = os.urandom(max(_POOL_BYTES, n)), 0
            self._at = at + n
            return self._bytes[at : at + n]

    def empty(self) -> None:
        self._lock = threading.Lock()
        self._bytes, self._at = b"", 0


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.empty)


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes, as hex (the id of something)."""
    return _pool.take(nbytes).hex()
