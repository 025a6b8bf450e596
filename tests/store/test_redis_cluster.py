"""phaseline on a real local Redis Cluster: the embedded cluster itself, a primary killed under
saves (its replica takes over, nothing acknowledged is lost), and the Ray runtime's turns on it
through a host SIGKILL. The store contract runs on the cluster too (``any_client``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import redis

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings, load_settings
from actors.harness.failover import failover_under_saves
from actors.harness.verdict import first_difference
from bus.errors import ConfigError, StoreError
from store.domain.effects import EffectCounters
from store.redis.connection import StoreClient, connect
from store.redis.embedded import free_port
from store.redis.embedded_cluster import SLOTS, EmbeddedCluster
from store.redis.nodes import is_redirect
from store.redis.urls import seed_urls
from tests.support.polling import eventually
from tests.support.reference import reference


@pytest.fixture
async def cluster_client(redis_cluster: EmbeddedCluster) -> AsyncIterator[StoreClient]:
    client = connect(redis_cluster.url, cluster=True)
    yield client
    await client.aclose()


def test_the_embedded_cluster_serves_every_slot_with_a_replica_per_primary(
    redis_cluster: EmbeddedCluster,
) -> None:
    nodes = redis_cluster.topology()
    primaries = [n for n in nodes if n.primary and not n.failed]
    replicas = [n for n in nodes if not n.primary]
    assert len(primaries) == 3 and len(replicas) == 3
    assert sorted(r.primary_id for r in replicas) == sorted(p.node_id for p in primaries)
    redis_cluster.wait_ok(timeout=30)  # raises unless cluster_slots_ok is all SLOTS
    assert SLOTS == 16384


async def test_a_primary_killed_under_saves_loses_no_save_acknowledged_with_wait() -> None:
    """``replicas:1``: every acknowledged save waited for the replica that takes over, even
    one that lagged 2 s behind its primary when the primary died."""
    with EmbeddedCluster() as cluster:
        report = await failover_under_saves(
            cluster, durability="replicas:1", turns=24, lag_s=2.0, payload_bytes=32_000
        )
    assert report.lost_saves == 0 and report.lost_turns == 0, report
    assert report.acknowledged >= 24 * 40, report  # every writer went on after the failover
    # The kill did interrupt the saves of its slot: they failed and were sent again, or (the
    # transport resending a round trip its connection lost, store.redis.transport) they waited for
    # the replica to take over.
    assert report.failed_saves > 0 or report.stall_s >= 1.0, report


async def test_without_wait_a_lagging_replica_loses_acknowledged_saves() -> None:
    """The known window, shown: under ``ack`` the saves a primary acknowledged while its
    replica lagged (2 s, and 2 MB held for it beyond its socket's buffers) are gone once that
    replica takes over (so the harness above can see a loss, and ``replicas:1`` is what
    closes it). The writers park before the kill: a save in flight at it is sent again to
    the promoted replica (the transport resends a round trip its connection lost) and, being
    the whole record, covers the loss it would show."""
    with EmbeddedCluster() as cluster:
        report = await failover_under_saves(
            cluster,
            durability="ack",
            turns=24,
            lag_s=2.0,
            unsent_bytes=2_000_000,
            payload_bytes=32_000,
            park_first=True,
        )
    assert report.lost_turns > 0 and report.lost_saves > 0, report


async def test_a_client_starts_through_another_seed_when_the_first_is_down(
    redis_cluster: EmbeddedCluster,
) -> None:
    """A seed URL whose first node does not answer (a dead primary) still reaches the cluster."""
    live = redis_cluster.seeds_url
    head, _, nodes = live.rpartition("@")
    dead = f"{head}@127.0.0.1:{free_port()},{nodes}"
    assert len(seed_urls(dead)) == 1 + len(redis_cluster.nodes)
    client = connect(dead, cluster=True, retry_s=0)
    try:
        await client.set("{s1}seed-check", b"1")
        assert await client.get("{s1}seed-check") == b"1"
    finally:
        await client.aclose()
    with pytest.raises(StoreError, match="cluster = true"):
        connect(live)  # several nodes are a cluster's seeds, never one server's


def test_cluster_settings_need_a_url(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_text("[redis]\ncluster = true\n")
    with pytest.raises(ConfigError, match="cluster = true needs url"):
        load_settings(bad)
    good = tmp_path / "good.toml"
    good.write_text('[redis]\ncluster = true\nurl = "redis://127.0.0.1:7000/0"\n')
    assert load_settings(good).redis.cluster


@pytest.mark.usefixtures("ray_cluster")
async def test_the_runtime_runs_turns_on_a_redis_cluster_through_a_host_kill(
    redis_cluster: EmbeddedCluster, cluster_client: StoreClient, namespace: str
) -> None:
    settings = Settings.model_validate({
        "redis": {"namespace": namespace, "url": redis_cluster.url, "cluster": True},
        "checkpoint": {"min_interval_s": 0},
        "loop": {"strict": True, "backoff_scale": 0.01},
        "supervisor": {"ping_interval_s": 0.2, "ping_timeout_s": 2.0},
    })  # fmt: skip
    sc = parse_scenario({"name": "cluster", "rounds": 4, "tools_per_round": 2,
                         "tools": ["echo", "counter_increment"], "llm_latency_ms": 150,
                         "tool_latency_ms": 10, "payload_bytes": 200})  # fmt: skip
    ids = [f"k{i:02d}" for i in range(24)]
    rt = await Runtime.start(settings, redis_url=redis_cluster.url, hosts=2)
    try:
        await rt.submit(*scripted_turn(sc), ids)

        async def saving() -> bool:
            moves = 0
            for s in rt.dep.keys.all_shards():
                moves += await cluster_client.xlen(rt.dep.keys.events(s))
            return moves >= len(ids) + 24

        await eventually(saving, timeout=60, what="checkpoints on the cluster")
        pid = await rt.kill_host(rt.dep.slot_of(ids[0]))

        async def gone() -> bool:
            return not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"

        await eventually(gone, timeout=10, what="the host process to die")
        finals = await rt.wait(ids, timeout=180)
        ref = await reference(cluster_client, sc, ids)
        effects = EffectCounters(cluster_client, rt.dep.keys)
        for tid in ids:
            assert not finals[tid].in_progress, tid
            # a non-idempotent call in flight at the kill is answered outcome_unknown, not re-run
            assert first_difference(finals[tid].messages, ref[tid].messages) is None, tid
            assert all(n <= 1 for n in (await effects.counts(tid)).values()), tid
        assert any(f.counters.resume_attempts for f in finals.values())
        assert await rt.store.list_in_progress() == []
    finally:
        await rt.shutdown()


def test_a_parsed_moved_reply_counts_as_a_redirect() -> None:
    """redis-py parses MOVED into a MovedError whose text lost the code; a save answered with
    it must refresh the slot map and be sent again, not fail (a chaos run's submissions after a
    failover failed forever on it)."""
    assert is_redirect(redis.exceptions.MovedError("4494 127.0.0.1:30319"))
    assert is_redirect(redis.exceptions.ResponseError("MOVED 4494 127.0.0.1:30319"))
    assert is_redirect(redis.exceptions.ClusterDownError("The cluster is down"))
    assert not is_redirect(redis.exceptions.ResponseError("WRONGTYPE"))
