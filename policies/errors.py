"""Policy errors: each problem names the file, the line, the path in the
document and what to write instead.

Two renderings. ``str(problem)`` is for the operator's own terminal
(``infergate policy check``): it quotes what the file says. ``public()`` is
for everything a running process shows or logs (``/v1/status``, the admin
API, ``policy.invalid``): the file's name, the line, the path with any name
that is not part of the schema masked, and the message with every quoted
value masked, so a secret pasted into the file by mistake is never echoed.
"""

import re
from dataclasses import dataclass
from pathlib import PurePath

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_PATH_PART = re.compile(r"\[\d+\]|[^.\[]+")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"

    def public(self, known_names: frozenset[str] = frozenset()) -> str:
        name = PurePath(self.file).name
        where = f"{name}:{self.line}" if self.line else name
        message = _QUOTED.sub("'…'", self.message).split("\n")[0]
        if not self.path:
            return f"{where}: {message}"
        return f"{where}: {_mask_path(self.path, known_names)}: {message}"


def _mask_path(path: str, known_names: frozenset[str]) -> str:
    out = ""
    for part in _PATH_PART.findall(path):
        if part.startswith("["):
            out += part
        else:
            out += ("." if out else "") + (part if part in known_names else "?")
    return out


class PolicyError(Exception):
    """The policy file cannot be used; ``problems`` says every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    def __reduce__(self) -> tuple[type["PolicyError"], tuple[list[Problem]]]:
        # Parsed in another process (live reload): it travels back pickled.
        return (PolicyError, (self.problems,))

    def public(self, known_names: frozenset[str] = frozenset()) -> str:
        """Every problem, with nothing copied from the file (see ``Problem.public``)."""
        lines = [p.public(known_names) for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"... and {len(self.problems) - 20} more")
        lines.append("(run `infergate policy check FILE` for the details)")
        return "\n".join(lines)
