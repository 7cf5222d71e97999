"""What the policy's ``models`` section must mean: each model's name, who may
use it, how its workers run it, and its own batching and worker settings
(checked as the policy's own are)."""

from infergate.base.keys import check_model_name
from infergate.policies.backends import check_options, parse_spec
from infergate.policies.errors import Problem
from infergate.policies.locator import Locator
from infergate.policies.schema import Batching, Document, Model, Workers

MAX_CONCURRENCY = 64
# Backends that run one batch at a time in the worker (the contract's GPU):
# their workers take no concurrency.
ONE_CALL_AT_A_TIME = ("simulated", "transformers")
MAX_NEW_TOKENS = 4_096
MAX_MODELS = 64


def check_batching(batching: Batching, here: list[str | int], at: Locator) -> list[Problem]:
    if not 1 <= batching.max_batch_size <= 100:
        return [
            at.problem([*here, "max_batch_size"], "must be 1-100 (the backend contract's limit)")
        ]
    return []


def check_workers(workers: Workers, here: list[str | int], at: Locator) -> list[Problem]:
    out = []
    if not 1 <= workers.concurrency <= MAX_CONCURRENCY:
        out.append(at.problem([*here, "concurrency"], f"must be 1-{MAX_CONCURRENCY}, e.g. 1"))
    if workers.hang_timeout_ms < 100:
        out.append(at.problem([*here, "hang_timeout_ms"], "must be at least 100, e.g. 2000"))
    if workers.max_attempts < 1:
        out.append(at.problem([*here, "max_attempts"], "must be at least 1, e.g. 2"))
    return out


def check_models(doc: Document, at: Locator) -> list[Problem]:
    out: list[Problem] = []
    if len(doc.models) > MAX_MODELS:
        out.append(
            at.problem(
                ["models"],
                f"at most {MAX_MODELS} models (each is a fleet view and a heartbeat at every "
                f"gateway); this lists {len(doc.models)}",
            )
        )
    for name, model in doc.models.items():
        here: list[str | int] = ["models", name]
        try:
            check_model_name(name)
        except ValueError as exc:
            out.append(at.problem(here, str(exc)))
        out.extend(_check_model(doc, model, here, at))
    if doc.default_model is not None and doc.default_model not in doc.models:
        listed = ", ".join(doc.models) or "none: add a models section"
        out.append(
            at.problem(
                ["default_model"], f"{doc.default_model[:80]!r} is not a listed model ({listed})"
            )
        )
    return out


def _check_model(doc: Document, model: Model, here: list[str | int], at: Locator) -> list[Problem]:
    out = []
    for tier in model.tiers:
        if tier not in doc.tiers:
            out.append(
                at.problem(
                    [*here, "tiers"],
                    f"unknown tier {tier[:80]!r}; write one of {', '.join(doc.tiers)}",
                )
            )
    known = {k.id for k in doc.keys}
    for key_id in model.keys:
        if key_id not in known:
            out.append(at.problem([*here, "keys"], f"no key has the id {key_id[:80]!r}"))
    out.extend(_check_backend(model, here, at))
    if not 1 <= model.max_new_tokens <= MAX_NEW_TOKENS:
        out.append(at.problem([*here, "max_new_tokens"], f"must be 1-{MAX_NEW_TOKENS}, e.g. 16"))
    if not 0 <= model.sim_latency_ms <= 60_000:
        out.append(at.problem([*here, "sim_latency_ms"], "must be 0-60000, e.g. 100"))
    if model.batching is not None:
        out.extend(check_batching(model.batching, [*here, "batching"], at))
    if model.workers is not None:
        out.extend(check_workers(model.workers, [*here, "workers"], at))
        if model.workers.concurrency > 1 and model.backend in ONE_CALL_AT_A_TIME:
            out.append(
                at.problem(
                    [*here, "workers", "concurrency"],
                    f"the {model.backend} backend runs one batch at a time: leave it at 1",
                )
            )
    return out


def _check_backend(model: Model, here: list[str | int], at: Locator) -> list[Problem]:
    """The backend names a kind it can parse, with the options that kind takes."""
    try:
        spec = parse_spec(model.backend)
    except ValueError as exc:
        return [at.problem([*here, "backend"], str(exc))]
    if spec.kind == "transformers" and not model.path:
        return [at.problem([*here, "path"], "the transformers backend needs the model's folder")]
    options: list[str | int] = [*here, "options"]
    return [
        at.problem(options if name is None else [*options, name], message)
        for name, message in check_options(spec, model.options)
    ]
