"""Where in the policy file a path of the document is: the line of its
YAML node, for every problem the checks report."""

import re
from typing import Any

import yaml
from infergate.policies.errors import Problem

_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


class Locator:
    """Maps a path in the document to the line of its YAML node."""

    def __init__(self, root: yaml.Node | None, filename: str) -> None:
        self.root = root
        self.filename = filename

    def line(self, path: list[str | int]) -> int | None:
        node: Any = self.root
        best = node.start_mark.line + 1 if node is not None else None
        for part in path:
            child = None
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == str(part):
                        child = v
                        best = k.start_mark.line + 1
                        break
            elif (
                isinstance(node, yaml.SequenceNode)
                and isinstance(part, int)
                and part < len(node.value)
            ):
                child = node.value[part]
                best = child.start_mark.line + 1
            if child is None:
                break
            node = child
        return best

    def problem(self, path: list[str | int], message: str) -> Problem:
        return Problem(self.filename, self.line(path), _render(path), message)

    def problem_from_msgspec(self, message: str, base: list[str | int] | None = None) -> Problem:
        m = _MSGSPEC_PATH.search(message)
        path: list[str | int] = list(base or [])
        if m:
            message = message[: m.start()]
            for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", m.group("path")):
                path.append(int(index) if index else name)
        hint = {
            "Expected `int`": "write a whole number, e.g. 5000",
            "Expected `float`": "write a number, e.g. 0.1",
            "Expected `bool`": "write true or false",
            "Expected `array`": "write a list, e.g. ['100/second']",
            "Expected `str`": "write a string in quotes",
        }
        extra = next((h for prefix, h in hint.items() if message.startswith(prefix)), None)
        if message.startswith("Object contains unknown field"):
            path.append(message.split("`")[1])
            extra = "remove it or check its spelling against policies/example.yaml"
        if message.startswith("Object missing required field"):
            extra = "add it (see policies/example.yaml)"
        return self.problem(path, f"{message}; {extra}" if extra else message)


def _render(path: list[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
