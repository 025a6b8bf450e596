"""The save as DESIGN's card wrote it: ``WATCH``, read the fences, ``MULTI`` ... ``EXEC``.

``[checkpoint] atomic = "multi_exec"`` saves a group-commit batch this way instead of with the
save script; the two are interchangeable (the store contract suite runs on both). Per shard
(one hash tag, so one Redis Cluster slot), on one connection and in two round trips:

1. ``WATCH`` of the batch's record keys, then ``HMGET epoch seq`` of each (and, for a
   submission, whether the record or spec exists; ``HLEN`` of the bodies hash, so a key of the
   wrong type fails its save here rather than half-way through ``EXEC``);
2. ``MULTI``, the writes of every save whose fence passed (:func:`fence`, the script's rule),
   ``EXEC`` and, under a durability mode, its ``WAIT``/``WAITAOF``.

A save whose fence fails is answered exactly as the script answers it (``StaleOwner``,
``AlreadySaved``, ...) and left out of the transaction. If a watched record changed in
between, ``EXEC`` answers nil and only that shard's batch is read and tried again.
docs/CLUSTER.md compares the two paths (``phaseline bench --figures atomic``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from bus.errors import StoreError
from store.codec import EncodedRecord
from store.domain.usage import FENCED_SAVE
from store.lua import lua_script
from store.redis.nodes import is_redirect, roundtrip
from store.redis.replies import text
from store.redis.transport import Moved, Transport
from store.write.save_script import SaveCall, SaveStatus, fence

__all__ = ["AtomicSave", "ShardBatch", "fence", "save_commands"]

#: The ledger's compare-and-set (sent by its text: this path's rare transactions need no
#: ``SCRIPT LOAD``), which journals the settles a save carries.
CAS_LUA = lua_script("ledger_cas.lua")

#: Times one shard's batch is read and tried again after losing a WATCH race.
WATCH_ATTEMPTS = 16


class AtomicSave(StrEnum):
    """How a save is made atomic and fenced (``[checkpoint] atomic``)."""

    SCRIPT = "script"
    """One server-side script per save (``store/lua/checkpoint_save.lua``), pipelined."""
    MULTI_EXEC = "multi_exec"
    """Optimistic: ``WATCH`` the records, read their fences, ``MULTI`` ... ``EXEC``."""


def save_commands(
    call: SaveCall, *, ends_turn: bool = False, phase_was: str | None = None
) -> list[tuple[Any, ...]]:
    """The writes of one accepted save, in the script's order (one of them the XADD).
    ``ends_turn``: the stored record is in progress, so a final save adds its tally
    (:mod:`store.domain.usage`); ``phase_was``: the stored record's phase if it is in progress
    (the turn moves out of it in the phase counts)."""
    k, record = call.keys, call.record
    turn = record.turn_id
    out: list[tuple[Any, ...]] = list(call.tally.commands(k.usage)) if ends_turn else []
    if record.replace:
        out.append(("DEL", k.bodies))
    if record.puts:
        out.append(("HSET", k.bodies, *(x for pair in record.puts.items() for x in pair)))
    if record.drops:
        out.append(("HDEL", k.bodies, *record.drops))
    out.append(("DEL", k.record))
    out.append(("HSET", k.record, *(x for pair in record.fields.items() for x in pair)))
    out.append(
        (
            "XADD",
            k.events,
            "MAXLEN",
            "~",
            call.events_maxlen,
            "*",
            "turn_id",
            turn,
            "epoch",
            record.epoch,
            "seq",
            record.seq,
            "phase",
            record.phase,
            "reason",
            record.reason,
            "in_progress",
            int(record.in_progress),
        )
    )
    out.append(("SADD" if record.in_progress else "SREM", k.in_progress, turn))
    phase_now = record.phase if record.in_progress else None
    if phase_was != phase_now:
        if phase_was is not None:
            out.append(("HINCRBY", k.phases, phase_was, -1))
        if phase_now is not None:
            out.append(("HINCRBY", k.phases, phase_now, 1))
    if call.spec:
        out.append(("SET", k.spec, call.spec))
        out.append(("ZADD", k.turns, record.fields["updated_at"], turn))
    if call.ttl_ms > 0:
        out += [("PEXPIRE", key, call.ttl_ms) for key in k.kept()]
        oldest = int(time.time() * 1000) - call.ttl_ms
        out.append(("ZREMRANGEBYSCORE", k.turns, "-inf", f"({oldest}"))
        out.append(("XTRIM", k.events, "MINID", "~", oldest))
    return out


@dataclass(frozen=True, slots=True)
class ShardBatch:
    """The saves of one batch that share a shard, committed as one transaction."""

    calls: Sequence[SaveCall]
    """The saves, all of one shard."""
    wait: tuple[str | int, ...] | None
    """The durability command sent after ``EXEC`` (None: none)."""

    async def commit(self, transport: Transport) -> tuple[list[object], object]:
        """Each save's reply in the script's shape (``['ok', id]``, a refusal, or an
        exception), and the reply of the durability command (None without one).

        On a cluster whose slot map moved (a failover), the node answers every command with
        a redirect and nothing runs: the transport reads the map again and the batch goes to
        the slot's new primary (:meth:`~store.redis.transport.Transport.on_node`)."""
        slot_key = self.calls[0].keys.record
        try:
            return await transport.on_node(slot_key, self._watched)
        except (redis.RedisError, OSError, StoreError) as exc:
            failed = (
                exc
                if isinstance(exc, StoreError)
                else StoreError(f"transaction of {len(self.calls)} saves: {exc}")
            )
            return [failed] * len(self.calls), None

    async def _watched(self, conn: Any) -> tuple[list[object], object]:
        for _ in range(WATCH_ATTEMPTS):
            done = await self._attempt(conn)
            if done is not None:
                return done
        lost = StoreError(f"saves lost {WATCH_ATTEMPTS} WATCH races in a row; try again")
        return [lost] * len(self.calls), None

    async def _replays(self, conn: Any, got: list[object]) -> dict[int, bool]:
        """For each save found at its own stored (epoch, seq): whether the stored record is
        this very one, field for field (a replay), read under the same WATCH. Rare: a resend
        whose answer was lost, or two resumers that claimed one epoch at once."""
        at, candidates = 1, []
        for i, c in enumerate(self.calls):
            stored = got[at]
            at += 3 if c.spec else 2
            if isinstance(stored, list):
                refusal = fence(stored[:2], c.record.epoch, c.record.seq, same=True)
                if refusal is not None and refusal[0] is SaveStatus.ALREADY:
                    candidates.append(i)
        if not candidates:
            return {}
        found = await roundtrip(conn, [("HGETALL", self.calls[i].keys.record) for i in candidates])
        pairs = zip(candidates, found, strict=True)
        return {i: _pairs(h) == _hash_of(self.calls[i].record) for i, h in pairs}

    async def _attempt(self, conn: Any) -> tuple[list[object], object] | None:
        # The settles are unfenced and the script applies them whatever its fence says: here
        # before the WATCH, by the ledger's own compare-and-set (a resend is a replay).
        settles: list[tuple[Any, ...]] = [
            (
                "EVAL",
                CAS_LUA,
                3,
                c.keys.record,
                c.keys.ledger,
                c.keys.usage,
                "",
                *(x for s in c.record.settles for x in (s.call_key, s.dispatched, s.settled)),
            )
            for c in self.calls
            if c.record.settles
        ]
        reads: list[tuple[Any, ...]] = [*settles, ("WATCH", *(c.keys.record for c in self.calls))]
        for c in self.calls:
            reads.append(("HMGET", c.keys.record, "epoch", "seq", "in_progress", "phase"))
            reads.append(("HLEN", c.keys.bodies))
            if c.spec:
                reads.append(("EXISTS", c.keys.record, c.keys.spec))
        got = await roundtrip(conn, reads)
        if any(is_redirect(g) for g in got[: len(settles) + 1]):
            raise Moved
        got = got[len(settles) :]
        replays = await self._replays(conn, got)
        replies: list[object] = []
        writes: list[tuple[Any, ...]] = []
        accepted: list[tuple[int, int, int]] = []  # (save, first write, XADD's index)
        fenced: list[tuple[Any, ...]] = []  # after the writes: their indices stay as counted
        at = 1
        for i, c in enumerate(self.calls):
            stored, bodies = got[at], got[at + 1]
            exists = got[at + 2] if c.spec else 0
            at += 3 if c.spec else 2
            problem = next((x for x in (stored, bodies, exists) if isinstance(x, Exception)), None)
            if problem is not None:
                replies.append(problem)
                continue
            if exists:
                replies.append([SaveStatus.EXISTS])
                continue
            assert isinstance(stored, list)
            refusal = fence(stored[:2], c.record.epoch, c.record.seq, same=replays.get(i, False))
            if refusal is not None:
                if refusal[0] is SaveStatus.STALE_EPOCH:  # counted, as the script counts it
                    fenced.append(("HINCRBY", c.keys.usage, FENCED_SAVE, 1))
                replies.append(refusal)
                continue
            ends_turn = stored[2] in (b"1", "1")
            was = text(stored[3]) if ends_turn and stored[3] is not None else None
            commands = save_commands(c, ends_turn=ends_turn, phase_was=was)
            xadd = len(writes) + next(i for i, cmd in enumerate(commands) if cmd[0] == "XADD")
            accepted.append((i, len(writes), xadd))
            writes += [*commands, ("LLEN", c.keys.inbox)]
            replies.append(None)
        if not writes and not fenced:
            await roundtrip(conn, [("UNWATCH",)])
            return replies, None
        tail = [self.wait] if self.wait else []
        out = await roundtrip(conn, [("MULTI",), *writes, *fenced, ("EXEC",), *tail])
        result = out[len(writes) + len(fenced) + 1]
        if result is None:
            return None  # a watched record changed: read the fences again
        if isinstance(result, Exception):
            failed = StoreError(f"transaction refused: {result}")
            for i, _, _ in accepted:
                replies[i] = failed
            return replies, out[-1] if tail else None
        assert isinstance(result, list)
        ends = [start for _, start, _ in accepted[1:]] + [len(writes)]
        for (i, start, xadd), end in zip(accepted, ends[: len(accepted)], strict=True):
            problem = next((x for x in result[start:end] if isinstance(x, Exception)), None)
            # the save's last write is its LLEN of the turn's inbox
            ok = [SaveStatus.OK, result[xadd], result[end - 1]]
            replies[i] = problem if problem is not None else ok
        return replies, out[-1] if tail else None


def _hash_of(record: EncodedRecord) -> dict[bytes, bytes]:
    """The record's fields as ``HGETALL`` gives them back."""
    return {
        k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in record.fields.items()
    }


def _pairs(reply: object) -> dict[bytes, bytes] | None:
    """A raw ``HGETALL`` reply (a flat list under RESP2, a map under RESP3) as a dict."""
    if isinstance(reply, dict):
        return reply
    if isinstance(reply, list) and len(reply) % 2 == 0:
        return dict(zip(reply[::2], reply[1::2], strict=True))
    return None
