"""Runtime settings: one pydantic model, loadable from ``configs/*.toml``, overridable by flags.

Precedence, highest first: CLI flag, environment (``PHASELINE_REDIS_URL``), config file, default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.engine.agents import AgentChange
from actors.engine.gc_tuning import DEFAULT_GC_THRESHOLD
from actors.engine.settings.tomlfile import describe, read_toml
from actors.engine.tools.toolrun import DEFAULT_MAX_TOOL_RESULT_BYTES
from actors.turn.settings import LoopSettings
from actors.turn.watchdog import WatchdogSettings
from bus.errors import ConfigError
from store.codec import DEFAULT_MAX_RECORD_BYTES, RECORD_BYTES_CEILING
from store.domain.retention import Retention
from store.keys import KeyLayout
from store.redis.connection import DEFAULT_RETRY_S, StoreClient, connect
from store.redis.durability import Durability, parse_durability
from store.redis.urls import check_redis_url
from store.views.streams import LiveStreams
from store.write.transaction import AtomicSave

#: The loop's own defaults: the sections below that feed it default to them (one source).
_LOOP = LoopSettings()

REDIS_URL_ENV = "PHASELINE_REDIS_URL"


class _Section(BaseModel):
    # strict: ``shards = true`` or ``workers = "2"`` is a mistake, not a value to coerce.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


def default_data_dir() -> Path:
    """The user's embedded Redis: ``$PHASELINE_DATA_DIR``, else
    ``$XDG_STATE_HOME/phaseline/redis``, else ``~/.local/state/phaseline/redis``. One place, so
    every command of a user finds the same server, from any directory."""
    if explicit := os.environ.get("PHASELINE_DATA_DIR"):
        return Path(explicit).expanduser().resolve()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state).expanduser().resolve() / "phaseline" / "redis"


class RedisSettings(_Section):
    url: str | None = None
    """Redis to use; None starts the embedded server."""
    namespace: str = "pl"
    """Key prefix (store.keys)."""
    shards: int = Field(default=16, ge=1, le=16384)
    """Shard hash tags; fixed for the life of a namespace."""
    durability: str = "fsync"
    """What a checkpoint's acknowledgement promises: ``ack`` (Redis answered; the AOF is
    fsynced within a second), ``fsync`` (each group-commit batch waits for ``WAITAOF 1 0``:
    the local AOF is on disk) or ``replicas:N`` (``WAIT N``). docs/STORAGE.md says why
    ``fsync`` is the default."""
    durability_timeout_ms: int = Field(default=2000, ge=1, le=600_000)
    """How long a batch waits for that promise before its saves count as failed."""
    retry_s: float = Field(default=DEFAULT_RETRY_S, ge=0, le=3600)
    """Seconds each Redis command keeps retrying through connection errors (a restart, a
    failover) before the turn is interrupted; 0 fails at once."""
    data_dir: str | None = None
    """Where the embedded server keeps its AOF, so later commands see earlier runs. None: one
    place per user, whatever the working directory (:func:`default_data_dir`); a relative
    path is taken from the working directory."""
    cluster: bool = False
    """``url`` names one node of a Redis Cluster, or several as seeds
    (``redis://:pw@h1:7000,h2:7001``, so a client can start while one of them is down):
    commands are routed by their key's slot (every key a save, a ledger write or a stream read
    touches carries its shard's hash tag)."""

    def data_path(self) -> Path:
        """The embedded server's directory (:attr:`data_dir`, else the user's default)."""
        if self.data_dir is None:
            return default_data_dir()
        return Path(self.data_dir).expanduser().resolve()

    def connect(self, url: str, *, max_connections: int = 64) -> StoreClient:
        """A client of ``url`` as these settings say: a cluster's or one server's, retrying
        through connection errors for :attr:`retry_s`."""
        return connect(
            url, cluster=self.cluster, max_connections=max_connections, retry_s=self.retry_s
        )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else check_redis_url(url)

    @field_validator("durability")
    @classmethod
    def _check_durability(cls, text: str) -> str:
        parse_durability(text)
        return text

    def key_layout(self) -> KeyLayout:
        """The namespace's key layout (its shard count): the one way a verb builds it."""
        return KeyLayout(self.namespace, self.shards)

    def durability_policy(self) -> Durability:
        """The parsed :attr:`durability` setting."""
        return parse_durability(self.durability, timeout_ms=self.durability_timeout_ms)

    @model_validator(mode="after")
    def _check_cluster(self) -> RedisSettings:
        if self.cluster and self.url is None:
            raise ValueError(
                "cluster = true needs url (one node of the cluster); the embedded server is a "
                "single node"
            )
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> RedisSettings:
        try:
            KeyLayout(self.namespace, self.shards)  # the one place keys are validated
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        return self


class CheckpointSettings(_Section):
    min_interval_s: float = Field(default=_LOOP.checkpoint_min_interval_s, ge=0)
    """Minimum seconds between mid-turn saves of one turn."""
    max_record_bytes: int = Field(
        default=DEFAULT_MAX_RECORD_BYTES, ge=4096, le=RECORD_BYTES_CEILING
    )
    """Cap on one record's encoded size; a turn whose next checkpoint would pass it ends
    ``aborted:record_too_large`` on its last checkpoint (Redis itself refuses 512 MB)."""
    max_tool_result_bytes: int = Field(
        default=DEFAULT_MAX_TOOL_RESULT_BYTES, ge=1024, le=RECORD_BYTES_CEILING
    )
    """Cap on one tool result (its UTF-8 bytes): a larger one fails that call, not the turn;
    the model reads an error that gives the size and the cap, and the ledger holds only that."""
    max_model_reply_bytes: int = Field(
        default=_LOOP.max_reply_bytes, ge=1024, le=RECORD_BYTES_CEILING
    )
    """Cap on one model reply (its text and tool calls' arguments, UTF-8 bytes): a larger one
    is not kept; the model is told its size and the cap and asked again (a nudge), and a turn
    whose replies stay over it after its nudges ends ``aborted:oversized_reply``."""
    atomic: AtomicSave = Field(default=AtomicSave.SCRIPT, strict=False)  # TOML gives a string
    """How a save is made atomic and fenced: ``script`` (one server-side script per save) or
    ``multi_exec`` (``WATCH``, read the fences, ``MULTI`` ... ``EXEC`` per shard). Both give
    the same guarantees; docs/CLUSTER.md has what each costs."""
    actors: int = Field(default=1, ge=1, le=256)
    """CheckpointActors of the deployment. Each turn's saves go to the one of its key shard
    (``shard mod actors``), so several group-commit in parallel: one is a single event loop,
    and docs/SCALING.md says from what load it is the ceiling."""
    batch_max_saves: int = Field(default=512, ge=1, le=65_536)
    """Most saves in one batch a host sends its CheckpointActor."""
    batches_in_flight: int = Field(default=2, ge=1, le=64)
    """Batches a host has in flight to one CheckpointActor at once. With one, the host waits
    while its batch is written and the actor waits while the host makes the next; with two,
    a second batch goes out once half a batch waits, and the two overlap
    (``phaseline bench``'s throughput figure at 1,000 turns; docs/BENCHMARKS.md)."""
    mid_turn: bool = _LOOP.checkpoint_mid_turn
    """False writes only the submission and final records, so a crash loses the turn's model
    progress (committed tool calls are still reused from the ledger). It exists to measure
    what durability costs (``phaseline bench``); never turn it off in production."""


class ApprovalSettings(_Section):
    timeout_s: float = Field(default=_LOOP.approval_timeout_s, gt=0)
    """Cap on waiting for a decision; denied after it."""
    poll_s: float = Field(default=_LOOP.approval_poll_s, gt=0)
    """How often a pending decision is re-read."""


class SupervisorSettings(_Section):
    ping_interval_s: float = Field(default=0.5, gt=0)
    """How often every host is checked (its lease read, then a ping for its load)."""
    ping_timeout_s: float = Field(default=1.0, gt=0)
    """How long a ping waits. An unanswered ping replaces a host only if its lease has lapsed
    too (or Ray says it died): a busy host that still renews its lease is kept."""
    lease_ttl_s: float = Field(default=2.0, ge=0.2, le=600)
    """A host's lease (``store.domain.leases``), renewed every quarter of it: a frozen or
    cut-off host is replaced about this long after it stopped."""
    cut_off_s: float = Field(default=5.0, ge=0.5, le=3600)
    """A host that answers Ray but has not reached Redis for this long (its lease lapsed and
    a renewal asked for now fails, while the Supervisor reaches Redis) is replaced: its turns
    go on on its successor, and what it sends when its link returns is fenced."""
    owner_ttl_s: float = Field(default=20.0, ge=2, le=3600)
    """The namespace's lease (``store.domain.ownership``), renewed by the Supervisor every
    quarter of it: a deployment whose cluster died frees its namespace this long after."""
    stop_grace_s: float = Field(default=10.0, ge=0, le=3600)
    """How long ``phaseline serve`` lets running turns reach their next checkpoint when it is
    stopped (SIGTERM, Ctrl-C), before it stops the actors (``--drain`` waits for them to
    finish instead)."""
    adopt_interval_s: float = Field(default=10.0, gt=0)
    """How often live hosts re-adopt in-progress turns of their slot that they do not run."""
    standby: bool = True
    """Keep each slot's next host generation started and idle, so a replacement is ready at
    once (one more idle process per slot)."""
    kill_replaced: bool = True
    """Kill a replaced host. Off only to observe a zombie being fenced (tests, chaos)."""
    probation_patience_s: float = Field(default=30.0, gt=0)
    """How long the isolation host waits for a probation to reach its first checkpoint before
    the next isolated turn may start: a turn that is slow (or hangs) is not a crash loop, and
    must not hold the queue. It goes on, no longer on probation."""


class ToolSettings(_Section):
    workers: int = Field(default=2, ge=1, le=1024)
    """ToolWorker actors each resource pool starts with (each runs many calls at once)."""
    min_workers: int | None = Field(default=None, ge=1, le=1024)
    """Fewest workers a pool shrinks to when idle (default: ``workers``)."""
    max_workers: int | None = Field(default=None, ge=1, le=1024)
    """Most workers a pool grows to while calls wait for it (default: ``workers``)."""
    scale_interval_s: float = Field(default=1.0, gt=0)
    """Least time between two resizes of one pool."""
    idle_s: float = Field(default=10.0, gt=0)
    """A pool with no call waiting or running for this long gives back one worker."""
    threads: int = Field(default=0, ge=0, le=100_000)
    """Threads one process (``run --in-process``, each ToolWorker) runs sync tools in at once;
    a call past them waits for one, shown as waiting. 0: one per call, as many as the turns'
    calls in flight (no call waits for a thread)."""

    @model_validator(mode="after")
    def _check_bounds(self) -> ToolSettings:
        lo, hi = self.bounds()
        if not lo <= self.workers <= hi:
            raise ValueError(
                f"need min_workers <= workers <= max_workers, got {lo}, {self.workers}, {hi}"
            )
        return self

    def bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers), defaults filled in."""
        return (self.min_workers or self.workers, self.max_workers or self.workers)


class ModelSettings(_Section):
    """The ``[models]`` section: where the model calls of Ray-hosted turns run."""

    remote: bool = True
    """Run them on model workers, where a host's death does not end them (a resumed turn
    adopts the generation); False: in the host, as in process (lost with it). A call that
    kills the worker it runs on is judged like a poison turn's host deaths: alone on the
    isolation worker after two, parked after two more there."""
    workers: int = Field(default=2, ge=1, le=1024)
    """ModelWorker actors (each runs many generations at once). A generation is placed by its
    name over this many: changing it while turns run loses adoption of the ones in flight."""
    keep_s: float = Field(default=600.0, gt=0, le=86_400)
    """How long a finished generation whose asker died waits for its resumed turn."""
    sweep_s: float = Field(default=2.0, gt=0, le=3600)
    """How often a worker drops the generations of turns no longer in progress."""


class EventSettings(_Section):
    """Each turn's live stream, what ``phaseline watch`` and ``Runtime.watch`` read."""

    live_maxlen: int = Field(default=2000, ge=0, le=1_000_000)
    """Entries kept per turn (older ones are trimmed); 0 turns live streams off (watchers
    then see only the final answer)."""
    live_ttl_s: int = Field(default=86_400, ge=1)
    """Seconds a turn's live stream is kept after its last entry; a finished turn's expires
    with its other keys (``[retention] finished_ttl_s``) if that comes first."""

    def live(self) -> LiveStreams:
        return LiveStreams(maxlen=self.live_maxlen, ttl_s=self.live_ttl_s)


