"""A TCP proxy a chaos run can cut: what a network partition is to the processes behind it.

Each :class:`TcpProxy` listens on a loopback port and relays every connection to one upstream
address. :meth:`TcpProxy.cut` makes it a partition: bytes stop flowing both ways on the open
connections and new ones are accepted but never reach the upstream, so a client sees silence
(its reads time out) rather than a refusal, as a cut link behaves; :meth:`TcpProxy.restore`
lets the held bytes through and new connections reach the upstream again, as TCP's
retransmission would. :meth:`TcpProxy.refuse` is a dead endpoint instead: connections are
closed as they come and the open ones dropped.

The proxies run on one :class:`ProxyLoop`, an event loop in a daemon thread of its own: they
keep relaying while the chaos run's loop waits on turns, and sync code can drive them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from enum import StrEnum
from typing import Any, TypeVar

__all__ = ["Link", "ProxyLoop", "TcpProxy"]

T = TypeVar("T")

#: Bytes relayed per read.
CHUNK = 65_536


class Link(StrEnum):
    """What a proxy does with the bytes it is given."""

    OPEN = "open"
    """Relays them."""
    CUT = "cut"
    """Holds them (a partition): nothing arrives, nothing is refused."""
    REFUSED = "refused"
    """Closes every connection (a dead endpoint)."""


class ProxyLoop:
    """An asyncio loop in a daemon thread, for proxies that must not wait on the caller's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxies", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the loop and wait for it (from any thread but the loop's)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        """Cancel what still relays, then stop the loop and its thread."""
        with contextlib.suppress(TimeoutError, RuntimeError):
            self.run(_cancel_all(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class TcpProxy:
    """Relays a loopback port to ``upstream`` (``host``, ``port``) until cut or refused."""

    def __init__(self, loop: ProxyLoop, upstream: tuple[str, int]) -> None:
        self._loop = loop
        self.upstream = upstream
        self.link = Link.OPEN
        self._open = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server = loop.run(self._start())
        self.port: int = self._server.sockets[0].getsockname()[1]
        self.held_connections = 0
        """Connections that arrived while the link was cut (what a partition caught)."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> asyncio.Server:
        self._open.set()
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def cut(self) -> None:
        """Hold every byte from now on, both ways, and every new connection."""
        self._loop.run(self._set(Link.CUT))

    def restore(self) -> None:
        """Relay again: what was held goes through."""
        self._loop.run(self._set(Link.OPEN))

    def refuse(self) -> None:
        """Close every connection, open or new, until :meth:`restore`."""
        self._loop.run(self._set(Link.REFUSED))

    async def _set(self, link: Link) -> None:
        self.link = link
        if link is Link.OPEN:
            self._open.set()
            return
        self._open.clear()
        if link is Link.REFUSED:
            for writer in list(self._writers):
                writer.transport.abort()

    def close(self) -> None:
        self._loop.run(self._close())

    async def _close(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._open.set()  # held relays wake up to find their connections gone

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.link is Link.REFUSED:
            writer.transport.abort()
            return
        if self.link is Link.CUT:
            self.held_connections += 1
        self._writers.add(writer)
        try:
            await self._open.wait()
            if self.link is not Link.OPEN:  # refused while it was held
                return
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Relay one direction until its end closes; wait while the link is cut."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._open.wait()
                if self.link is not Link.OPEN:
                    break
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()
