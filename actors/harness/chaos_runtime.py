"""The deployment a chaos run hits: tuned for faults that cut turns off, and with a witness
Redis for the side effects when a fault can lose Redis writes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from actors.cluster.deployment import HostRoute
from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from actors.harness.targets import WITNESSED, ChaosTarget
from store.redis.embedded import EmbeddedRedis

__all__ = ["ADOPT_INTERVAL_S", "chaos_runtime"]

#: Seconds between adopts of orphaned turns in a chaos run (10 by default): a Redis restart
#: cuts turns off, and a short interval lets the verdict see them go on within the run.
ADOPT_INTERVAL_S = 2.0


@contextlib.asynccontextmanager
async def chaos_runtime(
    settings: Settings,
    *,
    redis_url: str,
    hosts: int,
    ray_address: str | None,
    targets: Sequence[ChaosTarget],
    host_routes: Sequence[Sequence[HostRoute]] = (),
    model_route: HostRoute | None = None,
) -> AsyncIterator[Runtime]:
    """A deployment for a chaos run, shut down after it. When a target can lose Redis writes
    (:data:`WITNESSED`), side effects are counted on a witness server outside the Redis under
    test, so a lost counter cannot hide a duplicate. ``host_routes``: each host slot's own
    links and ``model_route`` the model workers' (``actors.harness.links``)."""
    sup = settings.supervisor.model_copy(update={"adopt_interval_s": ADOPT_INTERVAL_S})
    tuned = settings.model_copy(update={"supervisor": sup})
    witnessed = any(t in WITNESSED for t in targets)
    witness_cm = EmbeddedRedis(appendfsync="always") if witnessed else contextlib.nullcontext()
    with witness_cm as witness:
        rt = await Runtime.start(
            tuned,
            redis_url=redis_url,
            hosts=hosts,
            ray_address=ray_address,
            effects_url=None if witness is None else witness.url,
            host_routes=host_routes,
            model_route=model_route,
        )
        try:
            yield rt
        finally:
            await rt.shutdown()
