"""``phaseline chaos``: kill runtime processes at random under load, then judge from Redis.

Modelled on the resource killers Ray runs in its own release tests: a seeded loop picks a
target kind and a victim at random intervals and kills it, while turns keep arriving. The
kinds are dealt from a shuffled deck (each once before any again), so a run of as many faults
as targets hits every one of them. Targets:

* ``host``, ``tool``, ``checkpoint``, ``watchdog``, ``recovery``, ``supervisor``: SIGKILL of
  that actor's process (a random one of its kind);
* ``redis``: SIGKILL of the embedded redis-server and a restart on its AOF
  (``appendfsync always``), so every client sees its connections drop;
* ``freeze``: SIGSTOP of a host until the supervisor has replaced it and the successor has
  claimed its turns, then SIGCONT: the old incarnation wakes up as a zombie;
* ``power_loss``: the embedded server's machine loses power: SIGSTOP (no reply leaves it), then
  SIGKILL, the AOF cut back to what its fsync policy had made durable (nothing acknowledged
  under ``appendfsync always``, the last second under ``everysec``), and a restart. Side effects
  are then counted on a witness server outside the Redis under test, so a lost tail cannot hide
  a duplicate;
* ``redis_failover`` (with ``--redis-cluster``): SIGKILL of a random primary of the embedded
  Redis Cluster; its replica takes over while turns pause on its slots, then the killed node is
  started again and rejoins as a replica (as an operator's restart brings it back). Side
  effects are counted on a witness server outside the cluster, as for ``power_loss``;
* ``provider``: a storm at the model endpoint, through a fault proxy in front of it
  (``actors.harness.provider_proxy``): for one to three seconds every request meets 429s with
  ``retry-after``, 529s, 5xx, replies cut mid-way, hangs until the client gives up, or a dead
  endpoint; every call of the run also waits a log-normal latency (median 200 ms);
* ``partition``: one host's link to Redis, or to the model endpoint, is cut for two to six
  seconds (its bytes held, as a cut link holds them), then restored, while every other process
  keeps its links (``actors.harness.links``); half the cuts from Redis last past
  ``[supervisor] cut_off_s``, so the host is replaced and what it sent while cut off arrives
  after its successor's claims: those writes are fenced, and Redis counts them (the report's
  ``fenced_writes``);
* ``concurrent_resume``: a rival owner in this process (what a second ``phaseline resume`` on
  the namespace is) claims and runs a few in-progress turns of a random host while that host
  still runs them: the two race on every dispatch and save until one is fenced.

``host`` and ``freeze`` pick among the shared hosts and the isolation host alike. With
``poison`` > 0, that many turns run a variant of the scenario whose third model call SIGKILLs
the process it runs in (a poison turn); the verdict wants each of them ``suspended:poison``
and every other turn equal to the fault-free run. ``--targets none`` injects nothing else, so
the host deaths counted are the poison turns' own.

The verdict (``actors.harness.verdict``) is read from Redis afterwards against a fault-free run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from actors.cluster.local_nodes import LocalNodes
from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import ModelFault, Scenario
from actors.harness.bad_tools import RAISING
from actors.harness.chaos_monkey import ChaosMonkey
from actors.harness.chaos_report import ChaosReport, Fault
from actors.harness.chaos_settings import ChaosSettings
from actors.harness.links import Links
from actors.harness.targets import ChaosTarget
from actors.harness.transitions import first_moves_after, read_moves
from actors.harness.verdict import Verdict, expected_for, judge
from actors.harness.work import Work
from bus.errors import PhaselineError
from bus.outcomes import Outcome
from bus.phase import Transition
from store.domain.usage import fenced_writes
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis
from store.redis.embedded_cluster import EmbeddedCluster

log = logging.getLogger(__name__)


#: The model call of a poison turn that SIGKILLs its process.
POISON_AT_CALL = 3


def poison_variant(scenario: Scenario) -> Scenario:
    """The scenario with a model call that SIGKILLs its process whenever it is reached."""
    at = min(POISON_AT_CALL, scenario.rounds + 1)
    crash = ModelFault(at_call=at, kind="crash")
    kept = tuple(f for f in scenario.faults if f.at_call != at)
    return scenario.model_copy(update={"faults": (*kept, crash)})


def poison_ids(ids: list[str], n: int) -> list[str]:
    """``n`` of ``ids``, spread evenly from the middle of each stretch (deterministic)."""
    n = min(n, len(ids))
    return [ids[(2 * i + 1) * len(ids) // (2 * n)] for i in range(n)]


async def submit_over(
    rt: Runtime,
    work_of: Callable[[str], Work],
    ids: list[str],
    seconds: float,
    on_submitted: Callable[[int], None],
) -> None:
    """Submit ``ids`` in one-second waves spread over ``seconds`` (retrying through outages),
    each turn with its work."""
    waves = max(1, int(seconds))
    per = -(-len(ids) // waves)
    for start in range(0, len(ids), per):
        wave = ids[start : start + per]
        groups: dict[int, tuple[Work, list[str]]] = {}  # by identity: inputs hold dicts
        for tid in wave:
            work = work_of(tid)
            groups.setdefault(id(work), (work, []))[1].append(tid)
        for work, group in groups.values():
            while True:
                try:  # idempotent: repeating a wave is safe
                    await rt.submit(work.agent, work.turn_input, group)
                    break
                except PhaselineError as exc:
                    log.warning("submission interrupted, repeating the wave: %s", exc)
                    await asyncio.sleep(0.5)  # Redis restarting: retry the wave
        on_submitted(len(wave))
        await asyncio.sleep(1)  # the arrival schedule


def recoveries(
    moves: list[Transition], faults: list[Fault], t0_unix: float
) -> list[tuple[str, float, float, ChaosTarget]]:
    """(turn, seconds since start, latency ms, fault target): the first move of each affected
    turn under a newer epoch after its host was killed, frozen or raced."""
    out = []
    for f in faults:
        kill_ms = (t0_unix + f.at_s) * 1000
        for tid, first in first_moves_after(moves, f.affected, kill_ms).items():
            out.append((tid, first.at_ms / 1000 - t0_unix, first.at_ms - kill_ms, f.target))
    return out


async def _judged(rt: Runtime, ids: list[str], expected: Any, poisoned: frozenset[str]) -> Verdict:
    """The verdict on the run's turns, side effects counted on the deployment's witness
    server when it has one."""
    witness = connect(rt.dep.effects_url) if rt.dep.effects_url else None
    try:
        return await judge(
            rt.client,
            rt.dep.keys,
            ids,
            expected,
            effects_client=witness,
            expect_suspended=poisoned,
        )
    finally:
        if witness is not None:
            await witness.aclose()


async def bad_turns_judged(rt: Runtime, ids: list[str]) -> list[str]:
    """The bad-input turns that did not end as they must: answered, the good call ``ok`` and
    each raising call an ``error`` of its own."""
    wrong = []
    for tid in ids:
        try:
            record = await rt.store.load(tid)
        except PhaselineError as exc:
            wrong.append(f"{tid}: {exc}")
            continue
        results = {
            m.tool_result.name: m.tool_result.status
            for m in record.messages
            if m.tool_result is not None
        }
        want = {"echo": "ok", **dict.fromkeys(RAISING, "error")}
        if record.counters.outcome is not Outcome.ANSWERED or results != want:
            wrong.append(f"{tid}: outcome {record.counters.outcome}, results {results}")
    return wrong


def _config_of(rt: Runtime, cfg: ChaosSettings, *, cluster: bool) -> dict[str, Any]:
    """What the report says the run was."""
    return {
        "work": cfg.work.label,
        "turns": cfg.turns,
        "duration_s": cfg.duration_s,
        "kill_interval_s": cfg.kill_interval_s,
        "targets": list(cfg.targets),
        "seed": cfg.seed,
        "poison": cfg.poison,
        "hosts": rt.dep.hosts,
        "redis": "cluster" if cluster else "one server",
        "namespace": rt.dep.keys.namespace,
    }


async def run_chaos(
    rt: Runtime,
    server: EmbeddedRedis | None,
    cfg: ChaosSettings,
    *,
    nodes: LocalNodes | None = None,
    cluster: EmbeddedCluster | None = None,
    links: Links | None = None,
    on_submitted: Callable[[int], None],
    on_done: Callable[[str], None],
) -> ChaosReport:
    expected = await expected_for(cfg.verdict, rt.client, cfg.work, f"{rt.dep.keys.namespace}-ref")
    ids = [f"chaos{cfg.seed}-t{i:06d}" for i in range(cfg.turns)]
    poisoned = frozenset(poison_ids(ids, cfg.poison)) if cfg.poison else frozenset()
    scenario = cfg.work.scenario
    poison = Work.scripted(poison_variant(scenario)) if scenario and cfg.poison else cfg.work

    def work_of(tid: str) -> Work:
        return poison if tid in poisoned else cfg.work

    t0_unix = time.time()
    monkey = ChaosMonkey(rt, server, cfg, nodes, cluster, links)
    started = monkey.t0
    if ChaosTarget.BAD_INPUT in cfg.targets:  # once whatever the draws, then as they fall
        monkey.faults.append(await monkey.inject(ChaosTarget.BAD_INPUT))
    await asyncio.gather(
        submit_over(rt, work_of, ids, cfg.duration_s / 2, on_submitted), monkey.run()
    )
    try:
        await rt.wait(ids, timeout=max(600.0, cfg.duration_s * 4), on_done=on_done)
        await rt.wait(monkey.bad_ids, timeout=120)
    except PhaselineError as exc:  # the verdict below reports what never finished
        log.error("chaos run: %s", exc)
    rivals = await monkey.rivals_done()
    if rivals:
        log.info("rival resumes ended: %s", dict(rivals))
    wall = time.monotonic() - started
    verdict = await _judged(rt, ids, expected, poisoned)
    verdict.bad_input_accepted += await bad_turns_judged(rt, monkey.bad_ids)
    moves = await read_moves(rt.client, rt.dep.keys)
    recovered = recoveries(moves, monkey.faults, t0_unix)
    config = _config_of(rt, cfg, cluster=cluster is not None)
    if links is not None and links.provider is not None:
        config["provider_requests"] = {
            "forwarded": links.provider.forwarded,
            **{str(fault): n for fault, n in links.provider.landed.items()},
        }
    return ChaosReport(
        config=config,
        verdict=verdict,
        faults=monkey.faults,
        wall_s=wall,
        respawns=await rt.respawns(),
        started_at=t0_unix,
        latency_ms=[ms for _, _, ms, _ in recovered],
        moves=moves,
        recovered=recovered,
        turn_ids=ids,
        rivals=dict(rivals),
        replacements={
            rt.dep.host_label(slot): gen
            for slot, gen in sorted((await rt.hosts.generations()).items())
        },
        fenced={str(k): n for k, n in (await fenced_writes(rt.client, rt.dep.keys)).items()},
    )
