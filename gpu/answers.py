"""What a worker sends back for a batch: one reply per gateway (a result per
request, its output or its error), the answers the result cache keeps, and
the long inputs let go with it. Built once the backend has run the batch,
off the way of the next one (``Finished``); every request of a batch gets
an answer, whatever happened to it (``failure``, ``lost``)."""

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from infergate.base import clock, logs, wire
from infergate.base.keys import Keys
from infergate.base.metrics import WorkerMetrics
from infergate.base.queue import inputs
from infergate.base.queue.replies import failure_replies, group_by_gateway
from infergate.base.queue.usage import Charge, weighted_shares
from infergate.base.queue.worker import KeptAnswer
from infergate.gpu.backend import Backend, BackendError, Counted, UpstreamError
from infergate.gpu.backend_thread import slot_key
from infergate.gpu.token_weight import TokenWeights

log = logs.get(__name__)

# The longest a policy lets the cache keep an answer (sharing.cache_ttl_s,
# a day). An envelope asking for more was planted: its answer is sent, not
# kept (Redis refuses a TTL past its range, and the whole answer with it).
MAX_CACHE_TTL_MS = 86_400_000

# A count a remote server says past this is none a model made: held to it,
# the split and the fit's sums stay finite.
MOST_COUNTED = 2**32


@dataclass
class Answer:
    """What a batch run sends back: one reply per gateway, and the answers
    to keep for the result cache (stored with the reply)."""

    replies: dict[str, wire.Reply] = field(default_factory=dict)
    keep: list[KeptAnswer] = field(default_factory=list)
    # The long inputs kept beside the batch's envelopes, deleted with the answer.
    inputs_done: list[str] = field(default_factory=list)
    # What each key's requests in it cost (usage per key, stored with the answer).
    usage: list[Charge] = field(default_factory=list)
    # The batch's metrics and log line, once the answer is out (or given up
    # on): off the way of the replies (a log line written just after an
    # idle spell takes about 0.2 ms on this project's 2-core test machine).
    report: Callable[[], None] = lambda: None


class Finished:
    """A batch the backend has run. Its answer is built once, when it is
    first sent: for all but a small batch, once the next batch has started."""

    def __init__(self, size: int, build: Callable[[], Answer]) -> None:
        self.size = size  # the requests it answers
        self._build = build
        self._answer: Answer | None = None

    def answer(self) -> Answer:
        if self._answer is None:
            self._answer = self._build()
        return self._answer


NOTHING_TO_ANSWER = Finished(0, Answer)


class Tally:
    """What the worker has served, for its heartbeat."""

    WINDOW_S = 5.0

    def __init__(self) -> None:
        self.batches_done = 0
        self.requests_done = 0
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic s, requests) per batch

    def batch_served(self, requests: int) -> None:
        self.batches_done += 1
        self.requests_done += requests
        self._recent.append((clock.monotonic_s(), requests))

    def delivered_rps(self) -> float:
        now = clock.monotonic_s()
        while self._recent and self._recent[0][0] < now - self.WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / self.WINDOW_S