class LoopSectionSettings(_Section):
    """The ``[loop]`` section; with others it becomes the loop's own :class:`LoopSettings`."""

    strict: bool = _LOOP.strict
    """Raise on illegal phase transitions instead of logging them."""
    backoff_scale: float = Field(default=_LOOP.backoff_scale, ge=0)
    """Multiplier of the 1/2/4 s retry backoff (and of a rate-limit backoff the endpoint did
    not name)."""
    rate_limit_max_wait_s: float = Field(default=_LOOP.rate_limit_max_wait_s, gt=0, le=86_400)
    """Seconds one model call may wait on the endpoint's rate limit before its turn aborts
    ``rate_limited`` (minutes, not seconds: waiting is what a rate limit asks)."""
    on_agent_change: AgentChange = Field(default=AgentChange.CONTINUE, strict=False)
    """What a turn resumed under a different agent does (its module was upgraded while it ran):
    ``continue`` (noted in the turn and published) or ``suspend`` (for a person to decide)."""


class HostSettings(_Section):
    """The ``[host]`` section: the processes that run turns (hosts, CheckpointActors)."""

    gc_threshold: int = Field(default=DEFAULT_GC_THRESHOLD, ge=0, le=10_000_000)
    """Python's first-generation garbage-collection threshold in those processes (0: Python's
    own, 700): a round allocates thousands of short-lived objects, and at 700 the collector
    runs several times a round (``actors.engine.gc_tuning`` has the measurement)."""


