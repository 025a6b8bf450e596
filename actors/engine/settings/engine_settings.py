"""What a :class:`~actors.engine.turn_engine.TurnEngine` is made with: how it runs turns
(:class:`EngineSettings`, frozen values, what ``[checkpoint]``, ``[loop]`` and the other sections
say in the engine's terms) and what its host plugs in (:class:`EngineHooks`: the checkpointer,
the tool runner and the listeners a Ray host brings, the in-process ones otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.engine.agents import AgentChange
from actors.engine.models.generations import RemoteModels
from actors.engine.on_finish import OnFinish
from actors.engine.settings.config import Settings
from actors.engine.tools.toolrun import ToolRunner
from actors.turn.deps import Checkpointer
from actors.turn.settings import LoopSettings
from actors.turn.watchdog import SoftIdle, WatchdogSettings
from bus.events import LiveEvent
from bus.phase import Transition
from store.domain.effects import EffectCounters
from store.domain.retention import Retention
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.durability import Durability
from store.write.checkpoint import RedisCheckpointStore
from store.write.transaction import AtomicSave

__all__ = ["EngineHooks", "EngineSettings"]

#: A deployment's defaults: the engine's own default to them, but for the two noted below.
_DEPLOYED = Settings()


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """How an engine runs its turns."""

    loop: LoopSettings = LoopSettings()
    """The turn loop's own settings (strictness, checkpoint debounce, approvals, backoff)."""
    watchdog: WatchdogSettings | None = _DEPLOYED.watchdog
    """The idle watchdog run in this process; None: none (a Ray host's is the WatchdogActor)."""
    max_record_bytes: int = _DEPLOYED.checkpoint.max_record_bytes
    """Largest record a save may write (``[checkpoint] max_record_bytes``)."""
    max_tool_result_bytes: int = _DEPLOYED.checkpoint.max_tool_result_bytes
    """Largest tool result kept; a larger one fails its call, not the turn."""
    durability: Durability = Durability()
    """What a save waits for (``[redis] durability``). The engine alone defaults to the
    store's ``ack``, which any server (fakeredis too) gives; a deployment's is ``fsync``."""
    atomic: AtomicSave = _DEPLOYED.checkpoint.atomic
    """How a save is made atomic: one script, or ``MULTI/EXEC``."""
    retention: Retention = Retention()
    """How long a finished turn's keys live. The engine alone keeps them (the store's
    default); a deployment's expire a week after (``[retention] finished_ttl_s``)."""
    on_agent_change: AgentChange = _DEPLOYED.loop.on_agent_change
    """What a turn resumed under a changed agent does."""
    probation_patience_s: float = _DEPLOYED.supervisor.probation_patience_s
    """How long the isolation host lets a turn run alone before it goes on with the queue."""
    tool_threads: int = _DEPLOYED.tools.threads
    """Threads sync tools run in at once when they run in this process (0: one per call)."""

    @classmethod
    def of(cls, settings: Settings, *, watchdog: bool = True) -> EngineSettings:
        """The engine's part of ``settings`` (``watchdog=False``: no watchdog here)."""
        return cls(
            loop=settings.loop_settings(),
            watchdog=settings.watchdog if watchdog else None,
            max_record_bytes=settings.checkpoint.max_record_bytes,
            max_tool_result_bytes=settings.checkpoint.max_tool_result_bytes,
            durability=settings.redis.durability_policy(),
            atomic=settings.checkpoint.atomic,
            retention=settings.retention.policy(),
            on_agent_change=settings.loop.on_agent_change,
            probation_patience_s=settings.supervisor.probation_patience_s,
            tool_threads=settings.tools.threads,
        )

    def checkpoint_store(self, client: StoreClient, keys: KeyLayout) -> RedisCheckpointStore:
        """The checkpoint store these settings save through (its size cap, durability, atomic
        path and retention)."""
        return RedisCheckpointStore(
            client,
            keys,
            max_record_bytes=self.max_record_bytes,
            durability=self.durability,
            atomic=self.atomic,
            retention=self.retention,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineHooks:
    """What the engine's host plugs in; each None is the in-process default."""

    checkpoints: Checkpointer | None = None
    """Where saves go (a Ray host's CheckpointActors); None: the store, here."""
    runner: ToolRunner | None = None
    """Where tool calls run (a Ray host's ToolWorkers); None: in this process."""
    models: RemoteModels | None = None
    """Where model calls run (a Ray host's model workers); None: in this process."""
    on_transition: Callable[[Transition], None] | None = None
    """Hears every phase transition."""
    on_event: Callable[[LiveEvent], None] | None = None
    """Hears what a watcher sees besides transitions (streamed text, tool calls and results,
    model calls, checkpoints, restarts, final answers)."""
    on_status: Callable[[SoftIdle], None] | None = None
    """Hears the in-process watchdog's soft idle reports."""
    on_isolate: Callable[[str], None] | None = None
    """Hears every turn this engine queued for the isolation host."""
    effects: EffectCounters | None = None
    """Where the side effects of the built-in tools run here and the scripted model's replies
    are counted (the chaos witness, a server of its own); None: the turn store."""
    on_finish: OnFinish | None = None
    """Called with every turn that ends here, after its final save
    (``actors.engine.on_finish``)."""
