"""The scripted model: deterministic replies for tests, demos, chaos runs and benchmarks.

With ``replies = "fixed"`` the next reply is a pure function of (scenario, transcript so far,
attempt), so a turn resumed from any checkpoint reproduces the fault-free transcript exactly.
With ``replies = "random"`` it answers as a real model does: the same rounds and tools, but
fresh text and fresh call arguments every time, so a reply asked for again after a crash is a
different reply making different calls (what exactly-once must survive). It then counts every
reply it completes in the turn's effects hash, by the digest of the transcript it answered,
so a reply paid for twice can be counted from outside the process. Faults (DESIGN §5) fire at the
Nth model call of the turn, counted from the transcript (through compaction summaries):

* ``retryable``: the first ``times`` attempts of that call raise RetryableLLMError;
* ``context_length``: that call raises ContextLengthError until the turn has been compacted;
* ``hang``: that call never returns (until the watchdog cancels it);
* ``empty``: that call returns an empty reply, unless the model was just nudged;
* ``oversized``: that call's first ``times`` attempts return a reply of
  :data:`OVERSIZED_REPLY_BYTES` (over the default cap on one reply; each is answered by a nudge);
* ``loop``: from that call on, the model repeats one identical tool call forever;
* ``fatal``: that call raises FatalLLMError;
* ``crash``: that call SIGKILLs the process it runs in, every time it is reached (a poison
  turn: what the poison-turn policy of ``actors.turn.poison`` must contain).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from actors.engine.models.scenario import Scenario, parse_scenario
from actors.engine.tools.builtin_tools import BUILTIN_TOOLS
from actors.turn.agent import Agent, ModelContext
from actors.turn.compaction import progress, read_summary
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.recovery import NUDGE_PREFIX
from actors.turn.tools import EffectSink, ToolRegistry
from bus.errors import ConfigError, ContextLengthError, FatalLLMError, RetryableLLMError
from bus.messages import Message, ToolCall
from store.domain.effects import MODEL_REPLY_PREFIX
from store.records import SCRIPTED_AGENT, TurnInput

#: Size of a reply of the ``oversized`` fault: twice the default ``max_model_reply_bytes``.
OVERSIZED_REPLY_BYTES = 2 << 20


def payload(seed: str, size: int) -> str:
    """``size`` characters of deterministic filler derived from ``seed``."""
    block = hashlib.sha256(seed.encode()).hexdigest()
    return (block * (size // len(block) + 1))[:size]


#: Model clients made in this process: with the pid, what makes each client's random replies
#: its own (a resumed turn gets a new client, on a new host or in a new process).
_CLIENTS = itertools.count()


class ScriptedLLM:
    system = "phaseline"
    """Traces name the scripted model's system so."""

    def __init__(
        self, scenario: Scenario, *, baseline: int, effects: EffectSink | None = None
    ) -> None:
        """``effects``: where ``random`` replies are counted (None: not counted)."""
        self.scenario = scenario
        self.baseline = baseline
        self.model = f"scripted:{scenario.name}"
        self.effects = effects
        self._random = (
            random.Random(f"{scenario.seed}:{os.getpid()}:{next(_CLIENTS)}")
            if scenario.replies == "random"
            else None
        )

    async def complete(self, request: LLMRequest) -> LLMReply:
        message, repeats = await self._reply(request)
        if self._random is not None and not repeats:
            message = self._randomised(message)
            if self.effects is not None:
                await self.effects.increment(request.turn_id, replied_key(request.messages))
        return LLMReply(message, finish_reason="tool_calls" if message.tool_calls else "stop")

    def _randomised(self, message: Message) -> Message:
        """``message`` as a sampling model would say it this time: the same shape (text,
        calls and their tools), with fresh randomness at the start of the text and of each
        call's ``text`` argument."""
        rng = self._random
        assert rng is not None
        if not message.text and not message.tool_calls:
            return message  # an empty reply stays empty (the ``empty`` fault)

        def fresh(text: str) -> str:
            nonce = f"{rng.getrandbits(64):016x}"
            return nonce + text[len(nonce) :] if len(text) > len(nonce) else nonce

        calls = tuple(
            c.model_copy(update={"args": {**c.args, "text": fresh(str(c.args.get("text", "")))}})
            for c in message.tool_calls
        )
        return message.model_copy(update={"text": fresh(message.text), "tool_calls": calls})

    async def _reply(self, request: LLMRequest) -> tuple[Message, bool]:
        """The reply, and whether it must repeat itself word for word (the ``loop`` fault's
        calls, which a ``random`` model repeats too: a loop is the same call again)."""
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
            return Message(role="assistant", text=f"Stopping here. {text}"), False
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
                return Message(role="assistant", text=""), False
            if fault.kind == "oversized" and _nudges_since_last_reply(turn) < fault.times:
                oversized = payload(f"{seed}|oversized", OVERSIZED_REPLY_BYTES)
                return Message(role="assistant", text=oversized), False
        looping = any(f.kind == "loop" and call >= f.at_call for f in sc.faults)
        if looping:
            args = {"text": "same again", "delay_ms": sc.tool_latency_ms}
            again = ToolCall(id=f"call_{call}_0", name=sc.tools[0], args=args)
            return Message(
                role="assistant", text="Let me try that once more.", tool_calls=(again,)
            ), True
        if done.rounds >= sc.rounds:
            final = payload(f"{seed}|final", sc.payload_bytes)
            return Message(role="assistant", text=final), False
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
        text = payload(f"{seed}|reply|{r}", sc.payload_bytes)
        return Message(role="assistant", text=text, tool_calls=calls), False


