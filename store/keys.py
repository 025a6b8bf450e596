"""Every Redis key phaseline uses, in one place.

Layout (``ns`` is the configurable namespace, ``s`` the shard of the turn)::

    {ns}:{s<N>}:turn:<turn_id>      hash    the checkpoint record (records.CheckpointRecord)
    {ns}:{s<N>}:bodies:<turn_id>    hash    digest -> transcript entry or chunk of digests,
                                            each stored once (store.write.transcript)
    {ns}:{s<N>}:spec:<turn_id>      string  msgpack TurnSpec, written once at submission
    {ns}:{s<N>}:tools:<turn_id>     hash    tool ledger: call key -> msgpack LedgerEntry, and
                                            "reply" -> msgpack ReplyJournal (the model reply
                                            whose calls the last claim journaled; "reply!bad"
                                            and "reply!why" keep one refused on resume)
    {ns}:{s<N>}:effects:<turn_id>   hash    side-effect counters of non-idempotent tools: call
                                            key -> runs, and "#<call key>#<run id>" -> 1 markers
    {ns}:{s<N>}:inbox:<turn_id>     list    injected user messages, consumed by offset
    {ns}:{s<N>}:approval:<turn_id>  hash    call key -> "approve" | "deny"
    {ns}:{s<N>}:live:<turn_id>      stream  what a watcher of the turn sees (bus.events
                                            WatchEvent), capped, expires a day after its last
                                            entry or with its finished turn (store.views.streams,
                                            store.domain.retention)
    {ns}:{s<N>}:response:<turn_id>  string  "<generation> <response id>": the provider's id of
                                            the turn's model call in flight, for an endpoint
                                            that keeps generations (store.domain.responses)
    {ns}:{s<N>}:session:<session>   hash    a session's turn count and latest turn id
                                            (store.domain.sessions)
    {ns}:{s<N>}:queue:<session>     list    a session's next turns, waiting for the one that
                                            runs (msgpack QueuedTurn), opened in order
    {ns}:{s<N>}:events              stream  one entry per save (the checkpoint event)
    {ns}:{s<N>}:bus                 stream  phase transitions and status events
                                            (store.views.streams)
    {ns}:{s<N>}:deadletters         stream  bus entries that failed to decode, kept for a person
    {ns}:{s<N>}:inprogress          set     turn ids whose record has in_progress = 1
    {ns}:{s<N>}:turns               zset    every turn of the shard -> submitted at (unix ms),
                                            written with its first record (listing turns
                                            without a scan)
    {ns}:{s<N>}:usage               hash    "<counter>|<agent>" -> the shard's finished turns'
                                            tokens per agent, added by final saves
                                            (store.domain.usage)
    {ns}:{s<N>}:quarantine          hash    quarantined key -> reason
    {ns}:{s<N>}:quarantined:<id>    hash    a record moved aside because it failed to decode
    {ns}:{global}:owner             hash    who runs the namespace's deployment: Ray cluster,
                                            owner token, host, pid, command, since; expires
                                            unless its Supervisor renews it (store.domain.ownership)
    {ns}:{global}:queued            set     sessions with queued turns (advisory: a host that
                                            finds a session free opens its next one)
    {ns}:{global}:hosts             hash    host slot -> current generation (the supervisor's)
    {ns}:{global}:supervisor        hash    supervisor counters (respawns)
    {ns}:{global}:isolation         zset    turns to run alone on the isolation host -> not
                                            before (unix ms); see store.domain.isolation
    {ns}:{global}:probation         hash    the turn running alone right now: turn_id, epoch,
                                            step it started (phase@position), at
    {ns}:{global}:pools             hash    tool worker pool -> its current size (the
                                            supervisor's; hosts route calls by it)
    {ns}:{global}:lease:<slot>:<gen> string a host generation's lease, renewed by the host,
                                            expiring when it stops (store.domain.leases)
    {ns}:{global}:models            zset    model endpoint id -> when a process calling it last
                                            said so (unix ms): the endpoints to list, read
                                            instead of scanning the keyspace (store.domain.limiter)
    {ns}:{m:<endpoint>}:limit       hash    a model endpoint's admission state: request and
                                            token schedules, the provider's pause, waiters'
                                            last asks (store.domain.limiter)
    {ns}:{m:<endpoint>}:line        zset    calls waiting for that endpoint -> first held back
    {ns}:{m:<endpoint>}:flight      zset    its admitted calls -> when their place expires

The ``{s<N>}`` hash tag puts every key of one turn, and the shard-wide index and stream it is
written with, in one Redis Cluster slot, so one save script can touch them all. The turns of a
session are named ``<session>/<n>`` and take their shard from the session's name, so a session
key, its latest turn and the next turn live in one slot too (one transaction opens a turn).
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass

from bus.errors import ConfigError

_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID = r"[A-Za-z0-9_.:\-]{1,128}"
_SESSION_ID = re.compile(_ID)
#: A turn id: 1-128 of ``[A-Za-z0-9_.:-]``, and ``/<n>`` for a session's n-th turn (what a
#: URL route of a turn matches too).
TURN_ID_PATTERN = rf"{_ID}(?:/[0-9]{{1,9}})?"
_TURN_ID = re.compile(TURN_ID_PATTERN)
_ENDPOINT = re.compile(r"[0-9a-f]{1,64}")


def check_turn_id(turn_id: str) -> str:
    """Turn ids become parts of keys; refuse ones that could collide or smuggle a hash tag."""
    if not _TURN_ID.fullmatch(turn_id):
        raise ConfigError(
            f"invalid turn id {turn_id!r}: use 1-128 of [A-Za-z0-9_.:-] (a session's turns "
            "add /<n>)"
        )
    return turn_id


def check_endpoint(endpoint: str) -> str:
    """Model endpoint ids (hex, :func:`store.domain.limiter.endpoint_id`) name keys; refuse
    others."""
    if not _ENDPOINT.fullmatch(endpoint):
        raise ConfigError(f"invalid model endpoint id {endpoint!r}")
    return endpoint


def check_session_id(session_id: str) -> str:
    """Session ids name keys and prefix their turns' ids."""
    if not _SESSION_ID.fullmatch(session_id):
        raise ConfigError(f"invalid session id {session_id!r}: use 1-128 of [A-Za-z0-9_.:-]")
    return session_id


