"""The bus: phase transitions and status events on sharded Redis Streams, and each turn's live
stream for watchers.

Each shard's stream (``store.keys.KeyLayout.bus``) carries the events of the turns whose keys
share its hash tag. Subscribers of one kind (e.g. all watchdogs) form one consumer group per
stream, ack what they processed, and reclaim entries a dead member left pending (XAUTOCLAIM).
Streams are capped (``XADD MAXLEN ~``). :class:`MemoryBus` has the same interface for pure tests.

A turn's live stream (``KeyLayout.live``) gets a copy of its transitions and status events
plus what only a watcher wants (text deltas, tool calls and results, restart markers, the
final answer); ``store.views.watch`` reads it. It is capped and expires a day after its last entry,
or with its finished turn's keys (``store.domain.retention``): it is advisory, the checkpoint record
is the truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from bus.errors import PhaselineError
from bus.events import (
    BadBusEntry,
    BusEvent,
    StatusEvent,
    TextDelta,
    WatchEvent,
    decode_bus_event,
    encode_event,
)
from bus.phase import Transition
from store.keys import KeyLayout
from store.lua import lua_script
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import raw, text
from store.redis.stream_reads import read_streams


@dataclass(frozen=True, slots=True)
class LiveStreams:
    """How the per-turn live streams are kept."""

    maxlen: int = 2000
    """Entries kept per turn (approximately; older ones are trimmed). 0 turns them off."""
    ttl_s: int = 86_400
    """Seconds a turn's stream lives after its last entry."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event handed to a consumer; ack it once processed."""

    stream: str
    """Stream it came from."""
    entry_id: str
    """Stream entry id."""
    event: BusEvent
    """The decoded event."""


class Bus(Protocol):
    async def publish(self, events: Sequence[WatchEvent]) -> None: ...
    async def ensure_group(self, group: str) -> None: ...
    async def read(
        self, group: str, consumer: str, *, count: int = 500, block_ms: int = 1000
    ) -> list[Delivery]: ...
    async def ack(self, group: str, deliveries: Sequence[Delivery]) -> None: ...
    async def reclaim(
        self, group: str, consumer: str, *, min_idle_ms: int, count: int = 500
    ) -> list[Delivery]: ...


_PUBLISH_LUA = lua_script("events_publish.lua")


def _by_shard(keys: KeyLayout, events: Sequence[WatchEvent]) -> list[tuple[int, list[WatchEvent]]]:
    """Events grouped by their turn's shard, each group in publish order."""
    groups: dict[int, list[WatchEvent]] = {}
    for e in events:
        groups.setdefault(keys.shard_of(e.turn_id), []).append(e)
    return list(groups.items())


