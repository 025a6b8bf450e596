"""Model calls on the cluster: generations that outlive the host that asked for them.

A turn hosted by a TurnActor sends each model call to a ModelWorker and waits for its answer;
the worker runs the call as a task of its own, publishes its streamed text to the turn's live
stream, and keeps the answer (``actors.engine.models.generations``). When the host dies the
generation goes on. Its name is the request's digest and its worker is placed by that name, so
the resumed turn, asking for the same request, reaches the same generation: still streaming,
it waits for it (its watchers never stopped seeing its text); finished, it takes the stored
answer. Neither is asked for, nor paid, again. A worker that dies takes its generations with
it: the host asks again (Ray restarts the worker under its name) and counts the call repaid.
A call under which workers keep dying is judged as a poison turn's host deaths are
(``actors.turn.poison``): after two deaths it runs alone on the isolation worker, and two
deaths there park the turn (``suspended:poison``), so it cannot take down worker after worker
and every generation on them.

An operator's cancel and the watchdog's hard timeout end the generation where it runs
(``RemoteModel.end_call``); any other end of the host's wait (the host stopping, a successor
claiming the turn) leaves it running for the next incarnation. A generation whose asker died
is dropped once its turn is no longer in progress (cancelled, finished, purged) or after
``[models] keep_s``. A fenced incarnation cannot take an answer a newer one adopted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

from ray.exceptions import RayActorError

from actors.cluster.deployment import Deployment
from actors.cluster.info import ServiceInfo
from actors.cluster.refs import ModelWorkerRef, ask
from actors.engine.agents import load_agent
from actors.engine.gc_tuning import tune_gc
from actors.engine.models.context import ModelServices
from actors.engine.models.generations import (
    GenerationAnswer,
    GenerationAsk,
    GenerationTable,
    ModelFailure,
    TurnState,
    answer_of,
    failure_of,
    generation_id,
    pack_ask,
    reply_of,
    unpack_answer,
    unpack_ask,
)
from actors.turn.llm import LLMClient, LLMReply, LLMRequest, RemoteCalls
from actors.turn.poison import ISOLATE_AFTER, SAME_STEP_DEATHS
from bus.errors import (
    AwaitingAdmission,
    LLMError,
    PhaselineError,
    PoisonGeneration,
    RecordError,
    RetryableLLMError,
)
from bus.events import TextDelta
from store.codec import pack_model
from store.domain.effects import EffectCounters
from store.records import CheckpointRecord, TurnInput, TurnSpec
from store.redis.connection import connect
from store.redis.failures import translated
from store.redis.replies import text
from store.views.streams import BufferedPublisher, RedisBus

log = logging.getLogger(__name__)

#: How long a host waits for a dead model worker to be back (Ray restarts it in place).
RESTART_WAIT_S = 30.0

#: How often a call waiting for the isolation worker (it takes one at a time) asks again.
ISOLATION_POLL_S = 0.2

#: How long a worker holds a call the cluster's limiter holds back, waiting and asking the
#: limiter again itself, before it answers the asker that the call still waits (the asker
#: counts that time against its rate-limit cap and asks again, or gives up). Held here, the
#: call keeps its ticket, so its place in the limiter's line, and no round trip to the host
#: carries the transcript again for each wait.
HOLD_S = 30.0


class ModelWorker:
    """Runs model calls of many turns; one process, many generations at once."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": -1,  # restarted in place: hosts find it under its name again
        "max_task_retries": 0,  # a lost generation is asked again by its host, and counted
        "max_concurrency": 10_000,
    }

    def __init__(self, deployment_json: str, isolated: bool = False) -> None:
        """``isolated``: the isolation worker, which takes one generation at a time, so a
        death under it is the death of that call."""
        dep = Deployment.from_wire(deployment_json)
        tune_gc(dep.settings.host.gc_threshold)
        os.environ.update(dep.model_route.env)  # its process is its own
        self.dep = dep
        self._client = dep.connect(max_connections=64)
        effects = EffectCounters(
            connect(dep.effects_url, retry_s=dep.settings.redis.retry_s)
            if dep.effects_url
            else self._client,
            dep.keys,
        )
        self._services = ModelServices(self._client, dep.keys, effects)
        self._publisher = BufferedPublisher(
            RedisBus(self._client, dep.keys, live=dep.settings.events.live())
        )
        self._table = GenerationTable(keep_s=dep.settings.models.keep_s)
        self._isolated = isolated
        self._alone: str | None = None
        """On the isolation worker: the generation it runs (others are answered BUSY, so a
        death here is only ever the death of the one call it took)."""
        self._sweeper: asyncio.Task[None] | None = None

    async def generate(self, gen_id: str, agent: str, epoch: int, wire: bytes) -> bytes:
        """The answer (msgpack :class:`GenerationAnswer`) of generation ``gen_id``, started
        here unless it runs or ran here already (then joined: adopted by a newer ``epoch``,
        refused to an older one)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_forever())
        try:
            request = unpack_ask(wire)
        except RecordError as exc:
            return pack_model(GenerationAnswer(failure=ModelFailure.FATAL, error=str(exc)))
        if generation_id(wire) != gen_id:
            return pack_model(
                GenerationAnswer(failure=ModelFailure.FATAL, error="request and name differ")
            )
        if self._isolated:
            if self._alone not in (None, gen_id):
                return pack_model(GenerationAnswer(failure=ModelFailure.BUSY))
            self._alone = gen_id
        try:
            answer = await self._table.answer(
                gen_id, request.turn_id, epoch, partial(self._run, agent, request)
            )
        finally:
            if self._alone == gen_id:
                self._alone = None
        return pack_model(answer)

    async def _run(
        self, agent: str, request: GenerationAsk, owner: Callable[[], int]
    ) -> GenerationAnswer:
        """The call itself: its text published as it streams (under the epoch that owns the
        generation now), its answer or its typed failure."""
        streamed = False

        def on_text(piece: str) -> None:
            nonlocal streamed
            streamed = True
            at = int(time.time() * 1000)
            self._publisher.add(TextDelta(request.turn_id, owner(), piece, at))

        client: LLMClient | None = None
        try:
            client = load_agent(agent).client(
                self._services.context(request.turn_id, request.input, request.baseline)
            )
            reply = await self._admitted(client, request.request(on_text))
        except asyncio.CancelledError:  # ended here (a cancel, a sweep): at a provider too
            if isinstance(client, RemoteCalls):  # one that keeps its generations
                client.end_call()
            raise
        except LLMError as exc:
            answer = failure_of(exc)
        except Exception as exc:  # the agent's own model code failed: its run's error
            log.exception("generation of %s failed", request.turn_id)
            answer = GenerationAnswer(
                failure=ModelFailure.AGENT_CODE, error=f"{type(exc).__name__}: {exc}"
            )
        else:
            if not streamed and reply.message.text:  # a model that does not stream
                on_text(reply.message.text)
            answer = answer_of(reply)
        if isinstance(client, RemoteCalls) and (repaid := client.take_repaid()):
            answer = answer.model_copy(update={"repaid": repaid})  # its provider kept nothing
        await self._publisher.flush()  # the text before the answer (advisory: never raises)
        return answer

    async def _admitted(self, client: LLMClient, request: LLMRequest) -> LLMReply:
        """The client's reply, waiting here while the cluster's limiter holds the call back,
        up to :data:`HOLD_S` or the deployment's rate-limit cap (then
        :class:`AwaitingAdmission`, with the time held)."""
        cap = min(HOLD_S, self.dep.settings.loop.rate_limit_max_wait_s)
        held = 0.0
        while True:
            try:
                return await client.complete(request)
            except AwaitingAdmission as exc:
                wait = max(exc.retry_after_s or 0.0, 0.001)
                if held + wait > cap:
                    exc.held_s = held
                    raise
            await asyncio.sleep(wait)  # the limiter's own wait: nothing to wake it sooner
            held += wait

    async def cancel(self, gen_id: str, epoch: int) -> bool:
        """End a generation where it runs; False if it is not here or a newer incarnation
        owns it."""
        return self._table.cancel(gen_id, epoch)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.dep.settings.models.sweep_s)  # the sweep's period
            try:
                await self._sweep()
            except PhaselineError as exc:  # Redis away: the next sweep
                log.warning("model worker sweep: %s", exc)

    async def _sweep(self) -> None:
        """Drop the generations whose asker died and that no turn will take."""
        turns = self._table.turns_unattended()
        if not turns:
            return
        states: dict[str, TurnState] = {}
        with translated("read the turns of unattended generations"):
            async with self._client.pipeline(transaction=False) as pipe:
                for turn_id in turns:
                    pipe.hget(self.dep.keys.turn(turn_id), "in_progress")
                replies = await pipe.execute()
        for turn_id, in_progress in zip(turns, replies, strict=True):
            states[turn_id] = None if in_progress is None else text(in_progress) == "1"
        for gen_id in self._table.sweep(states):
            log.info("generation %s dropped: its turn will not take it", gen_id)

    async def hello(self) -> dict[str, Any]:
        t = self._table
        return ServiceInfo.here(
            {
                "generations": len(t),
                "started": t.started,
                "adopted": t.adopted,
                "dropped": t.dropped,
                "events_dropped": self._publisher.dropped,
            }
        )


class RayModels:
    """Where the model calls of a host's turns run: the deployment's model workers."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self._handles: dict[str, ModelWorkerRef] = {}

    def client(self, local: LLMClient, spec: TurnSpec, record: CheckpointRecord) -> LLMClient:
        """The model client of one incarnation of a turn: ``local``'s calls, run on a worker."""
        return RemoteModel(self, local, spec.agent, spec.input, record.baseline, record.epoch)

    def _pick(self, gen_id: str, isolated: bool) -> ModelWorkerRef | None:
        if isolated:
            name = self.dep.model_isolation_name()
        else:
            name = self.dep.model_worker_name(
                zlib.crc32(gen_id.encode()) % self.dep.settings.models.workers
            )
        cached = self._handles.get(name)
        if cached is not None:
            return cached
        worker = ModelWorkerRef.named(name)
        if worker is not None:
            self._handles[name] = worker
        return worker

    async def worker(
        self, gen_id: str, *, isolated: bool, after_death: bool
    ) -> ModelWorkerRef | None:
        """The worker of generation ``gen_id`` (placed by its name, or the isolation worker);
        after a death, once it answers again (Ray restarts it in place, so its handle stays
        good: no lookup by name, which blocks the event loop on Ray's GCS while the actor
        restarts), None if it does not within :data:`RESTART_WAIT_S`."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:
            worker = self._pick(gen_id, isolated)
            if worker is not None:
                if not after_death:
                    return worker
                try:
                    await worker.hello(5.0)
                    return worker
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
                worker = await self.models.worker(gen_id, isolated=isolated, after_death=deaths > 0)
                if worker is None:
                    raise RetryableLLMError("no model worker is up")
                ref = worker.generate(gen_id, self.agent, self.epoch, wire)
                self._current = (worker, gen_id)
                try:
                    raw = await ask(ref, None)
                except RayActorError as exc:
                    deaths += 1
                    log.warning(
                        "model worker died during %s's call (%d): %s",
                        request.turn_id,
                        deaths,
                        exc,
                    )
                    if deaths - ISOLATE_AFTER >= SAME_STEP_DEATHS:
                        raise PoisonGeneration(
                            f"this model call killed its worker {ISOLATE_AFTER} times, then "
                            f"the isolation worker {SAME_STEP_DEATHS} times running it alone",
                            deaths,
                        ) from exc
                    continue
                self._current = None
                if not isinstance(raw, bytes):
                    raise RetryableLLMError(f"a model worker answered {raw!r:.80}")
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
