"""A Redis Cluster primary killed under checkpoint saves: what was acknowledged and then lost.

Redis Cluster replicates asynchronously. A save the primary acknowledged but had not sent to its
replica when it died is gone once the replica takes over: the known window. ``WAIT N``
(``[redis] durability = "replicas:N"``) closes it: a batch is acknowledged only after N replicas
have it, so the replica that is promoted holds every acknowledged save.

:func:`failover_under_saves` measures it. Writers save turns ``seq`` 1, 2, 3 … as fast as the
store answers (a failed save is retried: the fence recognises a replay), one primary is
SIGKILLed mid-way (after holding its replica stopped for ``lag_s`` and until ``unsent_bytes``
of its writes are held for it, so its last writes have not reached it), its replica takes
over; the writers are held from the kill until every turn's stored ``seq`` has been read and
compared with the last one its writer saw acknowledged, then they go on through the killed
node's return, and the comparison is made again at the end.
``scripts/cluster_failover.py`` prints the figures for both durabilities; a test asserts that
``replicas:1`` loses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import RedisCluster

from bus.errors import AlreadySaved, StoreError
from bus.messages import Message
from bus.phase import TurnPhase
from store.keys import KeyLayout
from store.records import CheckpointRecord, Counters, MessageMeta
from store.redis.connection import connect
from store.redis.durability import parse_durability
from store.redis.embedded_cluster import EmbeddedCluster
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["FailoverReport", "failover_under_saves"]


@dataclass(frozen=True, slots=True)
class FailoverReport:
    """What one run saw."""

    durability: str
    """The ``[redis] durability`` the saves ran under."""
    turns: int
    """Turns saved concurrently, one writer each."""
    acknowledged: int
    """Saves acknowledged, in all (a save answered ``AlreadySaved`` when sent again after an
    error is not counted: its first answer was the error)."""
    lost_turns: int
    """Turns whose stored record is older than the last save acknowledged to their writer."""
    lost_saves: int
    """Acknowledged saves missing afterwards (the sum over turns of acknowledged - stored)."""
    failed_saves: int
    """Saves answered with an error (during the failover) and sent again."""
    failover_s: float
    """From the SIGKILL until the cluster served every slot again."""
    rejoined_s: float
    """From the SIGKILL until the killed node was back as a replica, in sync."""
    stall_s: float
    """The longest time one writer went without an acknowledgement."""


def _record(turn_id: str, seq: int, payload_bytes: int = 0) -> CheckpointRecord:
    return CheckpointRecord(
        turn_id=turn_id,
        session_id="failover",
        epoch=1,
        seq=seq,
        phase=TurnPhase.EXECUTING_TOOLS,
        in_progress=True,
        reason="tool_batch",
        messages=(Message(role="user", text=f"step {seq} ".ljust(payload_bytes, "x")),),
        meta=(MessageMeta(source="prompt", message_id=f"m{seq}", at_ms=seq),),
        baseline=1,
        counters=Counters(),
        updated_at=seq,
    )


class _Writers:
    """One writer per turn, saving its record again and again, counting what is acknowledged;
    parked on demand (from the kill until the survivors are read)."""

    def __init__(self, store: RedisCheckpointStore, ids: list[str], payload_bytes: int) -> None:
        self.store = store
        self.ids = ids
        self.payload_bytes = payload_bytes
        self.acked = dict.fromkeys(ids, 0)
        """Per turn: its last acknowledged seq."""
        self.failed = self.n_acked = self.parked = 0
        self.stall = 0.0
        """Longest time a writer went without an acknowledgement (the harness's hold aside)."""
        self.stop = asyncio.Event()
        self.running = asyncio.Event()  # cleared: writers park
        self.running.set()
        self.progress = asyncio.Condition()

    async def write(self, turn_id: str) -> None:
        seq, last_ack = 1, time.monotonic()
        while not self.stop.is_set():
            if not self.running.is_set():
                self.stall = max(self.stall, time.monotonic() - last_ack)  # up to the hold
                self.parked += 1
                await self._tell()
                await self.running.wait()
                self.parked -= 1
                last_ack = time.monotonic()  # the hold is the harness's, not a stall
                continue
            try:
                await self.store.save(_record(turn_id, seq, self.payload_bytes))
            except AlreadySaved:
                # It landed the first time but was never acknowledged (its WAIT fell short):
                # go on without counting it, as a turn would.
                seq += 1
                continue
            except StoreError:
                self.failed += 1
                await asyncio.sleep(0.05)  # backoff before sending it again
                continue
            now = time.monotonic()
            self.stall = max(self.stall, now - last_ack)
            self.acked[turn_id], last_ack, seq = seq, now, seq + 1
            self.n_acked += 1
            await self._tell()

    async def _tell(self) -> None:
        async with self.progress:
            self.progress.notify_all()

    async def until(self, done: Callable[[], bool], timeout: float = 120) -> None:
        """Wait (at most ``timeout`` s) until ``done()`` holds after some writer's step."""

        async def wait() -> None:
            async with self.progress:
                await self.progress.wait_for(done)

        await asyncio.wait_for(wait(), timeout)

    async def losses(self) -> dict[str, int]:
        """Per turn: acknowledged saves the store no longer has."""
        survived = {t: (await self.store.load(t)).seq for t in self.ids}
        return {t: self.acked[t] - survived[t] for t in self.ids if survived[t] < self.acked[t]}


async def _fail_over_held(
    cluster: EmbeddedCluster,
    client: RedisCluster,
    key: str,
    w: _Writers,
    *,
    lag_s: float,
    unsent_bytes: int,
    park_first: bool,
) -> tuple[float, float, dict[str, int]]:
    """SIGKILL the primary holding ``key`` under the writers, park them, wait for the
    failover and the rejoin; the seconds each took and the acknowledged saves lost. The
    writers go on after. ``park_first``: park them before the kill, not at it (no save is
    then in flight at the kill: one sent again to the promoted replica would carry its whole
    record over a lost one and hide the loss)."""
    node = client.get_node_from_key(key)
    assert node is not None
    loop = asyncio.get_running_loop()

    async def parked() -> None:
        w.running.clear()
        await w.until(lambda: w.parked == len(w.ids))

    def hold() -> None:  # called in fail_over's thread
        loop.call_soon_threadsafe(w.running.clear)

    def park() -> None:  # called in fail_over's thread, before the kill
        asyncio.run_coroutine_threadsafe(parked(), loop).result()

    # The writers park at the kill, so what the promoted replica holds is read before any
    # newer save could cover a lost one (a save carries the whole record: seq n + 1 lands
    # over a stored n - 5 and the loss no longer shows). Until the killed node is back as
    # a replica, ``replicas:1`` saves could not be confirmed anyway.
    failover_s, rejoined_s = await asyncio.to_thread(
        cluster.fail_over,
        cluster.node_of_port(int(node.port)),
        lag_s=lag_s,
        unsent_bytes=unsent_bytes,
        before_kill=park if park_first else None,
        on_kill=hold,
    )
    await w.until(lambda: w.parked == len(w.ids))
    lost = await w.losses()
    w.running.set()
    return failover_s, rejoined_s, lost


async def failover_under_saves(
    cluster: EmbeddedCluster,
    *,
    durability: str,
    turns: int = 48,
    saves_before: int = 20,
    saves_after: int = 20,
    lag_s: float = 0.0,
    unsent_bytes: int = 0,
    payload_bytes: int = 0,
    park_first: bool = False,
) -> FailoverReport:
    """Run the writers; once each has ``saves_before`` acknowledged saves, SIGKILL the primary
    of turn 0's slot (``lag_s``: its replica stopped that long first, and ``unsent_bytes``:
    until the primary holds that much for it beyond its socket's buffers) while they keep saving,
    hold them, wait for its replica to take over and for the killed node to rejoin as a
    replica, count what the writers saw acknowledged and the cluster no longer has, and let
    them go on until each has ``saves_after`` more. ``payload_bytes``: the size of each save's
    message (what the replica falls behind by); ``park_first``: the writers are parked just
    before the kill rather than at it (see :func:`_fail_over_held`)."""
    client = connect(cluster.url, cluster=True, retry_s=1.0)
    assert isinstance(client, RedisCluster)
    keys = KeyLayout("failover", shards=16)
    store = RedisCheckpointStore(client, keys, durability=parse_durability(durability))
    ids = [f"f{i}" for i in range(turns)]
    w = _Writers(store, ids, payload_bytes)
    tasks = [asyncio.create_task(w.write(t)) for t in ids]
    try:
        await w.until(lambda: min(w.acked.values()) >= saves_before)
        failover_s, rejoined_s, lost = await _fail_over_held(
            cluster,
            client,
            keys.turn(ids[0]),
            w,
            lag_s=lag_s,
            unsent_bytes=unsent_bytes,
            park_first=park_first,
        )
        marks = dict(w.acked)
        await w.until(lambda: all(w.acked[t] >= marks[t] + saves_after for t in ids))
        w.stop.set()
        await asyncio.gather(*tasks)
        # And every save acknowledged after the failover is there at the end.
        for t, n in (await w.losses()).items():
            lost[t] = max(lost.get(t, 0), n)
    finally:
        w.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
    return FailoverReport(
        durability=durability,
        turns=turns,
        acknowledged=w.n_acked,
        lost_turns=len(lost),
        lost_saves=sum(lost.values()),
        failed_saves=w.failed,
        failover_s=round(failover_s, 2),
        rejoined_s=round(rejoined_s, 2),
        stall_s=round(w.stall, 2),
    )