class RedisBus:
    """The bus on Redis Streams. Malformed entries go to the dead-letter stream, acked."""

    def __init__(
        self,
        client: StoreClient,
        keys: KeyLayout,
        *,
        maxlen: int = 100_000,
        live: LiveStreams = LiveStreams(),
    ) -> None:
        self.client = client
        self.keys = keys
        self.maxlen = maxlen
        self.live = live
        self.dead_letters = 0
        self._streams = [keys.bus(s) for s in keys.all_shards()]

    async def publish(self, events: Sequence[WatchEvent]) -> None:
        """Bus events to their shard's bus, and every event to its turn's live stream: one
        script call per shard (``store/lua/events_publish.lua``), the shards in one pipeline."""
        if not events:
            return
        calls = [self._shard_call(shard, batch) for shard, batch in _by_shard(self.keys, events)]
        # By the script's text, not its digest: a server that lost its scripts (a restart)
        # would refuse an EVALSHA, and sending those events again after loading it would put
        # them behind later ones (a watcher stops at a turn's last event).
        with translated("publish to bus"):
            async with self.client.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.eval(_PUBLISH_LUA, len(keys), *keys, *args)
                await pipe.execute()

    def _shard_call(
        self, shard: int, events: list[WatchEvent]
    ) -> tuple[list[str], list[str | int]]:
        """KEYS and ARGV of the publish script for one shard's events."""
        live = self.live
        keys = [self.keys.bus(shard)]
        index: dict[str, int] = {}
        args: list[str | int] = [self.maxlen, live.maxlen, live.ttl_s]
        for e in events:
            key = self.keys.live(e.turn_id)
            if key not in index:
                keys += (key, self.keys.turn(e.turn_id))
                index[key] = len(keys) - 1  # Lua counts from 1
            fields = encode_event(e)
            args += (index[key], int(isinstance(e, Transition | StatusEvent)), len(fields))
            for name, value in fields.items():
                args += (name, value)
        return keys, args

    async def ensure_group(self, group: str) -> None:
        """Create the group on every shard stream (new groups see only new entries)."""
        with translated(f"create bus group {group}"):
            for stream in self._streams:
                try:
                    await self.client.xgroup_create(stream, group, id="$", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def read(
        self, group: str, consumer: str, *, count: int = 500, block_ms: int = 1000
    ) -> list[Delivery]:
        reply = await read_streams(
            self.client,
            dict.fromkeys(self._streams, ">"),
            count=count,
            block_ms=block_ms,
            group=(group, consumer),
        )
        out: list[Delivery] = []
        for stream, entries in reply:
            out.extend(await self._decode(group, stream, entries))
        return out

    async def _decode(
        self, group: str, stream: str, entries: Sequence[tuple[str | bytes, Mapping[bytes, bytes]]]
    ) -> list[Delivery]:
        out: list[Delivery] = []
        bad: list[str] = []
        for entry_id, fields in entries:
            if fields is None:  # deleted by trimming while pending
                bad.append(text(entry_id))
                continue
            try:
                out.append(Delivery(stream, text(entry_id), decode_bus_event(fields)))
            except BadBusEntry as exc:
                bad.append(text(entry_id))
                self.dead_letters += 1
                shard = self._streams.index(stream)
                with translated("dead-letter a bus entry"):
                    await self.client.xadd(
                        self.keys.deadletters(shard),
                        {"stream": stream, "id": raw(entry_id), "error": str(exc)[:1000]},
                        maxlen=10_000,
                        approximate=True,
                    )
        if bad:
            with translated("ack bad bus entries"):
                await self.client.xack(stream, group, *bad)
        return out

    async def ack(self, group: str, deliveries: Sequence[Delivery]) -> None:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for d in deliveries:
            by_stream[d.stream].append(d.entry_id)
        if not by_stream:
            return
        with translated(f"ack bus group {group}"):
            async with self.client.pipeline(transaction=False) as pipe:
                for stream, ids in by_stream.items():
                    pipe.xack(stream, group, *ids)
                await pipe.execute()

    async def reclaim(
        self, group: str, consumer: str, *, min_idle_ms: int, count: int = 500
    ) -> list[Delivery]:
        """Take over entries other consumers of ``group`` left pending for ``min_idle_ms``."""
        out: list[Delivery] = []
        for stream in self._streams:
            with translated(f"reclaim bus group {group}"):
                reply = await self.client.xautoclaim(
                    stream, group, consumer, min_idle_ms, start_id="0-0", count=count
                )
            out.extend(await self._decode(group, stream, reply[1]))
        return out


@dataclass
class _Group:
    cursor: int = 0
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)


