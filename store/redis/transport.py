"""One transport to Redis: commands sent to the node that holds a key, in one round trip.

Every write path of the store goes through :meth:`Transport.send` (the saves, the ledger's
scripts, a turn's start) or, for the one interactive exchange (``WATCH`` ... ``EXEC``),
:meth:`Transport.on_node`. The rules live here once:

* **NOSCRIPT**: a server that lost its script cache (a restart, a failover) answers an
  ``EVALSHA`` with ``NOSCRIPT`` and runs nothing, so the script is loaded and only those
  commands go again, in the same round trip as the load;
* **redirects**: a Redis Cluster whose slot moved (``MOVED``, ``ASK``, ``TRYAGAIN``,
  ``CLUSTERDOWN``) ran nothing either; the client reads the slot map again and those commands
  go to the slot's node now, up to :data:`REDIRECT_ATTEMPTS` times, then
  :class:`~bus.errors.StoreUnavailable`;
* **durability**: the wait (``WAIT``/``WAITAOF``) goes last on the same connection, so it
  covers the writes before it; each command's answer comes with the wait's of its round.

Its implementations are chosen once per client (:func:`transport_of`): the lean connection
(:class:`~store.redis.lane.Lane`) of a plain-TCP server, else a raw connection from redis-py's pool
to the node that holds the key (:func:`~store.redis.nodes.node_connection`). Error replies come back
as their exceptions, in order; a dropped connection raises.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry

from bus.errors import StoreUnavailable
from store.lua import all_scripts
from store.redis.connection import StoreClient
from store.redis.lane import Lane, lane_of
from store.redis.nodes import is_redirect, node_connection, refresh_topology, roundtrip

__all__ = ["REDIRECT_ATTEMPTS", "Command", "Moved", "Sent", "Transport", "transport_of"]

#: Tries of one command whose slot keeps moving (each after the slot map is read again): a
#: failover takes a few.
REDIRECT_ATTEMPTS = 5

#: One command: its name and arguments.
Command = tuple[Any, ...]

_T = TypeVar("_T")

#: Every script of the store by its SHA1: what a ``NOSCRIPT`` answer is loaded again from.
_SCRIPTS = {hashlib.sha1(text.encode()).hexdigest(): text for text in all_scripts()}


class Moved(Exception):
    """Raised by an :meth:`Transport.on_node` exchange whose node answered a redirect: it ran
    nothing; the exchange is done again on the slot's node now."""


@dataclass(frozen=True, slots=True)
class Sent:
    """The answers of one :meth:`Transport.send`."""

    replies: list[object]
    """Each command's reply, or the exception Redis answered for it, in order."""
    waits: list[object]
    """Per command, the durability wait's reply of the round trip that carried it (None
    without a wait)."""


class Transport:
    """Sends commands to Redis by the rules above, on one client."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self._lane: Lane | None = lane_of(client)
        self._retry: Retry | None = (
            client.retry if isinstance(client, aioredis.RedisCluster) else client.get_retry()
        )
        self.round_trips = 0
        """Round trips sent so far."""

    async def send(
        self, key: str, commands: Sequence[Command], *, wait: Command | None = None
    ) -> Sent:
        """``commands`` on the connection of the node that holds ``key`` (every key of one
        call shares its slot), then ``wait`` if given; again, by the rules above, for those
        that ran nothing."""
        replies: list[object] = [None] * len(commands)
        waits: list[object] = [None] * len(commands)
        todo = list(range(len(commands)))
        load: list[str] = []
        for _ in range(REDIRECT_ATTEMPTS):
            batch = [("SCRIPT", "LOAD", _SCRIPTS[sha]) for sha in load]
            batch += [commands[i] for i in todo] + ([wait] if wait is not None else [])
            got = (await self._roundtrip(key, batch))[len(load) :]
            waited = got.pop() if wait is not None else None
            for i, reply in zip(todo, got, strict=True):
                replies[i], waits[i] = reply, waited
            lost = [i for i in todo if _lost_script(commands[i], replies[i])]
            moved = [i for i in todo if is_redirect(replies[i])]
            if not lost and not moved:
                break
            load = list(dict.fromkeys(str(commands[i][1]) for i in lost))
            todo = sorted(lost + moved)
            if moved:
                await refresh_topology(self.client)
        for i, reply in enumerate(replies):
            if is_redirect(reply):
                replies[i] = StoreUnavailable(f"the slot of {key} kept moving: {reply}")
        return Sent(replies, waits)

    async def on_node(self, key: str, exchange: Callable[[Any], Awaitable[_T]]) -> _T:
        """``exchange(conn)`` on a raw connection to the node that holds ``key``, done again
        on the slot's node now when it raises :class:`Moved`."""
        for _ in range(REDIRECT_ATTEMPTS):
            try:
                async with node_connection(self.client, key) as conn:
                    return await exchange(conn)
            except Moved:
                await refresh_topology(self.client)
        raise StoreUnavailable(f"the slot of {key} kept moving; try again")

    async def _roundtrip(self, key: str, batch: list[Command]) -> list[object]:
        """One round trip; a lost connection sends it again for as long as the client's
        retry policy allows (``store.redis.connection``), as the lane does: every command here is
        safe to send twice (a fenced script that ran answers a replay as such)."""
        self.round_trips += 1
        if self._lane is not None:
            return await self._lane.calls(batch)

        async def once() -> list[object]:
            async with node_connection(self.client, key) as conn:
                return await roundtrip(conn, batch)

        if self._retry is None:
            return await once()
        return await self._retry.call_with_retry(once, _no_cleanup)


async def _no_cleanup(_error: Exception) -> None:
    """Nothing to undo between tries: the node connection is dropped on an error."""


def _lost_script(command: Command, reply: object) -> bool:
    """Whether ``reply`` says the server did not have ``command``'s script (it ran nothing)."""
    return (
        isinstance(reply, redis.exceptions.NoScriptError)
        and command[0] == "EVALSHA"
        and str(command[1]) in _SCRIPTS
    )


_TRANSPORTS: weakref.WeakKeyDictionary[Any, Transport] = weakref.WeakKeyDictionary()


def transport_of(client: StoreClient | aioredis.Redis) -> Transport:
    """The client's transport, made once."""
    found = _TRANSPORTS.get(client)
    if found is None:
        found = _TRANSPORTS[client] = Transport(client)
    return found
