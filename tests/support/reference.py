"""Fault-free reference runs: the transcripts a crashed-and-resumed run must reproduce."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from store.keys import KeyLayout
from store.records import CheckpointRecord

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)


async def reference(
    client: aioredis.Redis, sc: Scenario, turn_ids: list[str]
) -> dict[str, CheckpointRecord]:
    """The fault-free run of the same scenario and turn ids, in its own namespace."""
    keys = KeyLayout(f"ref{uuid.uuid4().hex[:10]}", shards=4)
    engine = TurnEngine(client, keys, EngineSettings(loop=FAST))
    fast = sc.model_copy(update={"llm_latency_ms": 0})  # tool latency is in the args
    await engine.run_new(*scripted_turn(fast), turn_ids)
    return {t: await engine.store.load(t) for t in turn_ids}