class MemoryBus:
    """An in-process bus with the semantics of :class:`RedisBus` (one stream per shard)."""

    def __init__(self, keys: KeyLayout | None = None, *, maxlen: int = 100_000) -> None:
        self.keys = keys or KeyLayout()
        self.maxlen = maxlen
        self._streams: dict[str, list[tuple[int, BusEvent]]] = defaultdict(list)
        self._groups: dict[tuple[str, str], _Group] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self.live: dict[str, list[WatchEvent]] = defaultdict(list)
        """Each turn's live events, uncapped (tests read them whole)."""

    async def publish(self, events: Sequence[WatchEvent]) -> None:
        for e in events:
            self.live[e.turn_id].append(e)
            if not isinstance(e, Transition | StatusEvent):
                continue
            stream = self._streams[self.keys.bus(self.keys.shard_of(e.turn_id))]
            stream.append((next(self._ids), e))
            del stream[: max(0, len(stream) - self.maxlen)]
        async with self._changed:
            self._changed.notify_all()

    async def ensure_group(self, group: str) -> None:
        for s in self.keys.all_shards():
            stream = self.keys.bus(s)
            last = self._streams[stream][-1][0] if self._streams[stream] else 0
            self._groups.setdefault((stream, group), _Group(cursor=last))

    async def read(
        self, group: str, consumer: str, *, count: int = 500, block_ms: int = 1000
    ) -> list[Delivery]:
        deadline = time.monotonic() + block_ms / 1000
        while True:
            out = self._take(group, consumer, count)
            if out or time.monotonic() >= deadline:
                return out
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())

    def _take(self, group: str, consumer: str, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        now = time.monotonic()
        for (stream, g_name), g in self._groups.items():
            if g_name != group:
                continue
            for entry_id, event in self._streams[stream]:
                if entry_id > g.cursor and len(out) < count:
                    g.cursor = entry_id
                    g.pending[entry_id] = (consumer, now)
                    out.append(Delivery(stream, str(entry_id), event))
        return out

    async def ack(self, group: str, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self._groups[(d.stream, group)].pending.pop(int(d.entry_id), None)

    async def reclaim(
        self, group: str, consumer: str, *, min_idle_ms: int, count: int = 500
    ) -> list[Delivery]:
        now = time.monotonic()
        out: list[Delivery] = []
        for (stream, g_name), g in self._groups.items():
            if g_name != group:
                continue
            events = dict(self._streams[stream])
            for entry_id, (_, since) in list(g.pending.items()):
                if (now - since) * 1000 >= min_idle_ms and len(out) < count and entry_id in events:
                    g.pending[entry_id] = (consumer, now)
                    out.append(Delivery(stream, str(entry_id), events[entry_id]))
        return out


class BufferedPublisher:
    """Collects events from synchronous listeners and publishes them in batches.

    Phase listeners are called inside the turn loop and must not block; this buffer is
    flushed by a background task every ``interval_s``. Events are advisory (watchdog, status
    display): if Redis is down a batch is dropped and counted, never retried into a backlog.
    Text deltas of one turn that arrive within a flush period are joined into one entry.
    """

    def __init__(self, bus: Bus, *, interval_s: float = 0.02, max_buffer: int = 100_000) -> None:
        self.bus = bus
        self.interval_s = interval_s
        self.max_buffer = max_buffer
        self.dropped = 0
        self.published = 0
        self._buffer: list[WatchEvent] = []
        self._open_text: dict[str, int] = {}
        """Turn -> index in the buffer of its text delta that later deltas join."""
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        """One flush at a time: a batch sent while an earlier one is still in flight (on
        another connection) could land first, and a watcher stops at a turn's last event."""

    def add(self, event: WatchEvent) -> None:
        at = self._open_text.get(event.turn_id)
        if isinstance(event, TextDelta):
            last = self._buffer[at] if at is not None else None
            if isinstance(last, TextDelta) and last.epoch == event.epoch:
                self._buffer[at] = dataclasses.replace(last, text=last.text + event.text)  # type: ignore[index]
                return
        if len(self._buffer) >= self.max_buffer:
            self.dropped += 1
            return
        if isinstance(event, TextDelta):
            self._open_text[event.turn_id] = len(self._buffer)
        elif at is not None:
            del self._open_text[event.turn_id]
        self._buffer.append(event)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._buffer:
            await asyncio.sleep(self.interval_s)  # the flush period: batches accumulate
            await self.flush()

    async def flush(self) -> None:
        async with self._flushing:
            batch, self._buffer = self._buffer, []
            self._open_text.clear()
            try:
                await self.bus.publish(batch)
                self.published += len(batch)
            except PhaselineError:
                self.dropped += len(batch)
