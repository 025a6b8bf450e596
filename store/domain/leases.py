"""Host leases: how the Supervisor tells a frozen host from a live one, in one Redis read.

An active host renews ``KeyLayout.lease(slot, generation)`` (``SET ... PX ttl``) every quarter
of ``ttl`` from its own event loop. A host that stops running (SIGSTOP, a wedged loop, a
machine cut off) stops renewing, and its lease lapses within ``ttl`` of its last renewal. The
Supervisor reads a slot's lease at each watch tick; a lapsed lease is confirmed by one short
ping (a host that only lost Redis for a while, during a restart or a failover, still answers
Ray and is kept; one cut off from Redis alone for long is replaced,
``actors.cluster.supervisor``), and the host is replaced. That takes about ``ttl`` plus one
tick and one ping after a freeze, where counting missed pings took ``misses x timeout``.

A key per generation, not per slot: a zombie that wakes up renews its own generation's key
and can never refresh, or overwrite, its successor's lease.
"""

from __future__ import annotations

from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.failures import translated

__all__ = ["HostLeases"]


class HostLeases:
    """Grant, renew and read host leases of one deployment."""

    def __init__(self, client: StoreClient, keys: KeyLayout, *, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = max(1, int(ttl_s * 1000))

    @property
    def renew_every_s(self) -> float:
        """How often a host renews: four renewals per lease, so one late renewal (a busy loop,
        a slow Redis) does not let it lapse."""
        return self.ttl_ms / 4000

    async def renew(self, slot: int, generation: int) -> None:
        """Hold (or grant) the lease of ``slot``'s ``generation`` for another ``ttl``."""
        with translated(f"renew the lease of host slot {slot}"):
            await self.client.set(self.keys.lease(slot, generation), b"1", px=self.ttl_ms)

    async def held(self, slot: int, generation: int) -> bool:
        """True while the lease has not lapsed."""
        with translated(f"read the lease of host slot {slot}"):
            return bool(await self.client.exists(self.keys.lease(slot, generation)))
