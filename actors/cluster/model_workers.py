"""Model calls on the cluster, the worker's side: generations that outlive the host that asked.

A turn hosted by a TurnActor sends each model call to a ModelWorker and waits for its answer
(the host's side: ``actors.cluster.model_lines``); the worker runs the call as a task of its
own, publishes its streamed text to the turn's live stream, and keeps the answer
(``actors.engine.models.generations``). When the host dies the generation goes on. Its name is
the request's digest and its worker is placed by that name, so the resumed turn, asking for the
same request, reaches the same generation: still streaming, it waits for it (its watchers never
stopped seeing its text); finished, it takes the stored answer. Neither is asked for, nor paid,
again.

A host's calls travel in batches: :meth:`ModelWorker.submit` starts many at once, and the
answers wait in the host's outbox here until its next :meth:`ModelWorker.collect` (one call
held open while nothing is ready) takes all that are ready: a Ray call costs each side about
as much CPU as a fast model call's whole work (figures and their command: docs/BENCHMARKS.md).
Each answer's text is published before the answer leaves (one flush per collect, not per
call).

A worker that dies takes its generations and its outboxes with it; Ray restarts it under its
name with a new :attr:`ModelWorker.incarnation`, which tells a host that the calls the old one
took will never be answered. Calls under which workers keep dying are judged as a poison
turn's host deaths are (``actors.turn.poison``): after two deaths a call runs alone on the
isolation worker, and two deaths there park its turn (``suspended:poison``).

An operator's cancel and the watchdog's hard timeout end the generation where it runs
(``RemoteModel.end_call``); any other end of the host's wait (the host stopping, a successor
claiming the turn) leaves it running for the next incarnation. A generation whose asker died
is dropped once its turn is no longer in progress (cancelled, finished, purged) or after
``[models] keep_s``. A fenced incarnation cannot take an answer a newer one adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

from actors.cluster.deployment import Deployment
from actors.cluster.info import ServiceInfo
from actors.engine.agents import load_agent
from actors.engine.gc_tuning import tune_gc
from actors.engine.models.context import ModelServices
from actors.engine.models.generations import (
    Answered,
    Ask,
    GenerationAnswer,
    GenerationAsk,
    GenerationTable,
    ModelFailure,
    TurnState,
    answer_of,
    failure_of,
    generation_id,
    unpack_ask,
)
from actors.turn.llm import LLMClient, LLMReply, LLMRequest, RemoteCalls
from bus.errors import AwaitingAdmission, LLMError, PhaselineError, RecordError
from bus.events import TextDelta
from store.codec import pack_model
from store.domain.effects import EffectCounters
from store.redis.connection import connect
from store.redis.failures import translated
from store.redis.replies import text
from store.views.streams import BufferedPublisher, RedisBus

__all__ = ["ModelWorker"]

log = logging.getLogger(__name__)

#: How long an outbox nobody collects is kept: its host died (the answers stay in the
#: generation table, for the resumed turns to adopt).
OUTBOX_KEEP_S = 120.0


@dataclass(slots=True, eq=False)
class Outbox:
    """Answers waiting for one host (a listener) to collect them."""

    answers: list[Answered] = field(default_factory=list)
    """Each ``(token, answer bytes)``, in the order they ended."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while an answer waits."""
    seen: float = field(default_factory=time.monotonic)
    """When its host last collected (monotonic)."""


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
        self.incarnation = uuid.uuid4().hex
        """This process's life: a restarted worker has another, so a host knows the calls
        the dead one took will never be answered."""
        self._outboxes: dict[str, Outbox] = {}
        self._calls: set[asyncio.Task[bytes]] = set()
        """The calls running here (held, so none is collected as garbage while it runs)."""
        self.calls = self.submits = self.collects = 0
        """Calls taken here, and the submits and (non-empty) collects that carried them."""

    async def submit(self, listener: str, asks: list[Ask]) -> str:
        """Start (or join) each call of a batch; their answers go to ``listener``'s outbox.
        This worker's :attr:`incarnation`."""
        box = self._outbox(listener)
        self.submits += 1
        self.calls += len(asks)
        for token, gen_id, agent, epoch, wire in asks:
            call = asyncio.create_task(self._generate(gen_id, agent, epoch, wire))
            self._calls.add(call)
            call.add_done_callback(partial(self._post, box, token))
        return self.incarnation

    async def collect(self, listener: str, wait_s: float) -> tuple[str, list[Answered]]:
        """This worker's :attr:`incarnation` and the answers waiting for ``listener`` (after
        up to ``wait_s`` for the first), their text published first."""
        box = self._outbox(listener)
        if not box.answers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.ready.wait(), wait_s)
        answers, box.answers = box.answers, []
        self.collects += bool(answers)
        box.ready.clear()
        box.seen = time.monotonic()
        await self._publisher.flush()  # their text before them (advisory: never raises)
        return self.incarnation, answers

    def _outbox(self, listener: str) -> Outbox:
        box = self._outboxes.get(listener)
        if box is None:
            box = self._outboxes[listener] = Outbox()
        return box

    def _post(self, box: Outbox, token: int, call: asyncio.Task[bytes]) -> None:
        self._calls.discard(call)
        if call.cancelled():
            answer = GenerationAnswer(failure=ModelFailure.CANCELLED, error="cancelled")
            raw = pack_model(answer)
        elif (exc := call.exception()) is not None:  # a bug here, not the agent's
            log.error("model call failed on its worker", exc_info=exc)
            raw = pack_model(GenerationAnswer(failure=ModelFailure.RETRYABLE, error=str(exc)))
        else:
            raw = call.result()
        box.answers.append((token, raw))
        box.ready.set()

    async def _generate(self, gen_id: str, agent: str, epoch: int, wire: bytes) -> bytes:
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
        """Drop the outboxes of hosts that died, and the generations whose asker died and
        that no turn will take."""
        now = time.monotonic()
        for listener, box in list(self._outboxes.items()):
            if now - box.seen > OUTBOX_KEEP_S:
                del self._outboxes[listener]
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
                "listeners": len(self._outboxes),
                "calls": self.calls,
                "submits": self.submits,
                "collects": self.collects,
            }
        )
