"""Every metric phaseline exports, in one place, through ``ray.util.metrics``.

Ray's metrics agent on each node serves them to Prometheus (``ray start
--metrics-export-port``, or ``ray.init(_metrics_export_port=...)``) with a ``ray_`` prefix:
``phaseline_saves_total`` is scraped as ``ray_phaseline_saves_total``. docs/METRICS.md gives
each name, its tags and what it means. Metric objects are made once per process, on first use,
by the actor that records them (Ray wants them created inside the worker that reports them).
"""

from __future__ import annotations

import functools

from ray.util.metrics import Counter, Gauge, Histogram

__all__ = ["Metrics", "metrics"]

#: Latency buckets in milliseconds: a save under fsync takes a few ms, a resume seconds.
_MS_BUCKETS: list[float] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
#: Batch-size buckets: group commit batches range from 1 to ``max_batch`` (1,024) saves.
_BATCH_BUCKETS: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


class Metrics:
    """The metric objects of one process."""

    def __init__(self) -> None:
        self.turns = Gauge(
            "phaseline_turns",
            description="Turns a host runs right now, by the phase each is in.",
            tag_keys=("phase", "host"),
        )
        self.phase_entries = Counter(
            "phaseline_phase_entries_total",
            description="Turns entering each phase (a transition on the bus).",
            tag_keys=("phase",),
        )
        self.saves = Counter(
            "phaseline_saves_total",
            description="Checkpoint saves the CheckpointActor made, by outcome.",
            tag_keys=("outcome",),
        )
        self.save_batch = Histogram(
            "phaseline_save_batch_size",
            description="Saves per group-commit batch written by the CheckpointActor.",
            boundaries=_BATCH_BUCKETS,
        )
        self.save_latency = Histogram(
            "phaseline_save_batch_ms",
            description="Milliseconds one batch took in the CheckpointActor (Redis round trips "
            "and the durability wait).",
            boundaries=_MS_BUCKETS,
        )
        self.resumes = Counter(
            "phaseline_resumes_total",
            description="Turns claimed for a new owner (a resume plan made).",
        )
        self.adoption = Histogram(
            "phaseline_adoption_ms",
            description="Milliseconds the RecoveryActor took to plan one host's adoption.",
            boundaries=_MS_BUCKETS,
        )
        self.tool_calls = Counter(
            "phaseline_tool_calls_total",
            description="Tool calls finished on the cluster, by status (ok, error, timeout, "
            "outcome_unknown, ...).",
            tag_keys=("status",),
        )
        self.watchdog = Counter(
            "phaseline_watchdog_events_total",
            description="Watchdog actions: soft (idle_soft published) or hard (model call "
            "cancelled).",
            tag_keys=("kind",),
        )
        self.rate_limit_waits = Counter(
            "phaseline_rate_limit_waits_total",
            description="Model calls a host held back on a rate limit: the provider's refusal "
            "or the cluster's limiter.",
            tag_keys=("host",),
        )
        self.model_waiting = Gauge(
            "phaseline_model_waiting",
            description="Calls waiting in a model endpoint's line (the cluster's limiter).",
            tag_keys=("endpoint",),
        )
        self.model_in_flight = Gauge(
            "phaseline_model_in_flight",
            description="Calls holding a place in flight at a model endpoint (under a declared "
            "max_in_flight).",
            tag_keys=("endpoint",),
        )
        self.model_paused = Gauge(
            "phaseline_model_paused_seconds",
            description="Seconds left of a model endpoint's pause (a provider's 429).",
            tag_keys=("endpoint",),
        )
        self.agent_tokens = Gauge(
            "phaseline_agent_tokens",
            description="Tokens of an agent's finished turns, by kind (prompt, completion, "
            "cached), as the store counts them (once per turn).",
            tag_keys=("agent", "kind"),
        )
        self.agent_turns = Gauge(
            "phaseline_agent_turns",
            description="An agent's finished turns, as the store counts them.",
            tag_keys=("agent",),
        )
        self.inflight_tools = Gauge(
            "phaseline_tool_calls_inflight",
            description="Tool calls a host has sent to its pools and not had answered.",
            tag_keys=("pool",),
        )


@functools.cache
def metrics() -> Metrics:
    """This process's metrics (made on first use, inside the Ray worker that records them)."""
    return Metrics()
