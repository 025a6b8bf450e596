"""Generations that outlive their asker, without Ray: the wire (a request names its generation,
answers carry typed failures) and the worker's table (started once, adopted by a newer
incarnation, fenced for an older one, cancelled where it runs, dropped when no turn will take
it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from actors.engine.models import generations
from actors.engine.models.generations import (
    GenerationAnswer,
    GenerationAsk,
    GenerationTable,
    ModelFailure,
    answer_of,
    failure_of,
    generation_id,
    pack_ask,
    reply_of,
    unpack_answer,
    unpack_ask,
)
from actors.harness.http_agents import add
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.tools import ToolRegistry
from bus.errors import (
    AgentCodeError,
    AwaitingAdmission,
    ContextLengthError,
    FatalLLMError,
    RateLimitedLLMError,
    RecordError,
    RetryableLLMError,
    StaleOwner,
)
from bus.messages import Message, Usage
from store.codec import pack_model
from store.records import TurnInput


def request(text: str = "hello", attempt: int = 0) -> LLMRequest:
    return LLMRequest(
        turn_id="t1",
        messages=(Message(role="system", text="sys"), Message(role="user", text=text)),
        tools_enabled=True,
        attempt=attempt,
        tools=tuple(ToolRegistry([add])),
    )


def wire(req: LLMRequest) -> bytes:
    return pack_ask(GenerationAsk.of(req, TurnInput(message="hi"), 1))


def test_the_same_request_names_the_same_generation_and_another_another() -> None:
    assert generation_id(wire(request())) == generation_id(wire(request()))
    assert generation_id(wire(request())) != generation_id(wire(request(attempt=1)))
    assert generation_id(wire(request())) != generation_id(wire(request("other")))
    back = unpack_ask(wire(request())).request(None)
    assert back.messages == request().messages and back.tools[0].name == "add"
    assert back.tools[0].parameters == request().tools[0].parameters
    with pytest.raises(RecordError):
        unpack_ask(b"\x93not a request")


def test_an_answer_carries_a_reply_or_its_typed_failure() -> None:
    reply = LLMReply(
        Message(role="assistant", text="4"), Usage(prompt_tokens=3), finish_reason="stop"
    )
    back = reply_of(unpack_answer(pack_model(answer_of(reply))))
    assert back.message == reply.message and back.usage == reply.usage
    assert back.published and not back.adopted
    limited = failure_of(RateLimitedLLMError("slow down", retry_after_s=2.5, status=429))
    with pytest.raises(RateLimitedLLMError) as got:
        reply_of(limited)
    assert got.value.retry_after_s == 2.5 and got.value.status == 429
    held = AwaitingAdmission("the limiter holds it", retry_after_s=0.5, held_s=30.0)
    with pytest.raises(AwaitingAdmission) as waits:  # the time a worker held it travels back
        reply_of(unpack_answer(pack_model(failure_of(held))))
    assert (waits.value.retry_after_s, waits.value.held_s) == (0.5, 30.0)
    for exc, kind in ((ContextLengthError("long"), ContextLengthError),
                      (RetryableLLMError("503"), RetryableLLMError),
                      (FatalLLMError("401"), FatalLLMError)):  # fmt: skip
        with pytest.raises(kind):
            reply_of(failure_of(exc))
    with pytest.raises(StaleOwner):
        reply_of(GenerationAnswer(failure=ModelFailure.FENCED))
    with pytest.raises(AgentCodeError, match="KeyError"):  # a bug fails the asker's run
        reply_of(GenerationAnswer(failure=ModelFailure.AGENT_CODE, error="KeyError: 'choices'"))
    with pytest.raises(RetryableLLMError, match="did not decode"):
        unpack_answer(b"garbage")


class Gate:
    """A generation that answers when the test says so, counting how often it was started."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started = asyncio.Event()
        self.starts = 0
        self.owners: list[int] = []

    async def __call__(self, owner: Callable[[], int]) -> GenerationAnswer:
        self.starts += 1
        self.started.set()
        await self.go.wait()
        self.owners.append(owner())
        return answer_of(LLMReply(Message(role="assistant", text="done")))


