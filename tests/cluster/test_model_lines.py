"""A host's line to a model worker (``actors.cluster.model_lines.ModelLine``) without Ray: the
calls asked together leave in one submit, each answer reaches its own asker, and a worker that
dies or comes back restarted fails exactly the calls it had taken."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import cast

import pytest
from ray.exceptions import RayActorError

from actors.cluster.model_lines import ModelLine, WorkerLost
from actors.cluster.refs import ModelWorkerRef
from actors.engine.models.generations import Answered, Ask
from bus.errors import RetryableLLMError


class Ref:
    """What ``actors.cluster.refs.ask`` awaits: an object with ``future()``."""

    def __init__(self, value: object = None, error: BaseException | None = None) -> None:
        self._future: concurrent.futures.Future[object] = concurrent.futures.Future()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    def future(self) -> concurrent.futures.Future[object]:
        return self._future


class Worker:
    """A model worker double: it takes batches, and answers collects from a queue the test
    fills; ``incarnation`` changes as a restart would change it."""

    def __init__(self) -> None:
        self.incarnation = "life-1"
        self.batches: asyncio.Queue[list[Ask]] = asyncio.Queue()
        self.collects: asyncio.Queue[tuple[str, list[Answered]] | BaseException] = asyncio.Queue()
        self.dead = False
        self.refuses = False

    def submit(self, listener: str, asks: list[Ask]) -> Ref:
        if self.dead:
            return Ref(error=RayActorError())
        if self.refuses:
            return Ref(error=ValueError("not a batch"))
        self.batches.put_nowait(asks)
        return Ref(self.incarnation)

    async def collect(self, listener: str, wait_s: float) -> tuple[str, list[Answered]]:
        got = await self.collects.get()
        if isinstance(got, BaseException):
            raise got
        return got


def line_to(worker: Worker) -> ModelLine:
    return ModelLine(cast(ModelWorkerRef, worker), "host-a")


async def sent(worker: Worker) -> list[Ask]:
    """The next batch the line sends."""
    async with asyncio.timeout(5):
        return await worker.batches.get()


async def test_calls_asked_together_leave_together_and_each_gets_its_answer() -> None:
    worker = Worker()
    line = line_to(worker)
    a = asyncio.create_task(line.ask("gen-a", "pkg:agent", 1, b"a"))
    b = asyncio.create_task(line.ask("gen-b", "pkg:agent", 1, b"b"))
    batch = await sent(worker)
    assert [x[1] for x in batch] == ["gen-a", "gen-b"] and worker.batches.empty()
    tokens = {x[1]: x[0] for x in batch}
    await worker.collects.put(("life-1", [(tokens["gen-b"], b"answer b")]))
    assert await b == b"answer b"
    assert not a.done()
    await worker.collects.put(("life-1", [(tokens["gen-a"], b"answer a")]))
    assert await a == b"answer a"


async def test_a_restarted_worker_fails_the_calls_the_dead_one_took() -> None:
    worker = Worker()
    line = line_to(worker)
    taken = asyncio.create_task(line.ask("gen-a", "pkg:agent", 1, b"a"))
    await sent(worker)
    worker.incarnation = "life-2"  # died and came back between two collects
    later = asyncio.create_task(line.ask("gen-b", "pkg:agent", 1, b"b"))
    (b,) = await sent(worker)
    await worker.collects.put(("life-2", []))
    with pytest.raises(WorkerLost, match="restarted"):
        await taken
    assert not later.done()  # the new life took it: it still waits for its answer
    await worker.collects.put(("life-2", [(b[0], b"answer b")]))
    assert await later == b"answer b"


async def test_a_worker_that_dies_fails_its_calls_and_refuses_new_ones() -> None:
    worker = Worker()
    line = line_to(worker)
    taken = asyncio.create_task(line.ask("gen-a", "pkg:agent", 1, b"a"))
    await sent(worker)
    await worker.collects.put(RayActorError())
    with pytest.raises(WorkerLost, match="died"):
        await taken
    worker.dead = True
    with pytest.raises(WorkerLost, match="died"):
        await line.ask("gen-b", "pkg:agent", 1, b"b")


async def test_a_worker_that_answers_with_an_error_fails_the_calls_instead_of_hanging() -> None:
    """A refused submit or a collect that raises (not a death) is a transient error for each
    call it concerns; no call is left waiting for an answer that will not come."""
    worker = Worker()
    line = line_to(worker)
    taken = asyncio.create_task(line.ask("gen-a", "pkg:agent", 1, b"a"))
    await sent(worker)
    await worker.collects.put(ValueError("not an answer"))
    with pytest.raises(RetryableLLMError, match="collect failed"):
        await taken
    worker.refuses = True
    with pytest.raises(RetryableLLMError, match="refused the calls"):
        await line.ask("gen-b", "pkg:agent", 1, b"b")
