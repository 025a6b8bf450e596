"""Where a phaseline deployment lives: its Redis, settings, host count and actor names.

Actors receive a :class:`Deployment` as JSON (validated on arrival), so any of them can be
restarted anywhere and find its peers by name. Host slots map turns to hosts by a stable rule
(crc32 of the turn id); each slot's current generation is kept in Redis (``KeyLayout.hosts``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from actors.cluster.refs import HostRef
from actors.engine.agents import load_agent
from actors.engine.settings.config import Settings
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text


def actor_name(namespace: str, role: str) -> str:
    """Ray actor name of a singleton role of the deployment of a key namespace."""
    return f"{namespace}.{role}"


def pool_name(resources: Mapping[str, float]) -> str:
    """Pools are keyed by the Ray resources their workers hold ('default': none)."""
    if not resources:
        return "default"
    return "+".join(f"{k}={v:g}" for k, v in sorted(resources.items()))


#: Keys of a tool's ``resources`` that are Ray's own ``num_cpus`` / ``num_gpus`` options.
_CPU_KEYS, _GPU_KEYS = ("num_cpus", "CPU"), ("num_gpus", "GPU")


def worker_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options of a ToolWorker holding ``resources``: ``num_cpus``/``CPU`` and
    ``num_gpus``/``GPU`` become Ray's own options, anything else a custom resource (a node
    must offer it: Ray places the worker on one that does). Workers of a pool are spread over
    the nodes that qualify."""
    custom = {k: v for k, v in resources.items() if k not in _CPU_KEYS + _GPU_KEYS}
    return {
        "num_cpus": sum(v for k, v in resources.items() if k in _CPU_KEYS),
        "num_gpus": sum(v for k, v in resources.items() if k in _GPU_KEYS),
        "resources": custom or None,
        "scheduling_strategy": "SPREAD",
    }


