"""Read, validate and derive a ``Policy`` from YAML text.

Structure is checked by msgspec against ``schema.Document``; meaning (tier
names, digests, rate-limit notation, shares) is checked here. Every problem
carries the line of the YAML node it is about.
"""

import hashlib
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import yaml
from infergate.base.tiers import TIERS
from infergate.policies.auth import check_clients
from infergate.policies.backends import OPTION_NAMES
from infergate.policies.errors import PolicyError, Problem
from infergate.policies.locator import Locator
from infergate.policies.models import check_batching, check_models, check_workers
from infergate.policies.schema import (
    Autoscale,
    Batching,
    Budget,
    Capacity,
    Document,
    Jobs,
    KeyEntry,
    Limits,
    Model,
    Policy,
    Sharing,
    Tier,
    Workers,
)
from limits import parse_many

_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_RATE_HINT = "write e.g. '100/second' or '5000/minute' (several: a list)"
# A request body carries one input: no policy may let a client send more.
MAX_BODY_BYTES = 1_048_576
# Room in a body for what is not the input: the JSON around it, its other fields.
BODY_OVERHEAD_BYTES = 1_024


# A policy bigger than this is refused before it is read (20,000 keys are
# about 2 MB). A process setting: INFERGATE_MAX_POLICY_BYTES.
MAX_POLICY_BYTES = 8 * 1024 * 1024

# libyaml's parser where PyYAML was built with it: ~10x faster on big files.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# The names a document may use: shown as they are in a public problem; any
# other name in a problem's path came from the file and is masked.
SCHEMA_NAMES = (
    frozenset(TIERS)
    | frozenset(
        field.name
        for struct in (
            Document,
            Tier,
            KeyEntry,
            Batching,
            Capacity,
            Autoscale,
            Jobs,
            Sharing,
            Limits,
            Workers,
            Model,
        )
        for field in msgspec.structs.fields(struct)
    )
    | OPTION_NAMES
)


def public_error(exc: PolicyError) -> str:
    """What a running process may show or log about an invalid policy."""
    return exc.public(SCHEMA_NAMES)


class PolicyFile(NamedTuple):
    text: str
    # (mtime ns, size, inode) as read: a file rewritten between two reads
    # differs here even when it says the same.
    signature: tuple[int, int, int]


