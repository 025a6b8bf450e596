"""The runtime on several Ray nodes (``ray.cluster_utils.Cluster``, several raylets on this
machine): a slot's standby never shares its active host's node, and a whole worker node lost
mid-turn (its raylet and every worker on it) loses no turn and runs no call twice."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.cluster.info import HostInfo
from actors.cluster.refs import HostRef, SupervisorRef
from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from store.domain.effects import EffectCounters
from store.redis.connection import StoreClient
from tests.cluster.test_ray_runtime import settings
from tests.support.polling import eventually
from tests.support.reference import reference

pytestmark = pytest.mark.usefixtures("ray_cluster")


async def _standby_info(rt: Runtime, host: HostInfo) -> HostInfo:
    name = rt.dep.host_name(host.slot, host.generation + 1)
    standby = HostRef.named(name)
    if standby is None:
        raise ValueError(f"no standby {name} is registered")
    return await standby.hello()


async def test_a_slots_standby_runs_on_another_node_than_its_active_host(
    ray_cluster: Cluster, redis_url: str, namespace: str
) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) >= 2  # the session's two raylets
    rt = await Runtime.start(settings(namespace), redis_url=redis_url, hosts=3)
    try:
        hosts = await rt.host_info()
        assert hosts and all(h.node_id for h in hosts)
        standbys = {s.slot: s for s in await rt.standbys(timeout=60)}  # each answered once up
        assert sorted(standbys) == list(rt.dep.slots())  # the isolation slot's too
        for host in hosts:
            standby = standbys[host.slot]
            assert standby.generation == host.generation + 1, host.slot
            assert standby.node_id != host.node_id, (host.slot, host.node_id)
    finally:
        await rt.shutdown()


async def test_losing_a_worker_node_mid_turn_loses_no_turn_and_runs_no_call_twice(
    ray_cluster: Cluster, redis_url: str, real_client: StoreClient, namespace: str
) -> None:
    # Turns of about 4 s: a host whose raylet was killed may go on for a moment (its turns need
    # only Redis and the tool workers), and one CI run saw the lost host's turns all end without
    # a resume; they must have well more than that moment left when the node goes.
    sc = parse_scenario({"name": "nodes", "rounds": 6, "tools_per_round": 2,
                         "tools": ["echo", "counter_increment"], "llm_latency_ms": 300,
                         "tool_latency_ms": 300, "payload_bytes": 200})  # fmt: skip
    ids = [f"n{i:02d}" for i in range(30)]
    rt = await Runtime.start(settings(namespace), redis_url=redis_url, hosts=4)
    try:
        await rt.submit(*scripted_turn(sc), ids)
        head = ray_cluster.head_node.node_id
        hosts = await rt.host_info()
        by_node = {n.node_id: n for n in ray_cluster.worker_nodes}
        victims = [h for h in hosts if h.node_id in by_node and h.node_id != head]
        assert victims, f"no active host on a worker node: {[h.node_id for h in hosts]}"
        node = by_node[victims[0].node_id]
        lost = {h.slot for h in hosts if h.node_id == victims[0].node_id}
        theirs = [t for t in ids if rt.dep.slot_of(t) in lost]
        assert theirs, f"no turn on the hosts of the node to remove (slots {lost})"

        async def saving() -> bool:  # every turn of the lost hosts past its first tool batch
            return all([(await rt.store.load(t)).seq >= 2 for t in theirs])

        await eventually(saving, timeout=60, what="the lost hosts' turns checkpointed")
        ray_cluster.remove_node(node, allow_graceful=False)  # its raylet and all its workers
        running = [t for t in theirs if (await rt.store.load(t)).in_progress]
        assert running, "the lost hosts' turns ended before their node went"
        ray_cluster.add_node(num_cpus=1, include_dashboard=False)  # a fresh node joins
        finals = await rt.wait(ids, timeout=240)
        ref = await reference(real_client, sc, ids)
        effects = EffectCounters(real_client, rt.dep.keys)
        for tid in ids:
            assert not finals[tid].in_progress, tid
            assert all(n <= 1 for n in (await effects.counts(tid)).values()), tid  # never twice
            results = [m.tool_result for m in finals[tid].messages if m.tool_result]
            if all(r.status == "ok" for r in results):
                assert finals[tid].messages == ref[tid].messages, tid
        moved = {h.slot for h in victims}
        resumed = [t for t in ids if finals[t].counters.resume_attempts]
        assert resumed and all(rt.dep.slot_of(t) in moved for t in resumed)
        assert await rt.respawns() >= len(moved)
        assert await rt.store.list_in_progress() == []
    finally:
        await rt.shutdown()


async def test_the_singletons_run_on_the_head_node(
    ray_cluster: Cluster, redis_url: str, namespace: str
) -> None:
    """A worker node's loss must not take the Supervisor, CheckpointActor, WatchdogActor or
    RecoveryActor with it (every turn of the deployment would wait for their restart)."""
    rt = await Runtime.start(settings(namespace), redis_url=redis_url, hosts=2)
    try:
        head = ray_cluster.head_node.node_id
        for role in ("supervisor", "checkpoint", "watchdog", "recovery"):
            ref = (
                SupervisorRef.named(rt.dep.name(role)) if role == "supervisor" else rt.service(role)
            )
            assert ref is not None, role
            assert (await ref.hello()).node_id == head, role
    finally:
        await rt.shutdown()


async def test_a_standby_lost_with_its_node_is_started_again(
    ray_cluster: Cluster, redis_url: str, namespace: str
) -> None:
    """The node a standby ran on is lost while its active host lives on: the Supervisor
    starts the standby again, so the next loss of the active host costs no process start."""
    rt = await Runtime.start(settings(namespace), redis_url=redis_url, hosts=2)
    try:
        head = ray_cluster.head_node.node_id
        workers = {n.node_id: n for n in ray_cluster.worker_nodes}
        standbys = {s.slot: s for s in await rt.standbys(timeout=60)}
        pairs = [(h, standbys[h.slot]) for h in await rt.host_info()]
        lonely = [(h, s) for h, s in pairs if h.node_id == head and s.node_id in workers]
        assert lonely, [(h.node_id, s.node_id) for h, s in pairs]
        host, standby = lonely[0]
        ray_cluster.remove_node(workers[standby.node_id], allow_graceful=False)
        ray_cluster.add_node(num_cpus=1, include_dashboard=False)

        async def started_again() -> bool:
            try:
                return (await _standby_info(rt, host)).incarnation != standby.incarnation
            except (ValueError, ray.exceptions.RayActorError):
                return False

        await eventually(started_again, timeout=60, what="the lost standby started again")
        assert [h.generation for h in await rt.host_info() if h.slot == host.slot] == [
            host.generation
        ]  # its active host was left alone
    finally:
        await rt.shutdown()