class HostRoute(BaseModel):
    """How one host slot reaches Redis and its model endpoints when not as the others do: the
    chaos target ``partition`` sends each host through proxies of its own, to cut one host off
    while the rest of the deployment keeps its links."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str | None = None
    """The Redis URL the slot's TurnActors use; None: the deployment's."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables set in the slot's TurnActor process before it runs a turn (``OPENAI_BASE_URL``:
    the model endpoint its agents call)."""


class Deployment(BaseModel):
    """Everything an actor needs to find Redis, its settings and its peers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str
    """The Redis every actor uses."""
    settings: Settings
    """Validated runtime settings."""
    hosts: int = Field(ge=1, le=1024)
    """Number of TurnActor slots."""
    effects_url: str | None = None
    """Where the built-in non-idempotent tool performs its side effect; None: ``redis_url``.
    The chaos target ``power_loss`` points it at a witness server outside the Redis under
    test, so losing that Redis's AOF tail cannot hide a duplicated side effect."""
    agents: tuple[str, ...] = ()
    """Import paths of agents whose tools need Ray resources: their resource shapes get
    ToolWorker pools. Tools without resources run on the default pool, which always exists."""

    host_routes: tuple[tuple[HostRoute, ...], ...] = ()
    """Per host slot (the isolation slot last), the routes to Redis and the model endpoints
    its generations take in turn (empty: as the rest of the deployment does). A successor
    takes the next: what replaced a host cut off from Redis runs on another machine, whose
    links the partition did not cut."""

    model_route: HostRoute = HostRoute()
    """How the model workers reach the model endpoints when not as the rest of the deployment
    does (a chaos run's provider proxy): they make the model calls of every host."""

    def connect(
        self, *, max_connections: int = 64, host: tuple[int, int] | None = None
    ) -> StoreClient:
        """A client of :attr:`redis_url` (a cluster's if ``[redis] cluster``), or of the route
        to it of ``host`` (slot, generation)."""
        url = self.route(*host).redis_url if host is not None else None
        return self.settings.redis.connect(url or self.redis_url, max_connections=max_connections)

    def route(self, slot: int, generation: int) -> HostRoute:
        """How generation ``generation`` of host ``slot`` reaches Redis and its model endpoints."""
        routes = self.host_routes[slot] if slot < len(self.host_routes) else ()
        return routes[generation % len(routes)] if routes else HostRoute()

    @property
    def keys(self) -> KeyLayout:
        return self.settings.redis.key_layout()

    def name(self, role: str) -> str:
        """Ray actor name of a singleton role (``supervisor``, ``checkpoint``, ...)."""
        return actor_name(self.settings.redis.namespace, role)

    def checkpoint_roles(self) -> list[str]:
        """Roles of the CheckpointActors: ``checkpoint``, then ``checkpoint1``, ... when
        ``[checkpoint] actors`` asks for more than one."""
        n = self.settings.checkpoint.actors
        return ["checkpoint", *(f"checkpoint{i}" for i in range(1, n))]

    def checkpoint_role(self, turn_id: str) -> str:
        """The CheckpointActor that saves ``turn_id``: one per key shard, so a turn's saves
        stay in order on one actor and each actor writes the shards (Redis Cluster slots) of
        its own share."""
        roles = self.checkpoint_roles()
        return roles[self.keys.shard_of(turn_id) % len(roles)]

    @property
    def isolation_slot(self) -> int:
        """The slot of the isolation host, after the ``hosts`` shared ones: it runs the turns
        the poison-turn policy isolates, alone, one at a time (``actors.turn.poison``)."""
        return self.hosts

    def slots(self) -> range:
        """Every host slot the supervisor keeps alive, the isolation slot included."""
        return range(self.hosts + 1)

    def host_label(self, slot: int) -> str:
        """``host<N>`` for a shared slot, ``isolation`` for the isolation slot."""
        return "isolation" if slot == self.isolation_slot else f"host{slot}"

    def host_name(self, slot: int, generation: int) -> str:
        return f"{self.settings.redis.namespace}.{self.host_label(slot)}.g{generation}"

    def is_host_name(self, name: str) -> bool:
        """Whether ``name`` is a TurnActor's of this deployment (any slot, any generation)."""
        prefix = f"{self.settings.redis.namespace}."
        if not name.startswith(prefix):
            return False
        label, _, gen = name[len(prefix) :].rpartition(".g")
        labels = {self.host_label(slot) for slot in self.slots()}
        return label in labels and gen.isdigit()

    def model_worker_name(self, index: int) -> str:
        return f"{self.settings.redis.namespace}.models.{index}"

    def model_isolation_name(self) -> str:
        """The model worker that runs a call alone after a worker died under it."""
        return f"{self.settings.redis.namespace}.models.isolation"

    def model_worker_names(self) -> list[str]:
        """Every model worker's name, the isolation one last."""
        shared = [self.model_worker_name(i) for i in range(self.settings.models.workers)]
        return [*shared, self.model_isolation_name()]

    def tool_worker_name(self, pool: str, index: int) -> str:
        return f"{self.settings.redis.namespace}.tools.{pool}.{index}"

    def tool_pools(self) -> dict[str, dict[str, float]]:
        """Pool name -> the Ray resources its workers hold: the default pool and one per
        resource shape of the tools of :attr:`agents`."""
        pools: dict[str, dict[str, float]] = {pool_name({}): {}}
        for path in self.agents:
            for shape in load_agent(path).resource_shapes():
                pools[pool_name(shape)] = dict(shape)
        return pools

    def slot_of(self, turn_id: str) -> int:
        """The stable host slot of a turn."""
        return zlib.crc32(turn_id.encode()) % self.hosts

    def to_wire(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_wire(cls, data: str) -> Deployment:
        return cls.model_validate_json(data)


class HostDirectory:
    """Finds the current TurnActor of a slot (generation from Redis, handle from Ray)."""

    def __init__(self, deployment: Deployment, client: StoreClient) -> None:
        self.deployment = deployment
        self.client = client
        self._cache: dict[tuple[int, int], HostRef] = {}

    async def generations(self) -> dict[int, int]:
        with translated("read host generations"):
            raw = await self.client.hgetall(self.deployment.keys.hosts())
        return {int(text(k)): int(text(v)) for k, v in raw.items()}

    async def set_generation(self, slot: int, generation: int) -> None:
        with translated("write host generation"):
            await self.client.hset(self.deployment.keys.hosts(), str(slot), str(generation))

    async def handle(self, slot: int, generation: int | None = None) -> HostRef | None:
        """The live host actor of ``slot`` (of ``generation`` when the caller has already read
        it), or None if it has none right now."""
        if generation is None:
            generation = (await self.generations()).get(slot)
        if generation is None:
            return None
        key = (slot, generation)
        if key not in self._cache:
            ref = HostRef.named(self.deployment.host_name(slot, generation))
            if ref is None:
                return None
            self._cache[key] = ref
        return self._cache[key]

    async def handle_for(self, turn_id: str) -> HostRef | None:
        """The host of the turn's slot (an isolated turn may be on the isolation host)."""
        return await self.handle(self.deployment.slot_of(turn_id))

    async def handles(self) -> dict[int, HostRef]:
        """Every slot's live host actor, from one read of the generations."""
        out = {}
        for slot, generation in sorted((await self.generations()).items()):
            handle = await self.handle(slot, generation)
            if handle is not None:
                out[slot] = handle
        return out
