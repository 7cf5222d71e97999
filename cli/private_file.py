"""Files that hold secrets (the demo keys of ``infergate up --keys-out``).

The path is the user's, but the directory may be shared (/tmp): a file
someone else created there, or a symlink planted to point at another file,
must not receive the secrets. So the text goes to a new file of our own,
made with O_EXCL in the target's directory, and is renamed over the target
(a rename replaces a symlink, never what it points to); a target that is a
symlink, or another user's file, is refused instead.
"""

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class PrivateFileRefused(OSError):
    """The target is not ours to write secrets to; the message says why."""


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600),
    atomically: a reader sees the old file or the whole new one."""
    _check_target(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp: O_EXCL, 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _check_target(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise PrivateFileRefused(f"{path} is a symlink; secrets are never written through one")
    if not stat.S_ISREG(info.st_mode):
        raise PrivateFileRefused(f"{path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise PrivateFileRefused(
            f"{path} belongs to another user (uid {info.st_uid}); choose a path of your own"
        )
