"""CPU time of the processes a figure runs on: what prices work in CPU rather than wall time
(``unit_costs``, the CPU per save of ``checkpoint_throughput``)."""

from __future__ import annotations

import psutil

from store.redis.connection import StoreClient
from store.redis.failures import translated

__all__ = ["machine_busy_s", "processes_cpu_s", "redis_cpu_s"]


def processes_cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` so far (a process that is gone counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def machine_busy_s() -> float:
    """CPU seconds every core of this machine spent busy so far (not idle, not waiting on IO)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


async def redis_cpu_s(client: StoreClient) -> float:
    """redis-server's CPU seconds so far, as it reports them (``INFO cpu``): the server may
    run elsewhere, where psutil cannot see it."""
    with translated("read redis INFO cpu"):
        cpu = await client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
