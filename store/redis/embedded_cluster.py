"""A local Redis Cluster of embedded servers: primaries with a replica each, for tests and
chaos runs that need the real thing (slots, ``MOVED``, a failover when a primary dies).

Each node is an :class:`~store.redis.embedded.EmbeddedRedis` started with ``cluster-enabled yes``
(same binary, same AOF and password rules). The cluster is formed the way ``redis-cli
--cluster create`` forms it, with the same commands sent from here: ``CLUSTER ADDSLOTS`` an
equal range per primary, ``CLUSTER MEET`` every node, ``CLUSTER REPLICATE`` each replica to
its primary, then wait until every node says ``cluster_state:ok`` and every replica's link is
up. Doing it here rather than through ``redis-cli`` keeps the primary/replica pairing fixed (a
test knows which node to kill) and needs no second binary.

A primary that is SIGKILLed (:meth:`EmbeddedCluster.kill`) is replaced by its replica after
``cluster-node-timeout``; :meth:`EmbeddedCluster.revive` starts it again and it rejoins as a
replica of the node that took over (its ``nodes.conf`` remembers the cluster).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis

from bus.errors import StoreError
from store.redis.embedded import EmbeddedRedis, free_port

__all__ = ["SLOTS", "ClusterNodeInfo", "EmbeddedCluster"]

SLOTS = 16384
"""Hash slots of a Redis Cluster."""

_BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000


@dataclass(frozen=True, slots=True)
class ClusterNodeInfo:
    """One node as the cluster sees it (a line of ``CLUSTER NODES``)."""

    node_id: str
    """The node's 40-character cluster id."""
    port: int
    """Its client port on 127.0.0.1."""
    primary: bool
    """True for a primary (``master``), False for a replica."""
    failed: bool
    """True if the cluster marks it ``fail`` (or ``fail?``)."""
    primary_id: str | None
    """For a replica, the id of its primary."""


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too and below 65536."""
    for _ in range(200):
        port = free_port()
        if port + _BUS_OFFSET >= 65536:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + _BUS_OFFSET))
            except OSError:
                continue
        return port
    raise StoreError("no free port pair (client, bus) for a cluster node")


class EmbeddedCluster:
    """``primaries`` primaries with ``replicas`` replicas each, on 127.0.0.1."""

    def __init__(
        self,
        *,
        data_dir: str | Path | None = None,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        appendfsync: str = "everysec",
        startup_timeout: float = 60.0,
    ) -> None:
        if primaries < 1 or replicas < 0:
            raise StoreError("a cluster needs at least one primary and no negative replicas")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="phaseline-cluster-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir).resolve()
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.appendfsync = appendfsync
        self.startup_timeout = startup_timeout
        self.password = secrets.token_urlsafe(24)
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        """A URL of one live node: what a cluster client starts from (it learns the rest)."""
        for node in self.nodes:
            if node.process is not None:
                return node.url
        raise StoreError("embedded cluster is not running")

    @property
    def seeds_url(self) -> str:
        """A URL naming every node as a seed (``store.redis.urls.seed_urls``): what a client
        needs that must start while any one node, a killed primary say, is down."""
        if not self.nodes:
            raise StoreError("embedded cluster is not running")
        first = self.nodes[0].url
        head, _, _ = first.rpartition("@")
        return f"{head}@" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> str:
        """Start every node, form the cluster, wait until it serves every slot; its URL."""
        try:
            for i in range(self.primaries * (1 + self.replicas)):
                self.nodes.append(self._start_node(i))
            self._form()
            self.wait_ok()
            return self.url
        except BaseException:
            self.stop()
            raise

    def _start_node(self, index: int) -> EmbeddedRedis:
        last: StoreError | None = None
        for _ in range(5):
            node = EmbeddedRedis(
                data_dir=self.data_dir / f"node{index}",
                port=_cluster_port(),
                appendfsync=self.appendfsync,
                password=self.password,
                extra_config=[
                    "cluster-enabled yes",
                    "cluster-config-file nodes.conf",
                    f"cluster-node-timeout {self.node_timeout_ms}",
                    f"masterauth {self.password}",
                    # a replica may take over however stale: tests kill primaries on purpose
                    "cluster-replica-validity-factor 0",
                ],
            )
            try:
                node.start()
                return node
            except StoreError as exc:  # lost the port to someone else: another pair
                last = exc
        raise StoreError(f"cluster node {index} did not start: {last}")

    def _client(self, node: EmbeddedRedis) -> redis.Redis:
        assert node.port is not None
        return redis.Redis(
            host="127.0.0.1", port=node.port, password=self.password, socket_timeout=5
        )

    def _form(self) -> None:
        primaries = self.nodes[: self.primaries]
        bounds = [SLOTS * i // self.primaries for i in range(self.primaries + 1)]
        for node, lo, hi in zip(primaries, bounds, bounds[1:], strict=False):
            with self._client(node) as c:
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
        with self._client(self.nodes[0]) as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        # By id, not by count: a node still in the MEET handshake is listed under a temporary
        # id, and CLUSTER REPLICATE of the real one answers "Unknown node" until it is done.
        own = {self._own_id(n) for n in self.nodes}
        self._until(
            lambda: all({i.node_id for i in self.topology(n)} == own for n in self.nodes),
            "every node to know every other",
        )
        ids = [self._own_id(n) for n in primaries]
        for j, node in enumerate(self.nodes[self.primaries :]):
            with self._client(node) as c:
                c.execute_command("CLUSTER", "REPLICATE", ids[j % self.primaries])

    def _own_id(self, node: EmbeddedRedis) -> str:
        with self._client(node) as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def topology(self, node: EmbeddedRedis | None = None) -> list[ClusterNodeInfo]:
        """The cluster as ``node`` (default: the first live one) sees it."""
        node = node or next(n for n in self.nodes if n.process is not None)
        with self._client(node) as c:
            raw = c.execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        out = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            flags = parts[2].split(",")
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1] or 0)
            out.append(
                ClusterNodeInfo(
                    node_id=parts[0],
                    port=port,
                    primary="master" in flags,
                    failed="fail" in flags or "fail?" in flags,
                    primary_id=None if parts[3] == "-" else parts[3],
                )
            )
        return out

    def _healthy(self, node: EmbeddedRedis) -> bool:
        try:
            with self._client(node) as c:
                info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text or f"cluster_slots_ok:{SLOTS}" not in text:
                    return False
                repl = c.info("replication")
        except redis.RedisError:
            return False
        return bool(repl.get("role") != "slave" or repl.get("master_link_status") == "up")

    def wait_ok(self, timeout: float | None = None) -> None:
        """Wait until every live node serves all slots and every live replica is in sync."""
        self._until(
            lambda: all(self._healthy(n) for n in self.nodes if n.process is not None),
            "the cluster to serve every slot",
            timeout,
        )

    def _until(self, done: object, what: str, timeout: float | None = None) -> None:
        assert callable(done)
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while not done():
            if time.monotonic() > deadline:
                raise StoreError(f"embedded cluster: timed out waiting for {what}")
            time.sleep(0.05)  # polling the cluster's own state, bounded by the deadline

    def primary_nodes(self) -> list[EmbeddedRedis]:
        """The live nodes that are primaries now (a failover changes which)."""
        ports = {i.port for i in self.topology() if i.primary and not i.failed}
        return [n for n in self.nodes if n.port in ports and n.process is not None]

    def node_of_port(self, port: int) -> EmbeddedRedis:
        """The node listening on ``port``."""
        for node in self.nodes:
            if node.port == port:
                return node
        raise StoreError(f"no cluster node on port {port}")

    def wait_failover(self, dead: EmbeddedRedis, timeout: float | None = None) -> None:
        """Wait until the slots of a killed primary are served by another node again."""

        def taken_over() -> bool:
            with contextlib.suppress(redis.RedisError, StopIteration):
                seen = self.topology()
                return all(i.port != dead.port or not i.primary or i.failed for i in seen) and (
                    all(self._healthy(n) for n in self.nodes if n.process is not None)
                )
            return False

        self._until(taken_over, f"a replica to take over from port {dead.port}", timeout)

    def replica_of(self, primary: EmbeddedRedis) -> EmbeddedRedis:
        """The live replica of a primary."""
        seen = self.topology()
        own = next(i.node_id for i in seen if i.port == primary.port)
        for info in seen:
            if info.primary_id == own and not info.failed:
                return self.node_of_port(info.port)
        raise StoreError(f"the primary on port {primary.port} has no live replica")

    def unsent_to_replicas(self, primary: EmbeddedRedis) -> int:
        """Bytes of the replication stream ``primary`` holds for its replicas and has not
        written to their sockets (the ``omem`` of its replica connections): what a replica
        cannot have when the primary dies now."""
        with self._client(primary) as c:
            return sum(int(conn.get("omem", 0)) for conn in c.client_list(_type="replica"))

    def fail_over(
        self,
        primary: EmbeddedRedis,
        *,
        lag_s: float = 0.0,
        unsent_bytes: int = 0,
        before_kill: Callable[[], None] | None = None,
        on_kill: Callable[[], None] | None = None,
    ) -> tuple[float, float]:
        """SIGKILL a primary, wait until its replica serves its slots, start it again and wait
        until it is back in sync as a replica (as an operator's restart brings it back; until
        then its slots have no replica). Seconds from the kill to each of the two.

        ``lag_s``: first hold the replica stopped (SIGSTOP) for that long, so the primary's
        writes of that time have not reached it when the primary dies, as a replica behind a
        slow or partitioned link would be; it is let go (SIGCONT) right after the kill. On one
        machine this is how the window of asynchronous replication is opened at all.
        ``unsent_bytes``: then hold it until the primary keeps at least that many bytes for it
        that are not even in the kernel's socket buffers (:meth:`unsent_to_replicas`). A
        stopped process's socket still takes a few MB, and a replica that read them when let
        go lost nothing: time alone opened the window only on a machine fast enough to write
        past them. ``before_kill`` is called just before the SIGKILL, ``on_kill`` right after
        it."""
        stopped = None
        if lag_s > 0 or unsent_bytes > 0:
            stopped = self.replica_of(primary)
            assert stopped.process is not None
            stopped.process.send_signal(signal.SIGSTOP)
            time.sleep(lag_s)  # the replica's lag: the writes of this time never reach it
            self._until(
                lambda: self.unsent_to_replicas(primary) >= unsent_bytes,
                f"{unsent_bytes} bytes held for the stopped replica",
            )
        if before_kill is not None:
            before_kill()
        down = time.monotonic()
        primary.kill()
        if on_kill is not None:
            on_kill()
        if stopped is not None and stopped.process is not None:
            stopped.process.send_signal(signal.SIGCONT)
        self.wait_failover(primary)
        served = time.monotonic() - down
        primary.revive()  # it rejoins, as a replica of the node that took over
        self.wait_ok()
        return served, time.monotonic() - down

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove a temporary data directory."""
        for node in self.nodes:
            node.stop()  # a killed node is only unlocked
        self.nodes = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
