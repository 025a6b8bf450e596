"""One deployment per namespace (``store.domain.ownership``): the lease's rules on fakeredis, a real
server and a Redis Cluster, then on Ray: clients beside the owner leave its deployment running,
and a second deployment elsewhere is refused with the holder's name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from bus.errors import NamespaceHeld, RecordError
from store.domain.ownership import ClaimOutcome, Holder, NamespaceOwner
from store.keys import KeyLayout
from store.redis.connection import StoreClient, connect
from tests.support.polling import eventually
from tests.support.processes import PHASELINE, ROOT, phaseline


def holder(cluster: str, token: str, pid: int = 1) -> Holder:
    return Holder(cluster, token, "host-x", pid, "phaseline serve")


async def test_a_free_namespace_is_claimed_and_another_cluster_is_refused(
    any_client: StoreClient, keys: KeyLayout
) -> None:
    owners = NamespaceOwner(any_client, keys, ttl_s=20)
    first = await owners.claim(holder("cluster-a", "tok-a"))
    assert first.claim is ClaimOutcome.ACQUIRED and first.holder.since_ms > 0
    with pytest.raises(NamespaceHeld) as refused:
        await owners.claim(holder("cluster-b", "tok-b"))
    assert "phaseline serve (pid 1 on host-x, Ray cluster cluster-a)" in str(refused.value)
    # its own cluster finds the deployment and attaches; the owner stays
    same = await owners.claim(holder("cluster-a", "tok-a2"))
    assert same.claim is ClaimOutcome.SAME_CLUSTER and same.holder.owner == "tok-a"
    # a takeover names the owner it replaces, and only that one
    wrong = await owners.claim(holder("cluster-a", "tok-a2"), replacing="tok-x")
    assert wrong.claim is ClaimOutcome.SAME_CLUSTER
    took = await owners.claim(holder("cluster-a", "tok-a2", pid=2), replacing="tok-a")
    assert took.claim is ClaimOutcome.ACQUIRED
    assert took.holder.owner == "tok-a2" and took.holder.pid == 2
    # the deployment of another cluster cannot renew it; only the owner releases it
    assert await owners.renew("cluster-b", None) is False
    assert await owners.renew("cluster-a", None) is True
    assert await owners.release("tok-a") is False
    last = await owners.holder()
    assert last is not None and last.owner == "tok-a2"
    assert await owners.release("tok-a2") is True and await owners.holder() is None
    # a deployment whose lease lapsed writes it back if no one took it meanwhile
    assert await owners.renew("cluster-a", None) is False
    assert await owners.renew("cluster-a", last) is True
    assert await owners.holder() == last


async def test_a_lapsed_lease_is_taken_by_the_next_claim(
    any_client: StoreClient, keys: KeyLayout
) -> None:
    owners = NamespaceOwner(any_client, keys, ttl_s=1)
    await owners.claim(holder("cluster-a", "tok-a"))

    async def lapsed() -> bool:
        return await owners.holder() is None

    await eventually(lapsed, timeout=10, what="the lease to lapse")
    assert (await owners.claim(holder("cluster-b", "tok-b"))).claim is ClaimOutcome.ACQUIRED
    assert await owners.renew("cluster-a", holder("cluster-a", "tok-a")) is False


@pytest.mark.usefixtures("ray_cluster")
async def test_clients_beside_the_owner_leave_its_deployment_running(
    redis_url: str, namespace: str, ray_cluster: Cluster, tmp_path: Path
) -> None:
    settings = Settings.model_validate(
        {"redis": {"namespace": namespace}, "checkpoint": {"min_interval_s": 0}}
    )
    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "own"\nrounds = 2\ntools_per_round = 1\nllm_latency_ms = 5\n')
    where = ["--redis-url", redis_url, "--namespace", namespace]
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    try:
        assert rt.owner is not None
        # a run on the same Ray cluster attaches: its turns run, its end stops nothing
        code, out = await phaseline(
            "run", *where, "--ray-address", ray_cluster.address, "--scenario", str(scenario),
            "--turns", "3", "--hosts", "1", "--run-id", "client",
        )  # fmt: skip
        assert code == 0 and "answered" in out, out
        # status and watch look, and leave it running
        code, out = await phaseline("status", *where, "--ray-address", ray_cluster.address)
        assert code == 0 and "host0" in out, out
        code, out = await phaseline("watch", *where, "client-t000000")
        assert code == 0 and "answered" in out, out
        code, out = await phaseline("turns", *where, "--json")
        listed = {json.loads(line)["turn_id"] for line in out.splitlines() if line.startswith("{")}
        assert code == 0 and {f"client-t00000{i}" for i in range(3)} <= listed, out
        # a second serve on the cluster attaches too; Ctrl-C leaves
        code, out = await phaseline(
            "serve", *where, "--ray-address", ray_cluster.address, "--hosts", "1",
            until="serving",
        )  # fmt: skip
        assert code == 0 and "attached" in out, out
        # a run that starts its own Ray is refused, naming the owner
        code, out = await phaseline("run", *where, "--scenario", str(scenario), "--turns", "1")
        assert code == 2 and "is served by" in out and f"pid {os.getpid()}" in out, out
        assert "phaseline inspect / watch" not in out  # it names no turn it did not write
        # the owner's deployment still runs turns
        sc = parse_scenario({"name": "after", "rounds": 1, "tools_per_round": 1})
        await rt.submit(*scripted_turn(sc), ["after-1"])
        done = await rt.wait(["after-1"], timeout=120)
        assert done["after-1"].counters.outcome == "answered"
    finally:
        await rt.shutdown()
    client = connect(redis_url)
    try:  # the owner's shutdown gave the namespace up
        assert await NamespaceOwner(client, rt.dep.keys, ttl_s=20).holder() is None
    finally:
        await client.aclose()


@pytest.mark.usefixtures("ray_cluster")
async def test_a_lease_that_lapsed_before_the_supervisor_renewed_it_is_kept(
    redis_url: str, namespace: str
) -> None:
    """The lease runs from the claim, the Supervisor renews it from its boot: on a starved
    machine (a chaos run on 2 cores) it lapsed in between, and the Supervisor, with no holder
    read yet to write back, took the lapse for another cluster's takeover and stopped its own
    deployment (every turn left running). It keeps the claim it was started under."""
    settings = Settings.model_validate(
        {
            "redis": {"namespace": namespace},
            "checkpoint": {"min_interval_s": 0},
            "supervisor": {"owner_ttl_s": 2.0, "ping_interval_s": 2.0},
        }
    )
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    client = connect(redis_url)
    try:
        assert rt.owner is not None
        owners = NamespaceOwner(client, rt.dep.keys, ttl_s=2)
        await client.delete(rt.dep.keys.owner())  # lapsed before the first renewal (2 s)

        async def held_again() -> bool:
            holder = await owners.holder()
            return holder is not None and holder.owner == rt.owner.owner  # type: ignore[union-attr]

        await eventually(held_again, timeout=30, what="the supervisor to write the claim back")
        sc = parse_scenario({"name": "kept", "rounds": 1, "tools_per_round": 1})
        await rt.submit(*scripted_turn(sc), ["kept-1"])
        done = await rt.wait(["kept-1"], timeout=120)
        assert done["kept-1"].counters.outcome == "answered"
    finally:
        await client.aclose()
        await rt.shutdown()


def test_a_holder_crosses_processes_as_text() -> None:
    h = holder("cluster-a", "tok-a", pid=42)
    assert Holder.parse("k", h.wire()) == h
    with pytest.raises(RecordError, match="unreadable namespace owner"):
        Holder.parse("k", ["cluster", "c"])


async def serving(
    redis_url: str, namespace: str, ray_cluster: Cluster, *args: str
) -> asyncio.subprocess.Process:
    """``phaseline serve`` of one host on the session's Ray cluster, once it says it serves."""
    proc = await asyncio.create_subprocess_exec(
        PHASELINE, "serve", "--redis-url", redis_url, "--namespace", namespace, *args,
        "--ray-address", ray_cluster.address, "--hosts", "1", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(120):
        while "serving" not in (line := (await proc.stdout.readline()).decode()):
            assert line, "".join(seen)
            seen.append(line)
    return proc


@pytest.mark.usefixtures("ray_cluster")
async def test_sigterm_on_serve_stops_cleanly_and_says_what_is_left(
    redis_url: str, namespace: str, ray_cluster: Cluster
) -> None:
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    proc = await serving(redis_url, namespace, ray_cluster)
    assert proc.stdout is not None
    client = await Runtime.attach(settings, ray_address=None)
    sc = parse_scenario({"name": "slow", "rounds": 40, "tools_per_round": 1,
                         "llm_latency_ms": 200})  # fmt: skip
    ids = [f"slow-{i}" for i in range(3)]
    await client.submit(*scripted_turn(sc), ids)

    async def under_way() -> bool:
        return all([(await client.store.load(t)).seq >= 2 for t in ids])

    await eventually(under_way, timeout=60, what="the turns to checkpoint")
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(120):
        out = (await proc.stdout.read()).decode()
        code = await proc.wait()
    assert code == 0, out
    assert "stopping: 3 turns running" in out and "stopped: 3 turns left in progress" in out, out
    assert await client.stopped()  # the owner stopped its deployment
    await client.detach()
    # they resume when the namespace is served again
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    try:
        done = await rt.wait(ids, timeout=300)
        assert {r.counters.outcome for r in done.values()} == {"answered"}
        assert all(r.counters.resume_attempts >= 1 for r in done.values())
    finally:
        await rt.shutdown()


@pytest.mark.usefixtures("ray_cluster")
async def test_serve_says_when_a_host_is_replaced(
    redis_url: str, namespace: str, ray_cluster: Cluster
) -> None:
    """A host's crash is absorbed (its turns resume), and the operator watching serve is told
    (12 replacements under load used to pass without a line)."""
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    proc = await serving(redis_url, namespace, ray_cluster)
    assert proc.stdout is not None
    client = await Runtime.attach(settings, ray_address=None)
    try:
        await client.kill_host(0)
        seen: list[str] = []

        async def said() -> str:
            while "host0 replaced" not in (line := (await proc.stdout.readline()).decode()):
                assert line, "".join(seen)
                seen.append(line)
            return line

        try:
            line = await asyncio.wait_for(said(), 120)
        except TimeoutError:
            status = await client.host_info(isolation=True)
            raise AssertionError(f"{''.join(seen)}\n{status}") from None
        assert "(generation 1)" in line and "1 replacements so far" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(120):
            await proc.wait()
        await client.detach()


@pytest.mark.usefixtures("ray_cluster")
async def test_a_serve_whose_namespace_is_taken_stops_its_actors_and_exits_1(
    redis_url: str, namespace: str, ray_cluster: Cluster, tmp_path: Path
) -> None:
    """Another cluster takes the namespace (this one's lease lapsed): the supervisor stops
    every actor of its deployment, and ``serve`` says why and exits 1 (it used to print
    nothing and keep running, its TurnActors alive)."""
    config = tmp_path / "fast.toml"
    config.write_text("[supervisor]\nowner_ttl_s = 2.0\nping_interval_s = 0.2\n")
    proc = await serving(redis_url, namespace, ray_cluster, "--config", str(config))
    assert proc.stdout is not None

    def hosts() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"{namespace}.host0.")]  # fmt: skip

    assert hosts()
    client = connect(redis_url)
    try:
        owners = NamespaceOwner(client, KeyLayout(namespace), ttl_s=20)
        holder = await owners.holder()  # None while the lease lapsed between two renewals
        if holder is not None:
            assert await owners.release(holder.owner)
        thief = Holder("another-cluster", "t0ken", "elsewhere", 1, "thief serve")
        assert (await owners.claim(thief)).claim is ClaimOutcome.ACQUIRED
        async with asyncio.timeout(120):
            out = (await proc.stdout.read()).decode()
            code = await proc.wait()
        assert code == 1, out
        assert "stopped under this serve" in out and "now held by thief serve" in out, out

        async def hosts_gone() -> bool:
            return not hosts()

        await eventually(hosts_gone, timeout=30, what="the deployment's hosts to be stopped")
        still = await owners.holder()  # abandoning gave nothing up: the thief's it stays
        assert still is not None and still.owner == "t0ken"
    finally:
        await client.aclose()