class Answers:
    """Builds the answers of one worker's batches."""

    def __init__(
        self,
        worker_id: str,
        keys: Keys,
        backend: Backend,
        metrics: WorkerMetrics,
        tally: Tally,
    ) -> None:
        self.worker_id = worker_id
        self.keys = keys
        self.backend = backend  # its fingerprint names the model in what the cache keeps
        self.metrics = metrics
        self.tally = tally
        self.token_weights = TokenWeights()

    def _clipped(
        self, outcome: str | BackendError, max_tokens: int
    ) -> tuple[str, int] | BackendError:
        """An output cut to the request's ``max_tokens`` (the backend's
        tokens), and its length in them."""
        if isinstance(outcome, BackendError):
            return outcome
        if isinstance(outcome, Counted):  # (the engine stopped at max_tokens itself)
            text = str(outcome)
            if outcome.tokens > 0 or not text:
                return text, min(outcome.tokens, MOST_COUNTED)
            return text, self.backend.clip(text, 0)[1]  # (a server that did not count them)
        return self.backend.clip(outcome, max_tokens)

    def _input_tokens(self, env: wire.Envelope, outcome: str | BackendError) -> int:
        """The input's length in the backend's tokens (0 for an input that
        failed: it is not billed)."""
        if isinstance(outcome, BackendError):
            return 0
        if isinstance(outcome, Counted) and outcome.input_tokens > 0:
            return min(outcome.input_tokens, MOST_COUNTED)
        return self.backend.clip(env.input or "", 0)[1]  # (none counted them)

    def of(
        self,
        batch: wire.Batch,
        live: list[wire.Envelope],
        outcome_of: dict[Hashable, str | BackendError],
        started_ms: int,
        infer_us: int,
        idle_ms: float | None,
        lost: list[wire.Envelope],
    ) -> Answer:
        """The replies of a batch the backend has run in ``infer_us`` (and
        of the requests in it whose long input was gone), and the answers to
        keep."""
        answer = Answer()
        infer_ms = round(infer_us / 1000)
        size = len(live) + len(lost)
        results = self.lost_results(batch, lost, started_ms, size) if lost else []
        tokens: list[tuple[int, int]] = []
        outcomes = []
        for env in live:
            outcome = outcome_of[slot_key(env)]
            clipped = self._clipped(outcome, env.max_tokens)
            input_tokens = self._input_tokens(env, outcome)
            tokens.append((input_tokens, 0 if isinstance(clipped, BackendError) else clipped[1]))
            outcomes.append((clipped, input_tokens))
        # (each request's share of the call: by its tokens, a new one weighed
        # against an input one as the calls measured it, and its share of
        # the decoding steps, one more each)
        fit = self.token_weights
        shares = step_shares([o for _, o in tokens])
        weights = [
            wire.weighed(i, o, fit.per_token, share, fit.per_step)
            for (i, o), share in zip(tokens, shares, strict=True)
        ]
        gpu = weighted_shares(infer_ms * 1000, weights)
        call = _call_fields(tokens, weights, fit.alone)
        self._measure(live, outcome_of, tokens, infer_us)
        for env, (clipped, input_tokens), gpu_us in zip(live, outcomes, gpu, strict=True):
            # Reported as served by the model, whichever copy ran: the keys of a
            # batch must not learn from served_by that another sent the same input.
            result = _result(
                env,
                clipped,
                batch.id,
                size,
                self.worker_id,
                started_ms,
                infer_ms,
                input_tokens if env.count_input else 0,  # (where its envelope asks)
                gpu_us,
                call,
            )
            results.append((wire.destination(env), result))
            if (
                env.cache_key
                and 0 < env.cache_ttl_ms <= MAX_CACHE_TTL_MS
                and result.output is not None
            ):
                answer.keep.append(
                    KeptAnswer(
                        env.cache_key, self.backend.fingerprint, result.output, env.cache_ttl_ms
                    )
                )
        answer.replies = group_by_gateway(results)
        answer.usage = charges(live, gpu, tokens)
        # (the batch leaves processing with its answer: none of them runs again)
        answer.inputs_done = inputs.input_keys(self.keys, batch.envelopes)
        self.tally.batch_served(len(live))
        weighed_by = (fit.alone, fit.per_step)
        answer.report = partial(
            self._report, batch, live, outcome_of, infer_ms, idle_ms, weighed_by
        )
        return answer

    def _measure(
        self,
        live: list[wire.Envelope],
        outcome_of: dict[Hashable, str | BackendError],
        tokens: list[tuple[int, int]],
        infer_us: int,
    ) -> None:
        """What the call read and wrote, once per input the backend ran
        (identical ones collapse onto one), for the new token's weight; a
        call that failed wrote nothing to learn from. In µs: a few tokens'
        time is less than a millisecond's rounding (which drew the weight
        of calls of ten tokens to 17 where it is 10)."""
        ran: dict[Hashable, tuple[int, int]] = {}
        for env, counted in zip(live, tokens, strict=True):
            key = slot_key(env)
            if isinstance(outcome_of[key], BackendError):
                return
            ran.setdefault(key, counted)
        if ran and infer_us > 0:
            read, wrote = sum(i for i, _ in ran.values()), sum(o for _, o in ran.values())
            steps = max(o for _, o in ran.values())
            self.token_weights.took(read, wrote, infer_us, steps)

    def lost(self, batch: wire.Batch, lost: list[wire.Envelope], started_ms: int) -> Answer:
        """A batch whose every live request's input is gone (or with none
        live): each of those answered, and the batch's inputs let go."""
        return Answer(
            group_by_gateway(self.lost_results(batch, lost, started_ms, len(lost))),
            inputs_done=inputs.input_keys(self.keys, batch.envelopes),
        )

    def lost_results(
        self, batch: wire.Batch, lost: list[wire.Envelope], started_ms: int, size: int
    ) -> list[tuple[str, wire.Result]]:
        """SERVICE_OVERLOADED, to be retried, for each request whose long
        input was gone: not INFERENCE_FAILED, which says the input itself
        failed (and is passed to every request collapsed onto it)."""
        error = wire.ErrorInfo(
            "SERVICE_OVERLOADED", "the request's input was no longer in Redis; retry"
        )
        return [
            (
                wire.destination(env),
                wire.Result(
                    id=env.id,
                    batch_id=batch.id,
                    batch_size=size,
                    worker=self.worker_id,
                    queue_ms=max(0, started_ms - env.enqueued_ms),
                    infer_ms=0,
                    error=error,
                ),
            )
            for env in lost
        ]

    def failure(self, batch: wire.Batch) -> Answer:
        """Every request of a batch that failed outside the backend gets
        INFERENCE_FAILED (and the cache keeps nothing of it)."""
        replies = failure_replies(
            batch,
            "INFERENCE_FAILED",
            "the worker could not run this batch",
            self.worker_id,
            clock.now_ms(),
        )
        return Answer(replies, inputs_done=inputs.input_keys(self.keys, batch.envelopes))

    def _report(
        self,
        batch: wire.Batch,
        live: list[wire.Envelope],
        outcome_of: dict[Hashable, str | BackendError],
        infer_ms: int,
        idle_ms: float | None,
        weighed_by: tuple[float, float],
    ) -> None:
        """A batch's metrics and log line (with the weights it was split by:
        a new token's written alone, as its results say, and a step's)."""
        failed = sum(isinstance(outcome_of[slot_key(e)], BackendError) for e in live)
        self.metrics.backend_inputs.inc(len(outcome_of))
        self.metrics.requests_collapsed.inc(len(live) - len(outcome_of))
        self.metrics.batch_size.observe(len(live))
        self.metrics.inference_failures.inc(failed)
        log.info(
            "batch.done",
            batch_id=batch.id,
            size=len(live),
            attempt=batch.attempt,
            infer_ms=infer_ms,
            idle_ms=idle_ms,
            failed=failed,
            new_token_weight=weighed_by[0],
            step_weight=weighed_by[1],
        )