class RetentionSettings(_Section):
    finished_ttl_s: float = Field(default=7 * 86400, ge=0, le=10 * 365 * 86400)
    """Seconds a finished turn's data (record, transcript, spec, ledger, effects, inbox,
    approvals, live stream, its session) lives after its final save; 0: for ever. A week by default:
    long enough to inspect, watch and export a turn, short enough that Redis memory tracks the
    load (docs/OPERATIONS.md sizes it). Suspended turns are kept until resumed or purged."""
    on_finish: str = Field(default="", pattern=r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?$")
    """Import path (``"pkg.mod:fn"``) of a function every host calls with each turn it ends,
    after the final save (``actors.engine.on_finish``): to archive continuously. Empty: none."""

    def policy(self) -> Retention:
        return Retention(finished_ttl_s=self.finished_ttl_s)


#: The standard variables that turn tracing on without a ``[telemetry]`` endpoint.
OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TelemetrySettings(_Section):
    """OpenTelemetry traces (``actors.engine.telemetry``): off unless an endpoint is set here
    or in the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``..._TRACES_ENDPOINT`` variables
    (then the exporter also reads ``OTEL_EXPORTER_OTLP_HEADERS`` and the rest)."""

    endpoint: str = Field(default="", pattern=r"^(https?://[^\s]+)?$")
    """The OTLP/HTTP receiver's base URL (``http://collector:4318``: spans go to
    ``/v1/traces``); empty: the standard variables decide."""
    service_name: str = Field(default="phaseline", min_length=1, max_length=200)
    """``service.name`` of the spans (``OTEL_SERVICE_NAME`` wins when set)."""
    capture_content: bool = False
    """Put message contents, tool arguments and results on the spans. Off by default: they
    may hold what a user typed or a tool read."""
    export_delay_ms: int = Field(default=1000, ge=10, le=60_000)
    """Longest an ended span waits in the batch before it is sent (a SIGKILLed host loses at
    most this much of its spans)."""

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint) or any(os.environ.get(v) for v in OTLP_ENDPOINT_ENVS)


