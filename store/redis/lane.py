"""A lean path to one Redis server for the scripts of the durable round: one connection per
client, each command written as it comes and the replies read back in order, parsed by hiredis.

Why: a durable round is two script calls (a tool batch's claim, the checkpoint's save), and on a
single host those round trips, not Redis, bound how fast one turn goes. redis-py's asyncio client
spends most of a command's client CPU in its pool, its retry wrapper and its stream reader, which
this path does without (``scripts/client_costs.py`` compares the two). The saves, the ledger's
scripts and a turn's start go this way (``store.redis.batcher``, ``store.write.checkpoint``);
everything else keeps redis-py.

What it keeps of redis-py: its error classes (an error reply is the exception redis-py would have
raised, so :func:`store.redis.failures.translated` reads it the same), its retry rule (a command
whose connection failed is sent again, with backoff, for about ``retry_s``: every command sent here
is safe to repeat, see :func:`store.redis.connection.retry_policy`) and its socket timeout. Only a
plain TCP connection to one server gets a lane (:class:`LaneRedis`); TLS, a unix socket, a Redis
Cluster and fakeredis keep redis-py's path for everything."""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser

__all__ = ["Lane", "LaneRedis", "lane_of"]

#: Backoff between tries of a command whose connection failed: doubling from this, capped at 1 s
#: (redis-py's ``retry_policy`` of :mod:`store.redis.connection`).
_BACKOFF_S = 0.1


class _ErrorReply(Exception):
    """What hiredis hands back for an error reply; turned into redis-py's class for it."""


#: Commands that wait for what the connection wrote before them to be durable.
_WAITS = frozenset({"WAITAOF", "WAIT"})


def _answer_all(askers: list[asyncio.Future[object]], sent: asyncio.Future[object]) -> None:
    """Give the reply of a durability wait sent once to every caller that asked for it."""
    error = sent.exception()
    for fut in askers:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(sent.result())


def _error(reply: _ErrorReply) -> redis.RedisError:
    """redis-py's exception for an error reply (``NOSCRIPT`` is a ``NoScriptError``, ``OOM``
    an ``OutOfMemoryError``, ...), as its own parsers make it."""
    err: redis.RedisError = BaseParser.parse_error(str(reply))  # type: ignore[no-untyped-call]
    return err