def session_turn_id(session_id: str, n: int) -> str:
    """Id of the ``n``-th turn (1-based) of a session."""
    return f"{check_session_id(session_id)}/{n}"


@functools.lru_cache(maxsize=1 << 16)
def _turn_prefix(namespace: str, shards: int, turn_id: str) -> str:
    """``<namespace>:{s<shard>}`` of a checked turn id. Every save, script call and event
    builds a few keys of the same turns: checking and hashing each id once per key was 8 % of
    a CheckpointActor's CPU in the bench's throughput figure."""
    return _tag(namespace, _shard(shards, check_turn_id(turn_id)))


#: Field of a turn's ledger hash holding its journaled reply (``store.domain.ledger``); call keys
#: are ``<batch>.<index>.<hex>``, so no call can take it.
REPLY_FIELD = "reply"
#: Fields where a journaled reply refused on resume is kept, with why (never read back).
REPLY_REFUSED_FIELD = "reply!bad"
REPLY_REFUSED_WHY_FIELD = "reply!why"


def _shard(shards: int, turn_id: str) -> int:
    return zlib.crc32(turn_id.partition("/")[0].encode()) % shards


def _tag(namespace: str, shard: int) -> str:
    return f"{namespace}:{{s{shard}}}"


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Builds keys for one namespace. Immutable and cheap; pass it around by value."""

    namespace: str = "pl"
    """Prefix of every key, so several deployments or test runs share one Redis."""
    shards: int = 16
    """Number of shard hash tags; fixed for the life of a namespace."""

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(f"invalid namespace {self.namespace!r}: use 1-64 of [A-Za-z0-9_.-]")
        if not 1 <= self.shards <= 16384:
            raise ConfigError(f"shards must be in 1..16384, got {self.shards}")

    def shard_of(self, turn_id: str) -> int:
        """Stable shard of a turn (crc32, so every process and language agrees); a session's
        turn ``<session>/<n>`` is in its session's shard."""
        return _shard(self.shards, turn_id)

    def _prefix(self, shard: int) -> str:
        return _tag(self.namespace, shard)

    def _shard_prefix(self, turn_id: str) -> str:
        """:meth:`_prefix` of the turn's shard, the turn id checked."""
        return _turn_prefix(self.namespace, self.shards, turn_id)

    def _turn_key(self, kind: str, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:{kind}:{turn_id}"

    def turn(self, turn_id: str) -> str:
        return self._turn_key("turn", turn_id)

    def bodies(self, turn_id: str) -> str:
        return self._turn_key("bodies", turn_id)

    def spec(self, turn_id: str) -> str:
        return self._turn_key("spec", turn_id)

    def tools(self, turn_id: str) -> str:
        return self._turn_key("tools", turn_id)

    def effects(self, turn_id: str) -> str:
        return self._turn_key("effects", turn_id)

    def inbox(self, turn_id: str) -> str:
        return self._turn_key("inbox", turn_id)

    def approval(self, turn_id: str) -> str:
        return self._turn_key("approval", turn_id)

    def quarantined(self, turn_id: str) -> str:
        return self._turn_key("quarantined", turn_id)

    def live(self, turn_id: str) -> str:
        return self._turn_key("live", turn_id)

    def response(self, turn_id: str) -> str:
        return self._turn_key("response", turn_id)

    def session(self, session_id: str) -> str:
        shard = self.shard_of(check_session_id(session_id))
        return f"{self._prefix(shard)}:session:{session_id}"

    def session_queue(self, session_id: str) -> str:
        shard = self.shard_of(check_session_id(session_id))
        return f"{self._prefix(shard)}:queue:{session_id}"

    def queued_sessions(self) -> str:
        return f"{self.namespace}:{{global}}:queued"

    def events(self, shard: int) -> str:
        return f"{self._prefix(shard)}:events"

    def in_progress(self, shard: int) -> str:
        return f"{self._prefix(shard)}:inprogress"

    def turns(self, shard: int) -> str:
        return f"{self._prefix(shard)}:turns"

    def phases(self, shard: int) -> str:
        """Hash: phase -> in-progress turns of the shard whose latest record is in it (kept by
        the save script: the counts at the top of the console's list)."""
        return f"{self._prefix(shard)}:phases"

    def phases_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:phases"

    def turns_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:turns"

    def usage(self, shard: int) -> str:
        return f"{self._prefix(shard)}:usage"

    def usage_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:usage"

    def quarantine(self, shard: int) -> str:
        return f"{self._prefix(shard)}:quarantine"

    def bus(self, shard: int) -> str:
        return f"{self._prefix(shard)}:bus"

    def deadletters(self, shard: int) -> str:
        return f"{self._prefix(shard)}:deadletters"

    def owner(self) -> str:
        return f"{self.namespace}:{{global}}:owner"

    def hosts(self) -> str:
        return f"{self.namespace}:{{global}}:hosts"

    def supervisor(self) -> str:
        return f"{self.namespace}:{{global}}:supervisor"

    def isolation(self) -> str:
        return f"{self.namespace}:{{global}}:isolation"

    def probation(self) -> str:
        return f"{self.namespace}:{{global}}:probation"

    def pools(self) -> str:
        return f"{self.namespace}:{{global}}:pools"

    def lease(self, slot: int, generation: int) -> str:
        return f"{self.namespace}:{{global}}:lease:{slot}:{generation}"

    def _model(self, endpoint: str, kind: str) -> str:
        return f"{self.namespace}:{{m:{check_endpoint(endpoint)}}}:{kind}"

    def model_limit(self, endpoint: str) -> str:
        return self._model(endpoint, "limit")

    def model_line(self, endpoint: str) -> str:
        return self._model(endpoint, "line")

    def model_flight(self, endpoint: str) -> str:
        return self._model(endpoint, "flight")

    def models(self) -> str:
        return f"{self.namespace}:{{global}}:models"

    def events_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:events"

    def in_progress_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:inprogress"

    def quarantine_of(self, turn_id: str) -> str:
        return f"{self._shard_prefix(turn_id)}:quarantine"

    def all_shards(self) -> range:
        return range(self.shards)

    def pattern(self) -> str:
        """SCAN pattern matching every key of this namespace (for cleanup and tooling)."""
        return f"{self.namespace}:{{s*}}:*"