def charges(
    live: list[wire.Envelope], gpu: list[int], tokens: list[tuple[int, int]]
) -> list[Charge]:
    """Each key's share of a call that ran ``live``: its requests, their input
    characters, their ``gpu`` shares of the call's time (``weighted_shares``),
    and their input and output ``tokens``."""
    per_key: dict[tuple[str, str], list[int]] = {}
    for env, gpu_us, (tokens_in, tokens_out) in zip(live, gpu, tokens, strict=True):
        chars = env.input_chars or len(env.input or "")
        counts = per_key.setdefault((env.key_id, env.tier), [0, 0, 0, 0, 0, 0])
        counts[0] += 1
        counts[1] += chars
        counts[2] += gpu_us
        counts[4] += tokens_in
        counts[5] += tokens_out
    return [Charge(key, tier, *counts) for (key, tier), counts in per_key.items()]


def step_shares(new_tokens: list[int]) -> list[float]:
    """Each request's share of its call's decoding steps: a step is shared
    by the requests still writing at it (a request alone takes all of its
    own: as many as its new tokens)."""
    order = sorted(range(len(new_tokens)), key=new_tokens.__getitem__)
    shares, taken, done = [0.0] * len(new_tokens), 0.0, 0
    for place, i in enumerate(order):
        # (the steps after the last shorter answer, shared by it and the longer)
        taken += (new_tokens[i] - done) / (len(order) - place)
        done = new_tokens[i]
        shares[i] = taken
    return shares


def _call_fields(
    tokens: list[tuple[int, int]], weights: list[int], weight: float
) -> dict[str, Any]:
    """What every result of a call says of it: its tokens, plain and (where
    a new token weighs more than one) weighed, and the weight."""
    fields: dict[str, Any] = {"call_tokens": sum(1 + i + o for i, o in tokens)}
    if weight != 1.0:
        fields.update(weighed_call_tokens=sum(weights), new_token_weight=weight)
    return fields


def _result(
    env: wire.Envelope,
    outcome: tuple[str, int] | BackendError,
    batch_id: str,
    batch_size: int,
    worker_id: str,
    started_ms: int,
    infer_ms: int,
    input_tokens: int,
    gpu_us: int,
    call: dict[str, Any],
) -> wire.Result:
    common: dict[str, Any] = dict(
        id=env.id,
        batch_id=batch_id,
        batch_size=batch_size,
        worker=worker_id,
        queue_ms=max(0, started_ms - env.enqueued_ms),
        infer_ms=infer_ms,
        gpu_us=gpu_us,
        **call,
    )
    if isinstance(outcome, BackendError):
        # (an upstream that did not answer: no input is at fault, retry)
        code = "SERVICE_OVERLOADED" if isinstance(outcome, UpstreamError) else "INFERENCE_FAILED"
        error = wire.ErrorInfo(code, str(outcome)[:500] or "the backend failed")
        return wire.Result(**common, error=error)
    output, tokens = outcome
    return wire.Result(**common, output=output, tokens=tokens, input_tokens=input_tokens)
