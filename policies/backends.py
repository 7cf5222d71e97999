"""What a model's ``backend`` may name, and the options each kind takes.

In the worker's process: ``simulated``, ``transformers``, or the team's own
code, ``python:pkg.module:attr``. A server the worker calls with the whole
batch: ``http:URL`` (infergate's JSON contract), ``kserve-v2:URL`` (the Open
Inference Protocol of Triton, KServe and MLServer) or ``openai:URL`` (an
engine that batches by itself: vLLM, SGLang, TGI, llama.cpp). Parsed here
once, for the policy check, the worker's flags and ``backend check`` alike.
"""

import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infergate.policies.schema import Model

# What a backend may be unable to do for a request: a worker's heartbeat
# lists those its backend lacks, and the gateway refuses them with 400.
SAMPLING = "sampling"
MAX_TOKENS = "max_tokens"

IN_PROCESS = ("simulated", "transformers", "python")
REMOTE = ("http", "kserve-v2", "openai")
KINDS = (*IN_PROCESS, *REMOTE)
HINT = (
    "write simulated, transformers, python:pkg.module:attr, http:URL, kserve-v2:URL or openai:URL"
)

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")

# The options each remote kind takes, with their type; every one optional
# but kserve-v2's model. (A python backend's options are its own keyword
# arguments: any mapping.)
_COMMON: dict[str, type | tuple[type, ...]] = {
    "timeout_ms": int,
    "api_key_env": str,
    "headers_env": str,
}
OPTIONS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "simulated": {},
    "transformers": {},
    "http": {**_COMMON, "sampling": bool, "max_tokens": bool, "health_path": str},
    "kserve-v2": {**_COMMON, "model": str, "version": str, "input": str, "output": str},
    "openai": {**_COMMON, "model": str, "prompt_list": (bool, str)},
}
OPTION_NAMES = frozenset(name for names in OPTIONS.values() for name in names)
# A remote call, its retries included, is bounded by the batch's deadline
# and by this (the worker's hang timeout stays above it).
DEFAULT_TIMEOUT_MS = 60_000
MAX_TIMEOUT_MS = 600_000


@dataclass(frozen=True)
class BackendSpec:
    """A parsed ``backend``: its kind, and the import path or URL it names."""

    kind: str
    target: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}" if self.target else self.kind


def parse_spec(text: str) -> BackendSpec:
    """The spec ``text`` names; ValueError saying how to write it if none."""
    text = str(text).strip()
    if text in ("simulated", "transformers"):
        return BackendSpec(text)
    kind, sep, target = text.partition(":")
    if not sep or kind not in KINDS or kind in ("simulated", "transformers"):
        raise ValueError(f"{text[:80]!r} is not a backend; {HINT}")
    if kind == "python":
        module, colon, attr = target.partition(":")
        if not colon or not _DOTTED.match(module) or not _DOTTED.match(attr):
            raise ValueError(
                f"{text[:80]!r}: name the code as python:package.module:attribute "
                "(a function, an async function, a class or a factory)"
            )
        return BackendSpec(kind, target)
    return BackendSpec(kind, _check_url(kind, target))


def _check_url(kind: str, url: str) -> str:
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # (a port that is not a number raises)
    except ValueError:
        parts = None
    if url.startswith("//"):
        raise ValueError(
            f"{kind}:{url[:80]!r}: name the kind before the URL, e.g. "
            "http:http://host:8000/infer, kserve-v2:http://host:8000 or openai:http://host:8000/v1"
        )
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{kind}:{url[:80]!r}: the URL must be http(s)://host[:port][/path]")
    if parts.username or parts.password:
        raise ValueError(
            f"{kind}: the URL holds credentials; name an environment variable that holds "
            "them instead (options api_key_env or headers_env)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{kind}: the URL must have no query or fragment")
    return url.rstrip("/")


def check_options(spec: BackendSpec, options: dict[str, Any]) -> list[tuple[str | None, str]]:
    """What is wrong with ``options`` for ``spec``: (the option at fault, or
    None for the mapping, and the message) for each problem."""
    if spec.kind == "python":
        bad = [name for name in options if not isinstance(name, str) or not name.isidentifier()]
        return [(None, f"{name!r} is not a keyword argument's name") for name in bad[:3]]
    known = OPTIONS[spec.kind]
    out: list[tuple[str | None, str]] = []
    for name, value in options.items():
        wanted = known.get(name)
        if wanted is None:
            takes = ", ".join(known) or "none"
            out.append(
                (None, f"{str(name)[:40]!r} is not an option of {spec.kind} (it takes {takes})")
            )
        elif (isinstance(value, bool) and wanted is int) or not isinstance(value, wanted):
            out.append((name, f"must be {_type_name(wanted)}"))
    out.extend(_check_values(spec, options))
    return out


def _check_values(spec: BackendSpec, options: dict[str, Any]) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = []
    timeout = options.get("timeout_ms", DEFAULT_TIMEOUT_MS)
    if isinstance(timeout, int) and not 1 <= timeout <= MAX_TIMEOUT_MS:
        out.append(("timeout_ms", f"must be 1-{MAX_TIMEOUT_MS}, e.g. {DEFAULT_TIMEOUT_MS}"))
    for name in ("api_key_env", "headers_env"):
        value = options.get(name)
        if isinstance(value, str) and not _ENV_NAME.match(value):
            out.append((name, "must name an environment variable, e.g. UPSTREAM_API_KEY"))
    if spec.kind == "kserve-v2" and not options.get("model"):
        out.append((None, "kserve-v2 needs the server's model name: options: {model: NAME}"))
    if spec.kind == "openai" and options.get("prompt_list", "auto") not in (True, False, "auto"):
        out.append(("prompt_list", "must be true, false or auto"))
    path = options.get("health_path")
    if isinstance(path, str) and not path.startswith("/"):
        out.append(("health_path", "must be a path, e.g. /health"))
    return out


def _type_name(wanted: type | tuple[type, ...]) -> str:
    names = {int: "a whole number", str: "a string", bool: "true or false"}
    if isinstance(wanted, tuple):
        return " or ".join(names[t] for t in wanted)
    return names[wanted]


def upstream_headers(options: dict[str, Any]) -> dict[str, str]:
    """The headers a remote backend sends: its credentials, read from the
    environment variables its options name (never from the policy itself).
    ValueError if a named variable is unset or not what it should hold."""
    headers: dict[str, str] = {}
    if name := options.get("headers_env"):
        text = os.environ.get(name)
        if text is None:
            raise ValueError(f"headers_env names {name}, which is not set")
        try:
            given = json.loads(text)
        except json.JSONDecodeError:
            given = None
        if not isinstance(given, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in given.items()
        ):
            raise ValueError(f"{name} must hold a JSON object of header names and values")
        headers.update(given)
    if name := options.get("api_key_env"):
        key = os.environ.get(name)
        if not key:
            raise ValueError(f"api_key_env names {name}, which is not set")
        headers["Authorization"] = "Bearer " + key
    return headers


def generates_up_to(model: "Model") -> int | None:
    """The most new tokens a request to ``model`` may ask for: its
    ``max_new_tokens``, where infergate tells the model how many to make
    (transformers, openai, and http where it honours max_tokens); None
    where the backend decides (a request's max_tokens then cuts its output)."""
    kind = model.backend.strip().partition(":")[0]  # (checked when the policy loaded)
    if kind in ("transformers", "openai") or (kind == "http" and model.options.get("max_tokens")):
        return model.max_new_tokens
    return None
