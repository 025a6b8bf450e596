"""Host leases (store.domain.leases): held while renewed, lapsed after their ttl, one per
generation. On fakeredis, the real server and the real Redis Cluster alike (the store contract)."""

from __future__ import annotations

import time

import pytest

from store.domain.leases import HostLeases
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from tests.support.polling import eventually


async def test_a_lease_is_held_while_renewed_and_lapses_after_its_ttl(
    any_client: StoreClient, keys: KeyLayout
) -> None:
    leases = HostLeases(any_client, keys, ttl_s=0.3)
    assert leases.renew_every_s == pytest.approx(0.075)
    assert not await leases.held(0, 1)  # never granted
    await leases.renew(0, 1)
    granted = time.monotonic()
    assert await leases.held(0, 1)

    async def lapsed() -> bool:
        return not await leases.held(0, 1)

    await eventually(lapsed, timeout=5, what="the lease to lapse")
    assert time.monotonic() - granted >= 0.25  # not before its ttl (the server's clock)


async def test_a_zombie_renews_only_its_own_generation(
    any_client: StoreClient, keys: KeyLayout
) -> None:
    leases = HostLeases(any_client, keys, ttl_s=5)
    await leases.renew(0, 1)  # the old generation wakes up and renews
    assert await leases.held(0, 1) and not await leases.held(0, 2)
    await leases.renew(0, 2)
    assert await leases.held(0, 2) and not await leases.held(1, 2)  # per slot, too