class Settings(_Section):
    redis: RedisSettings = RedisSettings()
    retention: RetentionSettings = RetentionSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    approvals: ApprovalSettings = ApprovalSettings()
    watchdog: WatchdogSettings = WatchdogSettings()
    loop: LoopSectionSettings = LoopSectionSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    tools: ToolSettings = ToolSettings()
    models: ModelSettings = ModelSettings()
    events: EventSettings = EventSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    host: HostSettings = HostSettings()

    @model_validator(mode="after")
    def _check_checkpoint_actors(self) -> Settings:
        # Turns go to the actor of their key shard: an actor past the shard count gets none.
        if self.checkpoint.actors > self.redis.shards:
            raise ValueError(
                f"[checkpoint] actors = {self.checkpoint.actors} is more than [redis] shards = "
                f"{self.redis.shards}: each turn's saves go to the actor of its key shard, so "
                "the extra actors would save nothing"
            )
        return self

    def loop_settings(self) -> LoopSettings:
        return LoopSettings(
            strict=self.loop.strict,
            checkpoint_min_interval_s=self.checkpoint.min_interval_s,
            checkpoint_mid_turn=self.checkpoint.mid_turn,
            approval_timeout_s=self.approvals.timeout_s,
            approval_poll_s=self.approvals.poll_s,
            backoff_scale=self.loop.backoff_scale,
            rate_limit_max_wait_s=self.loop.rate_limit_max_wait_s,
            max_reply_bytes=self.checkpoint.max_model_reply_bytes,
        )

    def with_telemetry_env(self) -> Settings:
        """These settings with the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` and
        ``OTEL_SERVICE_NAME`` of this process written into ``[telemetry]`` (where the file did
        not set them), so actors on other nodes trace as this process was told to."""
        update: dict[str, str] = {}
        if not self.telemetry.endpoint and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            update["endpoint"] = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        if os.environ.get("OTEL_SERVICE_NAME"):
            update["service_name"] = os.environ["OTEL_SERVICE_NAME"]
        if not update:
            return self
        try:
            telemetry = TelemetrySettings.model_validate({**self.telemetry.model_dump(), **update})
        except ValidationError as exc:
            raise ConfigError(f"invalid OpenTelemetry variables:\n{describe(exc)}") from None
        return self.model_copy(update={"telemetry": telemetry})

    def with_overrides(self, **redis: Any) -> Settings:
        """Apply non-None Redis overrides (flags); the env var fills ``url`` below a flag."""
        values = {k: v for k, v in redis.items() if v is not None}
        if "url" not in values and os.environ.get(REDIS_URL_ENV):
            values["url"] = os.environ[REDIS_URL_ENV]
        if not values:
            return self
        try:
            redis_settings = RedisSettings.model_validate({**self.redis.model_dump(), **values})
        except ValidationError as exc:
            raise ConfigError(f"invalid Redis settings:\n{describe(exc, RedisSettings)}") from None
        return self.model_copy(update={"redis": redis_settings})


def load_settings(path: str | Path | None) -> Settings:
    """Defaults, or a validated TOML file; every problem is a :class:`ConfigError`."""
    if path is None:
        return Settings()
    try:
        return Settings.model_validate(read_toml(path, "config"))
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid config:\n{describe(exc, Settings)}") from None