class _Protocol(asyncio.Protocol):
    """One connection: replies are matched to waiting commands in the order they were sent."""

    def __init__(self, lane: Lane) -> None:
        self.reader = hiredis.Reader(replyError=_ErrorReply)
        self.waiting: collections.deque[tuple[asyncio.Future[object], float]] = collections.deque()
        """Each command sent and not answered yet, with when it was sent."""
        self.transport: asyncio.Transport | None = None
        self.lost: redis.RedisError | None = None
        self.lane = lane
        self.reply_timeout_s = lane.reply_timeout_s
        self._out: list[bytes] = []
        self._waits: dict[bytes, list[asyncio.Future[object]]] = {}
        """The durability waits asked for since the last write, by command: each sent once,
        last, and its reply given to every caller that asked."""
        self._watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[object]]:
        """Queue ``commands``; they are written together with whatever else this turn of the
        event loop sends (one write, however many callers), and answered in order.

        A durability wait (``WAITAOF``, ``WAIT``) is not sent where it stands but once per
        write, after every other command of the write, and its reply answers each caller that
        asked for it: it covers every write the connection sent before it. Sent once per
        caller instead, it would block the connection once per caller (a wait holds back the
        commands behind it until the server's next fsync): 500 concurrent submissions took
        500 fsyncs in a row."""
        loop = asyncio.get_running_loop()
        if not self._out and not self._waits:
            loop.call_soon(self._flush)
        if self._watch is None:
            self._watch = loop.call_later(self.reply_timeout_s, self._overdue)
        now = loop.time()
        futures = []
        for command in commands:
            packed = hiredis.pack_command(tuple(command))
            fut: asyncio.Future[object] = loop.create_future()
            if str(command[0]).upper() in _WAITS:
                self._waits.setdefault(packed, []).append(fut)
            else:
                self._out.append(packed)
                self.waiting.append((fut, now))
            futures.append(fut)
        return futures

    def _overdue(self) -> None:
        """Close the connection if its oldest command has waited past the reply timeout (its
        replies are out of step then; every waiting caller hears it and sends again); one
        timer per connection, not one per command."""
        self._watch = None
        if not self.waiting:
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self.waiting[0][1]
        if waited >= self.reply_timeout_s:
            self._fail(redis.TimeoutError(f"Redis did not answer in {self.reply_timeout_s:g} s"))
            self.close()
        else:
            self._watch = loop.call_later(self.reply_timeout_s - waited, self._overdue)

    def _flush(self) -> None:
        out, self._out = self._out, []
        waits, self._waits = self._waits, {}
        now = asyncio.get_running_loop().time()
        for packed, askers in waits.items():
            out.append(packed)
            sent: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            sent.add_done_callback(functools.partial(_answer_all, askers))
            self.waiting.append((sent, now))
        if self.transport is None or self.transport.is_closing() or self.lost is not None:
            self._fail(self.lost or redis.ConnectionError("connection to Redis closing"))
            return
        self.transport.write(b"".join(out))
        self.lane.round_trips += 1

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut, _ = self.waiting.popleft()
            if not fut.done():  # a caller that gave up (cancelled) leaves its reply unread
                fut.set_result(_error(reply) if isinstance(reply, _ErrorReply) else reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis.ConnectionError(f"connection to Redis lost: {exc or 'closed'}"))
        if self._watch is not None:
            self._watch.cancel()

    def _fail(self, error: redis.RedisError) -> None:
        self.lost = self.lost or error
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Lane:
    """Commands to one server on one connection, opened when first needed (again after it was
    lost, or on another event loop)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        retry_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        reply_timeout_s: float = 30.0,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.retry_s = retry_s
        self.connect_timeout_s = connect_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.round_trips = 0
        """Writes sent so far: each carries every command queued in one turn of the event
        loop, whoever sent it."""
        self._proto: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None

    async def call(self, *command: Any) -> Any:
        """``command``'s reply; an error reply is raised (redis-py's class for it)."""
        (reply,) = await self.calls([command])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def calls(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Each command's reply, the commands sent consecutively on the connection (a
        durability wait after them covers them: see :meth:`_Protocol.send`); an error reply
        is returned as its exception, as
        a redis-py pipeline does with ``raise_on_error=False``. A lost connection sends them
        all again, for about ``retry_s``; past that, :class:`redis.ConnectionError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        backoff = _BACKOFF_S
        while True:
            try:
                proto = await self._connection()
                futures = proto.send(commands)
                return [await fut for fut in futures]  # bounded by the connection's timer
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if loop.time() + backoff > deadline:
                    if isinstance(exc, redis.RedisError):
                        raise
                    raise redis.ConnectionError(f"Redis at {self.host}:{self.port}: {exc}") from exc
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    async def _connection(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        proto = self._proto
        if proto is not None and proto.lost is None and self._loop is loop:
            return proto
        if self._opening is None or self._loop is not loop:
            self._opening, self._loop = asyncio.Lock(), loop
            self._proto = None
        async with self._opening:
            if self._proto is None or self._proto.lost is not None:
                self._proto = await self._open(loop)
            return self._proto

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        async with asyncio.timeout(self.connect_timeout_s):
            _, proto = await loop.create_connection(lambda: _Protocol(self), self.host, self.port)
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            auth = (self.username, self.password) if self.username else (self.password,)
            hello.append(("AUTH", *auth))
        if self.db:
            hello.append(("SELECT", self.db))
        async with asyncio.timeout(self.connect_timeout_s):
            for reply in [await fut for fut in proto.send(hello)]:
                if isinstance(reply, Exception):
                    proto.close()
                    raise reply
        return proto

    async def aclose(self) -> None:
        """Close the connection (a later call opens a new one)."""
        if self._proto is not None:
            self._proto.close()
            self._proto = None


class LaneRedis(aioredis.Redis):
    """redis-py's client of one server, with a :class:`Lane` to the same server beside it,
    closed with it."""

    def __init__(self, *args: Any, lane: Lane, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lane = lane

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await self.lane.aclose()
        await super().aclose(close_connection_pool)


def lane_of(client: object) -> Lane | None:
    """``client``'s lane, or None where commands go through redis-py only."""
    return client.lane if isinstance(client, LaneRedis) else None
