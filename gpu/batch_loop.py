"""A worker's loop: the next batch, run, then the one after it formed and
the last one answered, for as long as the worker lives.

Its state is three fields, each with one meaning: ``following`` (the next
batch, formed when the last one ran), ``running`` (the call the backend thread
started on it) and ``unsure`` (a pull failed: its batch may be in processing
anyway). Each turn is two steps: ``_next_batch`` (the one following, or
the one in hand, or a pull; with none, the credit kept offered) and
``_run`` (the batch run, then the next one taken, by the backend thread as the call
returned or here, with the answer published in the same step or after).
"""

import asyncio
from collections.abc import Callable, Mapping

from infergate.base import clock, logs, wire
from infergate.base.errors import UNAVAILABLE, out_of_memory
from infergate.base.loops import Backoff, Step, retry_until_done
from infergate.base.queue.forming import TakeResult, log_drops, new_batch_id
from infergate.base.queue.worker import WorkerQueue
from infergate.gpu.answers import Answer, Finished
from infergate.gpu.backend_thread import BackendThread, Running, Stepped
from infergate.gpu.gate import GatedBackend
from infergate.gpu.runner import ANSWERED_WITH_TAKE_MAX, BatchRunner, ExitHung
from infergate.gpu.upstream import UpstreamWatch

log = logs.get(__name__)

# A take in the backend's thread that has not answered by the hang timeout
# plus this long is stuck (its client times out after 1 s a try).
THREAD_TAKE_BOUND_S = 5.0