def replied_key(messages: Sequence[Message]) -> str:
    """The effects field counting complete replies to this transcript: a second count is a
    reply paid for again (the transcript it answered is the same only if nothing of the first
    reply was kept)."""
    h = hashlib.blake2b(digest_size=12)
    for m in messages:
        h.update(m.model_dump_json().encode())
    return f"{MODEL_REPLY_PREFIX}{h.hexdigest()}"


def _nudges_since_last_reply(turn: Sequence[Message]) -> int:
    """Nudges the current call has had (a reply not kept leaves only its nudge)."""
    told = 0
    for m in reversed(turn):
        if m.role == "assistant":
            break
        told += m.role == "user" and m.text.startswith(NUDGE_PREFIX)
    return told


@dataclass(frozen=True, slots=True)
class ScriptedAgent(Agent):
    """The scripted model and the built-in tools, run from a scenario in the turn's context
    (``{"scenario": {...}}``): the agent of the tests, the demo, chaos and the bench."""

    def scenario(self, turn_input: TurnInput) -> Scenario:
        data = turn_input.context.get("scenario")
        if not isinstance(data, dict):
            raise ConfigError("the scripted agent needs a scenario table in the input's context")
        return parse_scenario(data, source="scenario of the turn")

    def check_input(self, turn_input: TurnInput) -> None:
        self.tools.require(self.scenario(turn_input).tools)

    def registry(self, turn_input: TurnInput) -> ToolRegistry:
        approved = self.scenario(turn_input).require_approval
        return Agent.registry(self, turn_input).with_approval(approved)


def _scripted_model(ctx: ModelContext) -> ScriptedLLM:
    return ScriptedLLM(agent.scenario(ctx.input), baseline=ctx.baseline, effects=ctx.effects)


#: The scripted agent (its import path is :data:`~store.records.SCRIPTED_AGENT`).
agent = ScriptedAgent(
    model=_scripted_model,
    tools=BUILTIN_TOOLS,
    system_prompt="You are a phaseline scripted agent. Use the tools, then answer.",
    model_name="scripted",
)


def scripted_turn(scenario: Scenario) -> tuple[str, TurnInput]:
    """The agent path and input of a turn that runs ``scenario``."""
    context = {"scenario": scenario.model_dump(mode="json")}
    return SCRIPTED_AGENT, TurnInput(message=scenario.prompt, context=context)