def read_policy_file(path: str | Path, max_bytes: int = MAX_POLICY_BYTES) -> PolicyFile:
    """The file's text, refused (PolicyError) if unreadable or over
    ``max_bytes`` (checked before it is read), or if it changed while read."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            before = os.fstat(f.fileno())
            if before.st_size > max_bytes:
                raise PolicyError(
                    [Problem(str(p), None, "", f"the file is over {max_bytes} bytes; not read")]
                )
            data = f.read(max_bytes + 1)
            after = os.fstat(f.fileno())
    except OSError as exc:
        raise PolicyError(
            [Problem(str(p), None, "", f"cannot read the policy: {exc.strerror}")]
        ) from exc
    if len(data) > max_bytes:
        raise PolicyError(
            [Problem(str(p), None, "", f"the file is over {max_bytes} bytes; not read")]
        )
    signature = (after.st_mtime_ns, after.st_size, after.st_ino)
    if (before.st_mtime_ns, before.st_size) != signature[:2]:
        raise PolicyError([Problem(str(p), None, "", "the file changed while it was read")])
    try:
        return PolicyFile(data.decode("utf-8"), signature)
    except UnicodeDecodeError as exc:
        raise PolicyError([Problem(str(p), None, "", "the file is not UTF-8 text")]) from exc


def read_policy_text(path: str | Path, max_bytes: int = MAX_POLICY_BYTES) -> str:
    return read_policy_file(path, max_bytes).text


def load_policy(path: str | Path, max_bytes: int = MAX_POLICY_BYTES) -> Policy:
    return parse_policy(read_policy_text(path, max_bytes), str(path))


def parse_policy(text: str, filename: str = "<policy>") -> Policy:
    root = _compose(text, filename)
    data = _construct(root, filename)
    if not isinstance(data, dict):
        raise PolicyError(
            [Problem(filename, 1, "", "the policy must be a mapping with 'tiers:' and 'keys:'")]
        )
    locate = Locator(root, filename)
    for section, kind in (("tiers", Tier), ("models", Model)):
        entries = data.get(section)
        if not isinstance(entries, dict):
            continue
        # msgspec does not name dict keys in its error paths: check each entry alone.
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, kind, strict=True)
            except msgspec.ValidationError as exc:
                raise PolicyError(
                    [locate.problem_from_msgspec(str(exc), [section, str(name)])]
                ) from exc
    try:
        document = msgspec.convert(data, Document, strict=True)
    except msgspec.ValidationError as exc:
        raise PolicyError([locate.problem_from_msgspec(str(exc))]) from exc
    problems = _check(document, locate)
    if problems:
        raise PolicyError(problems)
    return Policy(
        document=document,
        version=hashlib.sha256(text.encode("utf-8")).hexdigest()[:12],
        source=filename,
        keys_by_digest={k.sha256: k for k in document.keys},
    )


def _compose(text: str, filename: str) -> yaml.Node | None:
    """The YAML node tree, refused if it is not YAML, nests too deep, or uses
    anchors and aliases (a few lines of aliases expand to billions of nodes)."""
    loader = _Loader(text)
    try:
        root: yaml.Node | None = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise PolicyError([Problem(filename, line, "", f"not valid YAML: {exc}")]) from None
    except RecursionError:
        raise PolicyError([Problem(filename, None, "", "the YAML nests too deeply")]) from None
    finally:
        loader.dispose()
    seen: set[int] = set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            raise PolicyError(
                [
                    Problem(
                        filename,
                        node.start_mark.line + 1,
                        "",
                        "anchors and aliases (&name, *name) are not allowed in a policy; "
                        "write each value out",
                    )
                ]
            )
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            _refuse_repeated_keys(node, filename)
            stack.extend(part for pair in node.value for part in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return root


def _refuse_repeated_keys(node: yaml.MappingNode, filename: str) -> None:
    """A key written twice in one mapping (YAML keeps the last, silently: a
    `disabled: true` above a `disabled: false` would not disable)."""
    names: set[str] = set()
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        if key.value in names:
            line, what = key.start_mark.line + 1, f"{key.value[:64]!r} is written twice; keep one"
            raise PolicyError([Problem(filename, line, "", what)])
        names.add(key.value)


def _construct(root: yaml.Node | None, filename: str) -> Any:
    if root is None:
        return None
    loader = _Loader("")
    try:
        return loader.construct_document(root)
    except RecursionError:
        raise PolicyError([Problem(filename, None, "", "the YAML nests too deeply")]) from None
    except yaml.YAMLError as exc:  # a tag it cannot build (!!python/..., !!binary, ...)
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise PolicyError([Problem(filename, line, "", f"not valid YAML: {exc}")]) from None
    except (ValueError, TypeError, OverflowError) as exc:  # !!int 0xZZ, !!timestamp 2020-13-45
        raise PolicyError(
            [Problem(filename, None, "", f"a value YAML cannot read: {type(exc).__name__}")]
        ) from None
    finally:
        loader.dispose()


def _check(doc: Document, at: Locator) -> list[Problem]:
    return [
        *_check_tiers(doc, at),
        *_check_keys(doc, at),
        *_check_settings(doc, at),
        *check_models(doc, at),
        *check_clients(doc, at),
    ]


def _check_tiers(doc: Document, at: Locator) -> list[Problem]:
    out: list[Problem] = []
    missing = [t for t in TIERS if t not in doc.tiers]
    if missing:
        out.append(
            at.problem(
                ["tiers"], f"missing tier(s) {', '.join(missing)}; define all of {', '.join(TIERS)}"
            )
        )
    for name in doc.tiers:
        if name not in TIERS:
            out.append(
                at.problem(["tiers", name], f"unknown tier {name!r}; tiers are {', '.join(TIERS)}")
            )
    for name, tier in doc.tiers.items():
        out.extend(_check_tier(name, tier, at))
    share_total = sum(tier.min_batch_share for tier in doc.tiers.values())
    if share_total > 1.0:
        out.append(
            at.problem(
                ["tiers"],
                f"min_batch_share values add up to {share_total:g}; keep the sum at most 1",
            )
        )
    return out


def _check_tier(name: str, tier: Tier, at: Locator) -> list[Problem]:
    out: list[Problem] = []
    here: list[str | int] = ["tiers", name]
    for field, value in (
        ("deadline_ms", tier.deadline_ms),
        ("max_input_chars", tier.max_input_chars),
        ("latency_budget_ms", tier.latency_budget_ms),
    ):
        if value <= 0:
            out.append(at.problem([*here, field], f"{value} must be a positive whole number"))
    if tier.latency_budget_ms > tier.deadline_ms:
        out.append(
            at.problem(
                [*here, "latency_budget_ms"],
                "must not exceed deadline_ms; lower it or raise deadline_ms",
            )
        )
    out.extend(_check_rates(tier.rate_limits, [*here, "rate_limits"], at))
    if tier.cost_limit is not None:
        out.extend(_check_rates([tier.cost_limit], [*here, "cost_limit"], at, single=True))
    out.extend(_check_rates(tier.token_limits, [*here, "token_limits"], at))
    out.extend(_check_budget(tier.budget, [*here, "budget"], at))
    if not 0.0 <= tier.min_batch_share <= 1.0:
        out.append(at.problem([*here, "min_batch_share"], "must be between 0 and 1, e.g. 0.1"))
    if not 1_000 <= tier.job_deadline_ms <= 7 * 86_400_000:
        out.append(
            at.problem([*here, "job_deadline_ms"], "must be 1000-604800000 (7 days), e.g. 3600000")
        )
    return out


def _check_keys(doc: Document, at: Locator) -> list[Problem]:
    out: list[Problem] = []
    seen_ids: dict[str, int] = {}
    seen_digests: dict[str, int] = {}
    for i, key in enumerate(doc.keys):
        here: list[str | int] = ["keys", i]
        if not _KEY_ID.match(key.id):
            out.append(
                at.problem(
                    [*here, "id"],
                    f"{key.id!r} is not a key id; use letters, digits, '.', '_' or '-'",
                )
            )
        elif key.id in seen_ids:
            out.append(
                at.problem(
                    [*here, "id"],
                    f"duplicate key id {key.id!r} (first at keys[{seen_ids[key.id]}])",
                )
            )
        seen_ids.setdefault(key.id, i)
        if key.tier not in doc.tiers:
            out.append(
                at.problem(
                    [*here, "tier"],
                    f"unknown tier {key.tier!r}; write one of {', '.join(doc.tiers)}",
                )
            )
        if not _HEX64.match(key.sha256):
            out.append(
                at.problem(
                    [*here, "sha256"],
                    "must be the 64-character lowercase hex SHA-256 of the secret key "
                    "(the secret itself is never stored); make one with `infergate keys new`",
                )
            )
        elif key.sha256 in seen_digests:
            out.append(
                at.problem([*here, "sha256"], f"same digest as keys[{seen_digests[key.sha256]}]")
            )
        seen_digests.setdefault(key.sha256, i)
        if key.rate_limits is not None:
            out.extend(_check_rates(key.rate_limits, [*here, "rate_limits"], at))
        if key.token_limits is not None:
            out.extend(_check_rates(key.token_limits, [*here, "token_limits"], at))
        out.extend(_check_budget(key.budget, [*here, "budget"], at))
        if not 0.01 <= key.weight <= 1000:  # (NaN fails too)
            out.append(
                at.problem([*here, "weight"], "must be between 0.01 and 1000, e.g. 1 (the default)")
            )
    return out


def _check_settings(doc: Document, at: Locator) -> list[Problem]:
    out: list[Problem] = []
    if not 1 / 24 <= doc.usage.retention_days <= 400:  # (NaN fails too)
        out.append(
            at.problem(
                ["usage", "retention_days"], "must be between 1/24 (an hour) and 400, e.g. 35"
            )
        )
    out.extend(check_batching(doc.batching, ["batching"], at))
    if not 0.05 <= doc.capacity.target_utilization <= 1.0:
        out.append(
            at.problem(["capacity", "target_utilization"], "must be between 0.05 and 1, e.g. 0.85")
        )
    if not 0.05 <= doc.autoscale.target_utilization <= 1.0:
        out.append(
            at.problem(["autoscale", "target_utilization"], "must be between 0.05 and 1, e.g. 0.7")
        )
    if not 0 <= doc.autoscale.scale_down_after_s <= 86_400:
        out.append(
            at.problem(["autoscale", "scale_down_after_s"], "must be 0-86400 seconds, e.g. 300")
        )
    if not 1 <= doc.jobs.result_ttl_s <= 7 * 86_400:
        out.append(at.problem(["jobs", "result_ttl_s"], "must be 1-604800 seconds, e.g. 600"))
    if not 1 <= doc.jobs.max_queued_per_key <= 1_000_000:
        out.append(at.problem(["jobs", "max_queued_per_key"], "must be 1-1000000, e.g. 1000"))
    if not 0 <= doc.jobs.headroom_workers <= 1_000:
        out.append(at.problem(["jobs", "headroom_workers"], "must be 0-1000, e.g. 1"))
    if doc.sharing.scope not in ("key", "tier", "shared"):
        out.append(at.problem(["sharing", "scope"], "must be key, tier or shared"))
    if not 0 <= doc.sharing.cache_ttl_s <= 86_400:
        out.append(
            at.problem(["sharing", "cache_ttl_s"], "must be 0-86400 seconds (0: off), e.g. 300")
        )
    if not 256 <= doc.limits.max_body_bytes <= MAX_BODY_BYTES:
        out.append(
            at.problem(["limits", "max_body_bytes"], f"must be 256-{MAX_BODY_BYTES}, e.g. 65536")
        )
    else:
        out.extend(_check_inputs_fit(doc, at))
    if not 0.01 <= doc.limits.key_connection_share <= 1.0:
        out.append(
            at.problem(["limits", "key_connection_share"], "must be between 0.01 and 1, e.g. 0.25")
        )
    if not 0.5 <= doc.limits.redis_memory_high_water <= 1.0:
        out.append(
            at.problem(
                ["limits", "redis_memory_high_water"],
                "must be between 0.5 and 1 (1: off), e.g. 0.8",
            )
        )
    out.extend(_check_direct(doc, at))
    out.extend(check_workers(doc.workers, ["workers"], at))
    return out


def _check_direct(doc: Document, at: Locator) -> list[Problem]:
    out = []
    for i, tier in enumerate(doc.direct.tiers):
        if tier not in doc.tiers:
            out.append(
                at.problem(
                    ["direct", "tiers", i],
                    f"unknown tier {tier!r}; write one of {', '.join(doc.tiers)}",
                )
            )
    if not 1 <= doc.direct.max_requests <= 10_000:
        out.append(at.problem(["direct", "max_requests"], "must be 1-10000, e.g. 64"))
    return out


def _check_inputs_fit(doc: Document, at: Locator) -> list[Problem]:
    """Every input a tier allows fits in a body the gateway takes: its
    longest input of four-byte characters, plus the JSON around it."""
    out = []
    for name, tier in doc.tiers.items():
        needed = body_bytes_for(tier.max_input_chars)
        if needed > doc.limits.max_body_bytes:
            out.append(
                at.problem(
                    ["limits", "max_body_bytes"],
                    f"tier {name!r} allows {tier.max_input_chars} characters, a body of up to "
                    f"{needed} bytes (4 bytes a character, {BODY_OVERHEAD_BYTES} for the rest): "
                    f"raise max_body_bytes to at least {needed} or lower its max_input_chars",
                )
            )
    return out


def body_bytes_for(max_input_chars: int) -> int:
    """The body a request of ``max_input_chars`` four-byte characters needs."""
    return 4 * max_input_chars + BODY_OVERHEAD_BYTES


# A limit's window at most (its counters expire 1.1 windows after their last charge).
MAX_WINDOW_S = 366 * 86_400
# A budget's most: GPU time (a thousand GPUs' year) and tokens.
MAX_BUDGET_GPU_S = 1000 * 366 * 86_400
MAX_BUDGET_TOKENS = 10**15


def _check_budget(budget: Budget | None, path: list[str | int], at: Locator) -> list[Problem]:
    if budget is None:
        return []
    out: list[Problem] = []
    if budget.gpu_seconds is None and budget.tokens is None:
        out.append(at.problem(path, "give gpu_seconds, tokens or both, e.g. {gpu_seconds: 36000}"))
    if budget.gpu_seconds is not None and not 0.001 <= budget.gpu_seconds <= MAX_BUDGET_GPU_S:
        out.append(
            at.problem([*path, "gpu_seconds"], f"must be 0.001 to {MAX_BUDGET_GPU_S}, e.g. 36000")
        )
    if budget.tokens is not None and not 1 <= budget.tokens <= MAX_BUDGET_TOKENS:
        out.append(at.problem([*path, "tokens"], f"must be 1 to {MAX_BUDGET_TOKENS}, e.g. 5000000"))
    return out


def _check_rates(
    rates: list[str], here: list[str | int], at: Locator, single: bool = False
) -> list[Problem]:
    out = []
    for j, rate in enumerate(rates):
        path = here if single else [*here, j]
        try:
            parsed = parse_many(rate)
        except ValueError:
            out.append(at.problem(path, f"{rate!r} is not a rate; {_RATE_HINT}"))
            continue
        if single and len(parsed) != 1:
            out.append(at.problem(path, f"{rate!r} must be one rate, e.g. '200000/minute'"))
        if any(item.get_expiry() > MAX_WINDOW_S for item in parsed):
            out.append(at.problem(path, f"{rate!r} has a window over a year; use one within it"))
        if any(item.amount < 1 for item in parsed):  # (its refusals would say: retry)
            why = "a limit is at least 1 a window (to stop a key, set its disabled: true)"
            out.append(at.problem(path, f"{rate!r} admits nothing: {why}"))
    return out


def digest(secret: str) -> str:
    """The digest a policy stores for a secret key (and the gateway computes
    for the key a client sends; undecodable header bytes stay as they came)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()