class BatchLoop:
    """Pulls, runs and answers one worker's batches."""

    def __init__(
        self,
        runner: BatchRunner,
        pull_timeout_s: float,
        exit_hung: ExitHung,
        grace_left: Callable[[], float],
        watch: UpstreamWatch,
        gated: GatedBackend | None = None,
    ) -> None:
        self.runner = runner
        self.watch = watch  # (the backend's server, for a remote backend)
        self.gated = gated  # (the backend is shared with other shards' loops: gate.py)
        self.thread: BackendThread = runner.thread
        self.queue: WorkerQueue = runner.queue
        self.worker_id = runner.worker_id
        self.pull_timeout_s = pull_timeout_s
        self._exit_hung = exit_hung
        self._grace_left = grace_left
        self.busy = False
        self.following: bytes | None = None
        self.running: Running | None = None
        self.unsure = False
        # The last batch's answer, going out while the next batch runs.
        self.answering: asyncio.Task[None] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(base_s=0.1, cap_s=2.0)
        try:
            while self.following is not None or not stop.is_set():
                try:
                    batch = await self._next_batch(stop)
                except UNAVAILABLE as exc:
                    log.warning("worker.redis_unavailable", error=type(exc).__name__)
                    await backoff.sleep()
                    continue
                except Exception as exc:
                    if out_of_memory(exc):  # (BLMOVE is refused too, even from an empty list)
                        logs.limited(log, "worker.redis_full", level="warning")
                    else:
                        log.exception("worker.pull_failed")
                    await backoff.sleep()
                    continue
                if batch is None:
                    continue
                backoff.reset()
                await self._run(*batch, stop)
        finally:
            self.thread.stop_taking()  # nothing takes a batch this loop will not run
            await self.answer_settled()

    async def _next_batch(self, stop: asyncio.Event) -> tuple[bytes, Running | None] | None:
        """The batch to run next, with the call the backend thread started on it if it
        did; None when there is none now (the credit is then kept offered)."""
        data, self.following = self.following, None
        thread_call, self.running = self.running, None
        if data is not None:
            self.unsure = False
            return data, thread_call
        # Idle: the last answer is out (its batch off processing) before
        # anything else is read from there.
        await self.answer_settled()
        if stop.is_set():
            return None
        if self.unsure:
            data = await self.queue.batch_in_hand()
        self.unsure = False
        if data is None:
            if not await self.watch.ready_to_take(stop):
                return None
            self.unsure = True
            data = await self.queue.pull_batch(self.pull_timeout_s)
            self.unsure = False
        if data is None:
            await self._keep_credit_offered()
            return None
        return data, None

    async def _run(self, data: bytes, thread_call: Running | None, stop: asyncio.Event) -> None:
        """Run the batch, then take the next one: the backend thread took it as the
        call returned, or it is taken here, with this batch's answer in the
        same step when that answer is small."""
        self.busy = True
        finished = await self.runner.handle(data, thread_call)
        stepped = await self._thread_step()
        # At most two batches in processing: the last answer went out
        # while this batch ran (as a rule, long before it returned).
        await self.answer_settled()
        if stepped is not None and stepped.taken is not None:
            # The backend thread took the next batch as the call returned (and
            # started it, unless it needs this loop).
            self.following, self.running = self._took(stepped.taken), stepped.running
            self._answer_later(finished, stop, data)
            if stepped.taken.credit_lost:
                await self._restore_credit(stop)
        elif self.watch.down and stepped is None:
            # Its server went down during the call: this batch is answered,
            # nothing more is taken (the next turn waits for the server).
            # (A take the backend thread could not finish is repeated below.)
            self._answer_later(finished, stop, data)
            self.following = None
        else:
            answer = finished.answer() if finished.size <= ANSWERED_WITH_TAKE_MAX else None
            step = stepped.step if stepped else None  # the backend thread's, which failed
            answered, self.following = await self.take_next(data, stop, answer, step)
            if not answered:
                # Not answered (stopping, Redis away past the grace): this
                # batch, and the next one if the take formed it, stay for
                # the reaper.
                self._answer_later(finished, stop, data)
        self.busy = self.following is not None
        if self.gated is not None and self.following is None:
            self.gated.pass_turn()  # (nothing taken: the next call is not waited for)

    async def _thread_step(self) -> Stepped | None:
        """What the backend thread's take after this batch's call did, if it ran one.
        (The replies are built after it: built meanwhile, they hold the GIL
        the backend thread needs to start the next call.)"""
        stepping, self.runner.stepping = self.runner.stepping, None
        if stepping is None:
            return None
        # Its client's timeouts bound it; past this bound (a resolver or a
        # Sentinel that hangs) it could still start a batch: the worker
        # leaves, as for a hung call.
        bound_s = self.runner.hang_timeout_ms / 1000.0 + THREAD_TAKE_BOUND_S
        try:
            stepped = await asyncio.wait_for(asyncio.wrap_future(stepping), bound_s)
        except TimeoutError:
            await self._exit_hung("backend_thread.take_hung", bound_s=bound_s)
        if stepped.taken is None:
            log.warning("backend_thread.take_failed", error=stepped.error, step=stepped.step)
        return stepped

    async def _restore_credit(self, stop: asyncio.Event) -> None:
        await retry_until_done(
            "worker.credit", self._keep_credit_offered, stop, grace_after_stop_s=self._grace_left
        )

    def _answer_later(self, finished: Finished, stop: asyncio.Event, data: bytes) -> None:
        """Answer ``data`` in the background (while the next batch runs);
        the backend thread takes again once that answer is out."""
        self.thread.answered.clear()
        self.answering = asyncio.create_task(self.answer(finished, stop, data))

    async def answer_settled(self) -> None:
        """Wait for the last batch's answer to be out (or given up on)."""
        task, self.answering = self.answering, None
        if task is None:
            return
        try:
            await task
        except Exception:  # a bug: its batch stays in processing, found by the next take
            log.exception("batch.answer_failed", worker_id=self.worker_id)

    async def _keep_credit_offered(self) -> None:
        """Idle: make sure the credit is still out (a restarted Redis lost it)."""
        if await self.queue.ensure_credit():
            log.warning("worker.credit_restored", worker_id=self.worker_id)

    async def take_next(
        self, ran: bytes, stop: asyncio.Event, answer: Answer | None = None, step: str | None = None
    ) -> tuple[bool, bytes | None]:
        """The backend is free: the next batch, formed straight into
        processing (or the credit offered when there is none to take), with
        ``answer`` published and ``ran`` acked in the same step if given.
        Retried for as long as the worker lives; not started once stopping,
        and a step under way when stop comes is retried for the publish
        grace (a lost reply's batch is learned, and run). Returns whether
        ``ran`` was answered, and the next batch. ``step``: the token of a
        step the backend thread tried and could not finish (it may have run: it is
        repeated, once stopping too, as a step under way)."""
        if stop.is_set() and step is None:
            return False, None
        following: bytes | None = None
        # The same for every attempt: a repeat is known.
        step = step or new_batch_id()
        replies, keep, inputs_done, usage = (
            (answer.replies, answer.keep, answer.inputs_done, answer.usage)
            if answer
            else (None, (), (), ())
        )

        async def take() -> None:
            nonlocal following
            taken = await self.queue.take_next(
                ran, step, clock.now_ms(), replies, keep, inputs_done, usage
            )
            if taken.credit_lost:
                await self._keep_credit_offered()
            following = self._took(taken)

        try:
            done = await retry_until_done(
                "batch.take",
                self._replies_first_when_full(take, replies),
                stop,
                grace_after_stop_s=self._grace_left,
            )
        except BaseException:  # (cancelled: the worker exits) its log line all the same
            if answer is not None:
                answer.report()
            raise
        if done and answer is not None:
            self.thread.answered.set()
            answer.report()
        return done and answer is not None, following

    def _took(self, taken: TakeResult) -> bytes | None:
        """Count what a take did (here or in the backend thread); returns the next
        batch. (A take that reports the credit lost found the batch gone:
        the reaper took it, or Redis lost it; no credit went out in it, and
        the caller makes sure one is out.)"""
        self.runner.metrics.forming.count(taken)
        log_drops(taken)
        return taken.batch

    async def answer(self, finished: Finished, stop: asyncio.Event, batch: bytes) -> None:
        """Build the replies and publish them, and ack: retried for as long
        as the worker lives (the work is done); once stopping, for
        ``publish_grace_s``, after which the batch stays in processing and
        the reaper runs it again."""
        answer = finished.answer()
        # Decided once, so every attempt is the same step: a worker stopping
        # takes its credit back with the ack.
        leaving = stop.is_set()

        async def publish() -> None:
            await self.queue.answer_batch(
                answer.replies,
                clock.now_ms(),
                batch,
                answer.keep,
                leaving=leaving,
                inputs_done=answer.inputs_done,
                usage=answer.usage,
            )

        try:
            if await retry_until_done(
                "batch.publish",
                self._replies_first_when_full(publish, answer.replies),
                stop,
                grace_after_stop_s=self._grace_left,
            ):
                self.thread.answered.set()
            else:
                log.error("batch.left_for_the_reaper", worker_id=self.worker_id)
        finally:
            answer.report()

    def _replies_first_when_full(
        self, step: Step, replies: Mapping[str, wire.Reply] | None
    ) -> Step:
        """``step``, an answer's transaction, retried by the caller. When
        Redis refuses it for want of memory, the replies to gateways go out
        on their own first (PUBLISH needs no memory), once: their clients
        are answered now, not after their deadline. The transaction is
        retried as before (its duplicate replies are ignored) and stores
        the jobs' results and acks the batch once Redis has room."""
        published = False

        async def step_or_reply() -> None:
            nonlocal published
            try:
                await step()
            except Exception as exc:
                if published or not replies or not out_of_memory(exc):
                    raise
                self.queue.store.saw_full()
                await self.queue.publish_replies(replies)
                published = True
                log.warning("batch.replied_while_redis_full", worker_id=self.worker_id)
                raise

        return step_or_reply
