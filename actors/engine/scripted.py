"""The scripted model: deterministic replies for tests, demos, chaos runs and benchmarks.

The next reply is a pure function of (scenario, transcript so far, attempt), so a turn resumed
from any checkpoint reproduces the fault-free transcript exactly. Faults (DESIGN §5) fire at the
Nth model call of the turn, counted from the transcript (through compaction summaries):

* ``retryable``: the first ``times`` attempts of that call raise RetryableLLMError;
* ``context_length``: that call raises ContextLengthError until the turn has been compacted;
* ``hang``: that call never returns (until the watchdog cancels it);
* ``empty``: that call returns an empty reply, unless the model was just nudged;
* ``loop``: from that call on, the model repeats one identical tool call forever;
* ``fatal``: that call raises FatalLLMError;
* ``crash``: that call SIGKILLs the process it runs in, every time it is reached (a poison
  turn: what the poison-turn policy of ``actors.turn.poison`` must contain).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal

from actors.engine.scenario import Scenario
from actors.turn.compaction import progress, read_summary
from actors.turn.llm import LLMRequest
from actors.turn.recovery import NUDGE_PREFIX
from bus.errors import ContextLengthError, FatalLLMError, RetryableLLMError
from store.records import Message, ToolCall


def payload(seed: str, size: int) -> str:
    """``size`` characters of deterministic filler derived from ``seed``."""
    block = hashlib.sha256(seed.encode()).hexdigest()
    return (block * (size // len(block) + 1))[:size]


class ScriptedLLM:
    def __init__(self, scenario: Scenario, *, baseline: int) -> None:
        self.scenario = scenario
        self.baseline = baseline

    async def complete(self, request: LLMRequest) -> Message:
        sc = self.scenario
        if sc.llm_latency_ms:
            await asyncio.sleep(sc.llm_latency_ms / 1000)
        turn = request.messages[self.baseline :]
        done = progress(turn)
        call = done.replies + 1
        prompt = request.messages[self.baseline - 1].text if self.baseline else ""
        seed = f"{sc.name}|{prompt}"
        if not request.tools_enabled:
            text = payload(f"{seed}|final-stop|{call}", sc.payload_bytes)
            return Message(role="assistant", text=f"Stopping here. {text}")
        fault = sc.fault_at(call)
        if fault is not None:
            if fault.kind == "retryable" and request.attempt < fault.times:
                raise RetryableLLMError(f"scripted retryable error at call {call}")
            if fault.kind == "context_length" and not any(read_summary(m) for m in turn):
                raise ContextLengthError(f"scripted context overflow at call {call}")
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "fatal":
                raise FatalLLMError(f"scripted fatal error at call {call}")
            if fault.kind == "hang":
                await asyncio.Event().wait()
            nudged = bool(turn) and turn[-1].text.startswith(NUDGE_PREFIX)
            if fault.kind == "empty" and not nudged:
                return Message(role="assistant", text="")
        looping = any(f.kind == "loop" and call >= f.at_call for f in sc.faults)
        if looping:
            args = {"text": "same again", "delay_ms": sc.tool_latency_ms}
            return Message(
                role="assistant",
                text="Let me try that once more.",
                tool_calls=(ToolCall(id=f"call_{call}_0", name=sc.tools[0], args=args),),
            )
        if done.rounds >= sc.rounds:
            return Message(role="assistant", text=payload(f"{seed}|final", sc.payload_bytes))
        r = done.rounds
        calls = tuple(
            ToolCall(
                id=f"call_{r}_{i}",
                name=sc.tools[(r * sc.tools_per_round + i) % len(sc.tools)],
                args={
                    "text": payload(f"{seed}|tool|{r}|{i}", sc.payload_bytes),
                    "delay_ms": sc.tool_latency_ms,
                },
            )
            for i in range(sc.tools_per_round)
        )
        return Message(
            role="assistant", text=payload(f"{seed}|reply|{r}", sc.payload_bytes), tool_calls=calls
        )
