"""Model calls on the cluster, the host's side: a turn's model client whose calls run on model
workers (``actors.cluster.model_workers`` says why, and what the worker does).

:class:`RemoteModel` is the client a Ray-hosted turn's loop calls: it names the generation by
its request, picks its worker by that name (or the isolation worker), and applies the
poison-turn policy to the workers that die under it. :class:`ModelLine` carries a host's calls
to one worker: the calls asked within one turn of the host's event loop leave in one
:meth:`~actors.cluster.model_workers.ModelWorker.submit`, and one
:meth:`~actors.cluster.model_workers.ModelWorker.collect` at a time, held open at the worker
while nothing is ready, brings back every answer that is. A worker's death fails that collect,
and a restarted worker answers with a new incarnation: either way every call it took is lost
(:class:`WorkerLost`), asked again by its turn and counted repaid.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
import zlib
from collections.abc import Sequence

from ray.exceptions import RayActorError

from actors.cluster.deployment import Deployment
from actors.cluster.model_workers import ModelWorker
from actors.cluster.refs import ModelWorkerRef, ask, spawn
from actors.engine.models.generations import (
    Ask,
    GenerationAsk,
    ModelFailure,
    generation_id,
    pack_ask,
    reply_of,
    unpack_answer,
)
from actors.turn.llm import LLMClient, LLMReply, LLMRequest
from actors.turn.poison import ISOLATE_AFTER, SAME_STEP_DEATHS
from bus.errors import PoisonGeneration, RetryableLLMError
from store.records import CheckpointRecord, TurnInput, TurnSpec

__all__ = ["ModelLine", "RayModels", "RemoteModel", "WorkerLost"]

log = logging.getLogger(__name__)

#: How long a host waits for a dead model worker to be back (Ray restarts it in place).
RESTART_WAIT_S = 30.0

#: How often a call waiting for the isolation worker (it takes one at a time) asks again.
ISOLATION_POLL_S = 0.2

#: How long a collect waits at the worker for a first answer before it comes back empty (and
#: is sent again while calls wait): a bound on how long a host holds a call at a worker, not
#: a latency (an answer comes back as soon as it is ready).
COLLECT_WAIT_S = 10.0

_TOKENS = itertools.count(1)
"""A host's names for its calls (unique in the process: a turn may ask for one generation in
two incarnations on one host, and each waits for its own answer)."""


class WorkerLost(Exception):
    """The worker died with the call, or was restarted and never heard of it."""


class ModelLine:
    """One host's calls at one model worker: sent together, answered together."""

    def __init__(self, worker: ModelWorkerRef, listener: str) -> None:
        self.worker = worker
        self.listener = listener
        """The host's name at the worker (its outbox there)."""
        self._outgoing: list[Ask] = []
        self._waiting: dict[int, asyncio.Future[bytes]] = {}
        self._taken_by: dict[int, str] = {}
        """Token -> the worker incarnation that took the call."""
        self._collecting: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()

    async def ask(self, gen_id: str, agent: str, epoch: int, wire: bytes) -> bytes:
        """The answer's bytes of generation ``gen_id`` for incarnation ``epoch``;
        :class:`WorkerLost` if the worker dies with it."""
        loop = asyncio.get_running_loop()
        token = next(_TOKENS)
        answer: asyncio.Future[bytes] = loop.create_future()
        self._waiting[token] = answer
        if not self._outgoing:
            loop.call_soon(self._send)  # after this turn of the loop: its calls go together
        self._outgoing.append((token, gen_id, agent, epoch, wire))
        try:
            return await answer
        finally:
            self._waiting.pop(token, None)
            self._taken_by.pop(token, None)

    def _send(self) -> None:
        batch, self._outgoing = self._outgoing, []
        sent = asyncio.create_task(self._sent(batch))
        self._sends.add(sent)
        sent.add_done_callback(self._sends.discard)

    async def _sent(self, batch: list[Ask]) -> None:
        tokens = [token for token, *_ in batch]
        try:
            incarnation = str(await ask(self.worker.submit(self.listener, batch), None))
        except RayActorError as exc:
            self._lose(tokens, f"its model worker died: {exc}")
            return
        except Exception as exc:  # refused there (a worker of another build): no death
            self._fail(tokens, RetryableLLMError(f"a model worker refused the calls: {exc}"))
            return
        for token in tokens:
            if token in self._waiting:
                self._taken_by[token] = incarnation
        if self._collecting is None or self._collecting.done():
            self._collecting = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        """Bring answers back while calls the worker took wait; a worker's death fails
        them (the calls still on their way learn their fate from their submit)."""
        while self._taken_by or self._sends:
            try:
                incarnation, answers = await self.worker.collect(self.listener, COLLECT_WAIT_S)
            except RayActorError as exc:
                self._lose(list(self._taken_by), f"its model worker died: {exc}")
                return
            except Exception as exc:  # an answer that is not one: the calls fail, not hang
                error = RetryableLLMError(f"a model worker's collect failed: {exc}")
                self._fail(list(self._taken_by), error)
                return
            for token, raw in answers:
                answer = self._waiting.get(token)
                if answer is not None and not answer.done():
                    answer.set_result(raw)
            lost = [t for t, taker in self._taken_by.items() if taker != incarnation]
            self._lose(lost, "its model worker was restarted")

    def _lose(self, tokens: Sequence[int], why: str) -> None:
        self._fail(tokens, WorkerLost(why))

    def _fail(self, tokens: Sequence[int], error: Exception) -> None:
        for token in tokens:
            self._taken_by.pop(token, None)
            answer = self._waiting.get(token)
            if answer is not None and not answer.done():
                answer.set_exception(error)