async def test_a_gone_in_process_holder_is_taken_over_at_once(
    any_client: StoreClient, keys: KeyLayout
) -> None:
    """A ``run --in-process`` SIGKILLed leaves its lease: the next command on this host need
    not wait for it to lapse when that process is gone. A live one, or one of a Ray cluster
    (whose deployment outlives its starting process), keeps the namespace."""
    owners = NamespaceOwner(any_client, keys, ttl_s=20)
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    host = socket.gethostname()
    dead = Holder("in-process:x:1", "tok-dead", host, gone.pid, "phaseline run")
    assert (await owners.claim(dead)).claim is ClaimOutcome.ACQUIRED
    took = await owners.claim(Holder("in-process:y:2", "tok-new", host, os.getpid(), "resume"))
    assert took.claim is ClaimOutcome.ACQUIRED and took.holder.owner == "tok-new"
    with pytest.raises(NamespaceHeld):  # this process is alive
        await owners.claim(Holder("in-process:z:3", "tok-z", host, 1, "run"))
    await owners.release("tok-new")
    ray_holder = Holder("10.0.0.1:6379 session_x", "tok-ray", host, gone.pid, "phaseline serve")
    await owners.claim(ray_holder)
    with pytest.raises(NamespaceHeld):
        await owners.claim(Holder("in-process:y:2", "tok-new", host, os.getpid(), "resume"))