async def test_a_newer_incarnation_adopts_a_generation_its_dead_asker_left() -> None:
    table, gate = GenerationTable(keep_s=60), Gate()
    first = asyncio.create_task(table.answer("g", "t1", 1, gate))
    await gate.started.wait()
    first.cancel()  # its asker dies: the generation goes on
    with pytest.raises(asyncio.CancelledError):
        await first
    assert [g.gen_id for g in table.unattended()] == ["g"]
    second = asyncio.create_task(table.answer("g", "t1", 2, gate))
    stale = asyncio.create_task(table.answer("g", "t1", 1, gate))  # the fenced one asks again
    gate.go.set()
    answer = await second
    assert answer.message is not None and answer.message.text == "done" and answer.adopted
    assert (await stale).failure is ModelFailure.FENCED
    assert gate.starts == 1 and gate.owners == [2] and table.adopted == 1
    # Its host dies again before journaling the reply: the finished answer is taken again.
    again = await table.answer("g", "t1", 3, gate)
    assert again.adopted and gate.starts == 1


async def test_cancel_ends_a_generation_where_it_runs_unless_a_newer_one_owns_it() -> None:
    table, gate = GenerationTable(keep_s=60), Gate()
    waiter = asyncio.create_task(table.answer("g", "t1", 2, gate))
    await gate.started.wait()
    assert not table.cancel("g", 1)  # a fenced incarnation cannot end it
    assert table.cancel("g", 2)
    assert (await waiter).failure is ModelFailure.CANCELLED
    assert len(table) == 0


async def test_the_sweep_drops_what_no_turn_will_take() -> None:
    now = [0.0]
    table = GenerationTable(keep_s=10, clock=lambda: now[0])
    running, finished, taken, gone = Gate(), Gate(), Gate(), Gate()
    orphans = [
        asyncio.create_task(table.answer("run", "ended", 1, running)),
        asyncio.create_task(table.answer("fin", "old", 1, finished)),
        asyncio.create_task(table.answer("gone", "purged", 1, gone)),
    ]
    for gate in (running, finished, gone):
        await gate.started.wait()
    for task in orphans:  # their askers died
        task.cancel()
    await asyncio.gather(*orphans, return_exceptions=True)
    finished.go.set()
    taken.go.set()
    assert (await table.answer("took", "live", 1, taken)).message is not None
    now[0] = 11.0  # "fin" is past keep_s
    # Only the turns of generations nobody took are read; a turn that took its answer is not.
    assert table.turns_unattended() == ["ended", "old", "purged"]
    dropped = table.sweep({"ended": False, "old": True, "purged": None})
    assert sorted(dropped) == ["fin", "gone", "run"] and len(table) == 1
    now[0] += generations.DELIVERED_KEEP_S
    assert table.sweep({}) == ["took"] and table.dropped == 4
    table2, gate = GenerationTable(keep_s=600), Gate()
    orphan = asyncio.create_task(table2.answer("g", "live", 1, gate))
    await gate.started.wait()
    orphan.cancel()
    await asyncio.gather(orphan, return_exceptions=True)
    assert table2.sweep({"live": True}) == []  # in progress: its resumed turn may come
    assert len(table2) == 1
    assert table2.cancel("g", 1)


async def test_a_request_asked_again_after_a_failure_is_tried_again() -> None:
    """A rate limit or the limiter's hold does not spend an attempt, so the same request comes
    back under the same name: it gets a new try, not the kept failure."""
    table, tries = GenerationTable(keep_s=60), 0

    async def flaky(_owner: Callable[[], int]) -> GenerationAnswer:
        nonlocal tries
        tries += 1
        if tries == 1:
            return failure_of(RateLimitedLLMError("slow down", retry_after_s=1))
        return answer_of(LLMReply(Message(role="assistant", text="ok")))

    assert (await table.answer("g", "t1", 1, flaky)).failure is ModelFailure.RATE_LIMITED
    answer = await table.answer("g", "t1", 1, flaky)
    assert answer.message is not None and answer.message.text == "ok" and tries == 2
    assert (await table.answer("g", "t1", 1, flaky)).message is not None and tries == 2