class RayModels:
    """Where the model calls of a host's turns run: the deployment's model workers."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.listener = uuid.uuid4().hex
        """This host's name at the workers."""
        self._lines: dict[str, ModelLine] = {}

    def client(self, local: LLMClient, spec: TurnSpec, record: CheckpointRecord) -> LLMClient:
        """The model client of one incarnation of a turn: ``local``'s calls, run on a worker."""
        return RemoteModel(self, local, spec.agent, spec.input, record.baseline, record.epoch)

    def _pick(self, gen_id: str, isolated: bool) -> ModelLine | None:
        if isolated:
            name = self.dep.model_isolation_name()
        else:
            name = self.dep.model_worker_name(
                zlib.crc32(gen_id.encode()) % self.dep.settings.models.workers
            )
        line = self._lines.get(name)
        if line is not None:
            return line
        worker = ModelWorkerRef.named(name)
        if worker is None and isolated:  # started on first need (get_if_exists: only once)
            worker = ModelWorkerRef(spawn(ModelWorker, name, self.dep.to_wire(), True))
        if worker is None:
            return None
        line = self._lines[name] = ModelLine(worker, self.listener)
        return line

    async def line(self, gen_id: str, *, isolated: bool, after_death: bool) -> ModelLine | None:
        """The line to the worker of generation ``gen_id`` (placed by its name, or the
        isolation worker); after a death, once the worker answers again (Ray restarts it in
        place, so its handle stays good: no lookup by name, which blocks the event loop on
        Ray's GCS while the actor restarts), None if it does not within
        :data:`RESTART_WAIT_S`."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:
            line = self._pick(gen_id, isolated)
            if line is not None:
                if not after_death:
                    return line
                try:
                    await line.worker.hello(5.0)
                    return line
                except (RayActorError, TimeoutError):
                    pass
            await asyncio.sleep(0.2)  # backoff while Ray restarts it
        return None


class RemoteModel:
    """An :class:`~actors.turn.llm.LLMClient` whose calls run on model workers."""

    def __init__(
        self,
        models: RayModels,
        local: LLMClient,
        agent: str,
        turn_input: TurnInput,
        baseline: int,
        epoch: int,
    ) -> None:
        self.models = models
        self.agent = agent
        self.turn_input = turn_input
        self.baseline = baseline
        self.epoch = epoch
        self.system = str(getattr(local, "system", "unknown"))
        self.model = str(getattr(local, "model", "unknown"))
        self._current: tuple[ModelWorkerRef, str] | None = None
        """The worker and name of the call in flight."""
        self._repaid = 0
        """Generations lost with their worker since the loop last took the count."""

    def take_repaid(self) -> int:
        repaid, self._repaid = self._repaid, 0
        return repaid

    def end_call(self) -> None:
        """End the call in flight where it runs: the turn was cancelled, or its watchdog's
        hard timeout fired. Anything else that cancels the wait (the host stopping, a
        successor's claim) leaves the generation running, for the next incarnation."""
        if self._current is not None:
            worker, gen_id = self._current
            worker.cancel(gen_id, self.epoch)

    async def complete(self, request: LLMRequest) -> LLMReply:
        wire = pack_ask(GenerationAsk.of(request, self.turn_input, self.baseline))
        gen_id = generation_id(wire)
        deaths = 0
        followed = False
        try:
            while True:
                # the poison-turn policy, for model calls: a worker runs many generations, so
                # a death under this call is no evidence against it; after ISOLATE_AFTER the
                # call runs alone on the isolation worker, where a death is its own, and after
                # SAME_STEP_DEATHS there the turn is parked (PoisonGeneration)
                isolated = deaths >= ISOLATE_AFTER
                line = await self.models.line(gen_id, isolated=isolated, after_death=deaths > 0)
                if line is None:
                    raise RetryableLLMError("no model worker is up")
                self._current = (line.worker, gen_id)
                try:
                    raw = await line.ask(gen_id, self.agent, self.epoch, wire)
                except WorkerLost as exc:
                    deaths += 1
                    log.warning("model call of %s lost (%d): %s", request.turn_id, deaths, exc)
                    if deaths - ISOLATE_AFTER >= SAME_STEP_DEATHS:
                        raise PoisonGeneration(
                            f"this model call killed its worker {ISOLATE_AFTER} times, then "
                            f"the isolation worker {SAME_STEP_DEATHS} times running it alone",
                            deaths,
                        ) from exc
                    continue
                self._current = None
                answer = unpack_answer(raw)
                if answer.failure is ModelFailure.BUSY:  # the isolation worker runs another
                    await asyncio.sleep(ISOLATION_POLL_S)  # its turn comes when that one ends
                    continue
                followed = answer.adopted
                self._repaid += answer.repaid
                return reply_of(answer)
        finally:
            # each generation lost with a worker was paid for again, whatever came of the
            # call, unless the endpoint kept it and the restarted worker followed it
            # (OpenAIResponses: the answer is adopted)
            if not followed:
                self._repaid += deaths
