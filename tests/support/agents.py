"""Agents the tests name by import path (``tests.support.agents:NAME``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from actors.engine.models import scripted
from actors.engine.models.openai_chat import OpenAIChat
from actors.harness.http_agents import TEST_KEY_ENV as TEST_KEY_ENV
from actors.harness.http_agents import http_agent, http_stream

# The harness's HTTP agents, by this module's path too (the tests name them here).
from actors.harness.http_agents import http_bump as http_bump
from actors.harness.http_agents import http_json as http_json
from actors.harness.http_agents import http_limited_bench as http_limited_bench
from actors.turn.agent import Agent, AgentSettings, ModelContext
from actors.turn.llm import LLMReply, LLMRequest, ModelLimits
from actors.turn.loopdetect import LoopThresholds
from actors.turn.mcp import MCPServer
from actors.turn.tools import ToolContext, ToolRegistry, tool
from bus.errors import StoreError, StoreRefused
from bus.messages import Message, ToolCall
from store.records import TurnInput
from store.views.archive import FinishedTurn

#: Threads the sync tool ran in (it must not run on the event loop's thread).
ADD_THREADS: list[int] = []


@tool(idempotent=True)
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    ADD_THREADS.append(threading.get_ident())
    return a + b


@tool
async def explode(reason: str) -> str:
    """Fail on purpose.

    Args:
        reason: What to say.
    """
    raise RuntimeError(reason)


class PlannedModel:
    """First asks for a batch of good, bad and unknown calls, then answers with what it read."""

    async def complete(self, request: LLMRequest) -> LLMReply:
        results = [m.tool_result for m in request.messages if m.tool_result is not None]
        if not results:
            calls = (
                ToolCall(id="c1", name="add", args={"a": 2, "b": 3}),
                ToolCall(id="c2", name="add", args={"a": "two"}),
                ToolCall(id="c3", name="add", args={"a": 1, "c": 1}),
                ToolCall(id="c4", name="nosuch", args={}),
                ToolCall(id="c5", name="explode", args={"reason": "on purpose"}),
            )
            return LLMReply(Message(role="assistant", text="calling", tool_calls=calls))
        text = " | ".join(f"{r.status}: {r.output}" for r in results)
        return LLMReply(Message(role="assistant", text=text))


def _planned(_ctx: ModelContext) -> PlannedModel:
    return PlannedModel()


calculator = Agent(
    model=_planned, tools=ToolRegistry([add, explode]), system_prompt="You add numbers."
)
limited = dataclasses.replace(scripted.agent, settings=AgentSettings(max_tool_rounds=1))
compacting = dataclasses.replace(scripted.agent, settings=AgentSettings(compact_at_chars=400))
impatient = dataclasses.replace(
    scripted.agent, settings=AgentSettings(tool_timeouts={"echo": 0.05})
)
not_an_agent = 42


#: llama.cpp-like: answers an empty stream when tools are offered.
http_no_tool_streams = http_agent("no-tool-streams")
#: Too-long prompts come back as empty streams.
http_small_context = http_agent("small-context")
#: A cap on every reply: 4 tokens (16 characters on the test server), then 2.
http_capped = http_agent("capped", max_tokens=4, stream=False)
http_tight = http_agent("tight", max_tokens=2, stream=False)
#: Declares the tests' endpoint's limit (set by ``POST /_limit``): 600 requests a minute, 5 at
#: once; every host admits its calls through the cluster's limiter.
http_limited = http_agent(
    "limited", stream=False, limits=ModelLimits(requests_per_minute=600, burst=5)
)
#: A budget of 100 tokens a turn (the tests' endpoint counts 4 characters a token).
http_budget = dataclasses.replace(
    http_agent("budget", stream=False), settings=AgentSettings(max_tokens_per_turn=100)
)
#: A budget of 150 tokens a session.
http_session_budget = dataclasses.replace(
    http_agent("session-budget", stream=False), settings=AgentSettings(max_tokens_per_session=150)
)
#: Needs its key even on a local endpoint.
http_keyed = http_agent("keyed", require_key=True)
#: An endpoint where nothing listens (port 9, discard, is closed here).
http_dead = dataclasses.replace(
    http_stream,
    model=OpenAIChat(model="dead", base_url="http://127.0.0.1:9/v1", api_key_env=None, timeout_s=5),
)


@tool(idempotent=True)
def file_name() -> str:
    """The name of a file on a disk whose names are not UTF-8, as Python reads it."""
    return os.fsdecode(b"report-\xff.txt")  # a lone surrogate: "report-\udcff.txt"


def unencodable_input() -> TurnInput:
    """Lone surrogates from all three sources: the input (a non-UTF-8 byte in argv), the tool
    (a non-UTF-8 file name) and the model (its reply carries the JSON escape \\ud800)."""
    script = {"rounds": 1, "tool": "file_name", "args": {}, "say": "done \ud800"}
    return TurnInput(message=f"#script {json.dumps(script)}\n" + os.fsdecode(b"list \xff"))


@tool(idempotent=True)
def dump() -> str:
    """Everything, at once: 2 MiB of it."""
    return "x" * (2 << 20)


#: Its tool returns more than one result may hold.
http_dump = dataclasses.replace(http_agent("dump"), tools=ToolRegistry([add, dump]))
#: Reads a file name no UTF-8 encoder takes.
http_files = dataclasses.replace(http_agent("files"), tools=ToolRegistry([add, file_name]))
#: Polls so far, per (turn, job): what ``job_status`` reports.
_POLLS: dict[tuple[str, int], int] = {}


@tool(idempotent=True)
def job_status(ctx: ToolContext, job: int) -> str:
    """How far a job got (a different answer at every poll, until it is done).

    Args:
        job: The job's id.
    """
    n = _POLLS[(ctx.turn_id, job)] = _POLLS.get((ctx.turn_id, job), 0) + 1
    return f"job {job}: step {n} of 4" if n < 4 else f"job {job}: done"


#: Polls ``job_status`` with the same arguments until the job is done.
http_poller = dataclasses.replace(http_agent("poller"), tools=ToolRegistry([add, job_status]))


class RecallModel:
    """Answers with every user message of the transcript it sees: what a session remembers.
    A last message ``#sleep N`` takes N seconds to answer (a turn that is still running)."""

    async def complete(self, request: LLMRequest) -> LLMReply:
        heard = [m.text for m in request.messages if m.role == "user"]
        if heard and heard[-1].startswith("#sleep "):
            await asyncio.sleep(float(heard[-1].split()[1]))  # the model's own latency
        return LLMReply(Message(role="assistant", text="heard: " + " | ".join(heard)))


recall = Agent(model=lambda _ctx: RecallModel(), system_prompt="You remember.")


#: Where the tests' MCP server logs its runs (set by conftest before Ray starts, so workers
#: see the same file).
MCP_LOG = os.environ.get("PHASELINE_MCP_LOG", "")

#: The tests' MCP server over stdio (``tests/support/mcp_counter_server.py``).
COUNTER = MCPServer(
    name="tools",
    command=sys.executable,
    args=("-m", "tests.support.mcp_counter_server"),
    env={"PHASELINE_MCP_LOG": MCP_LOG, "PHASELINE_MCP_BUMP_MS": "300"},
    cwd=str(Path(__file__).resolve().parents[2]),
    timeout_s=20,
)


class MCPPlanModel:
    """Calls the tools of ``input.context["calls"]`` (``[name, args]``), one per round, then
    answers with how many results it read (or the results, with ``"quote": true``)."""

    def __init__(self, ctx: ModelContext) -> None:
        self.calls = [(str(n), dict(a)) for n, a in ctx.input.context.get("calls", [])]
        self.quote = bool(ctx.input.context.get("quote", False))
        self.baseline = ctx.baseline

    async def complete(self, request: LLMRequest) -> LLMReply:
        turn = request.messages[self.baseline :]
        results = [m.tool_result for m in turn if m.tool_result is not None]
        if len(results) < len(self.calls):
            name, args = self.calls[len(results)]
            call = ToolCall(id=f"call_{len(results)}", name=name, args=args)
            return LLMReply(Message(role="assistant", text="", tool_calls=(call,)))
        if self.quote:
            text = " | ".join(f"{r.status}: {r.output}" for r in results)
        else:
            text = f"read {len(results)} tool results"
        return LLMReply(Message(role="assistant", text=text))


mcp_counter = Agent(model=MCPPlanModel, tools=ToolRegistry([add]), mcp=(COUNTER,))
mcp_time = Agent(
    model=MCPPlanModel,
    mcp=(
        MCPServer(
            name="time",  # the console script installed beside this interpreter
            command=str(Path(sys.executable).with_name("mcp-server-time")),
            args=("--local-timezone", "UTC"),
        ),
    ),
)
mcp_overridden = Agent(
    model=MCPPlanModel,
    mcp=(dataclasses.replace(COUNTER, idempotent={"plain": True, "slow": False}),),
)
mcp_broken = Agent(
    model=MCPPlanModel,
    mcp=(MCPServer(name="gone", command="/nonexistent/mcp-server", timeout_s=5),),
)
mcp_clash = Agent(
    model=MCPPlanModel,
    tools=ToolRegistry([dataclasses.replace(add, name="tools__echo")]),
    mcp=(COUNTER,),
)

#: The tests' MCP server over streamable HTTP (the ``mcp_http_server`` fixture), with a key.
MCP_HTTP_SECRET = "sk-mcp-secret-0123456789"
mcp_http = Agent(
    model=MCPPlanModel,
    mcp=(
        MCPServer(
            name="remote",
            url=f"http://127.0.0.1:{os.environ.get('PHASELINE_MCP_HTTP_PORT', '9')}/mcp",
            headers={"Authorization": f"Bearer {MCP_HTTP_SECRET}"},
            timeout_s=20,
        ),
    ),
)

#: A tool whose calls need half a CPU: its ToolWorker pool holds ``num_cpus = 0.5`` each.
heavy = Agent(
    model=MCPPlanModel,
    tools=ToolRegistry([dataclasses.replace(add, name="add_heavy", resources={"num_cpus": 0.5})]),
)


#: A tool agent on the real model server (the ``llama_server`` fixture, whose URL conftest puts
#: in ``$PHASELINE_LLAMA_URL`` before Ray starts): greedy, short replies, streaming asked for
#: (the server answers an empty stream when tools are offered: the client falls back to JSON).
#: SmolLM2 calls ``add`` with the same arguments again and again; a repeat of the same result
#: is skipped and nudged, the next one stops the turn, and the model wraps up in text.
llama_adder = Agent(
    model=OpenAIChat(
        model="smollm2",
        base_url=os.environ.get("PHASELINE_LLAMA_URL"),
        api_key_env=None,
        temperature=0,
        max_tokens=48,
    ),
    tools=ToolRegistry([add]),
    system_prompt="You add numbers with the add tool, then say the sum.",
    settings=AgentSettings(
        max_tool_rounds=3, loop_thresholds=LoopThresholds(suspect_repeats=1, stop_repeats=2)
    ),
    model_name="smollm2",
)


@tool(name="add", idempotent=False)
async def add_and_record(ctx: ToolContext, a: int, b: int = 0) -> str:
    """Add two integers and record the sum.

    Args:
        a: The first addend.
        b: The second addend.
    """
    if ctx.effects is None:
        raise RuntimeError("add needs a side-effect store")
    await ctx.effects.increment(ctx.turn_id, ctx.call_key)  # the record: acts at once,
    await asyncio.sleep(3)  # then waits for its acknowledgement (a kill lands here)
    return str(a + b)


#: Text only, long answers, on llama.cpp's own C++ server (``$PHASELINE_LLAMA_CPP_URL``, set in
#: the model workers' environment by the test that starts it): each generation takes seconds,
#: what a kill lands in.
llama_writer = Agent(
    model=OpenAIChat(
        model="smollm2",
        base_url=os.environ.get("PHASELINE_LLAMA_CPP_URL"),
        api_key_env=None,
        max_tokens=96,
    ),
    system_prompt="You write short stories.",
    model_name="smollm2",
)


#: :data:`llama_adder` with a non-idempotent ``add`` that records each run from outside, then
#: takes 3 s: real sampling, a real side effect in flight at a crash.
llama_recorder = dataclasses.replace(llama_adder, tools=ToolRegistry([add_and_record]))


#: Where :func:`archive` writes: a file per turn, so a test on any process reads what it got.
ARCHIVE_DIR = Path(tempfile.gettempdir()) / "phaseline-tests-on-finish"


def archived(turn_id: str) -> Path:
    return ARCHIVE_DIR / f"{turn_id.replace('/', '~')}.jsonl"


def archive(turn: FinishedTurn) -> None:
    """An ``on_finish`` hook: appends the turn's export line to its file (twice = called twice)."""
    ARCHIVE_DIR.mkdir(exist_ok=True)
    with archived(turn.turn_id).open("a", encoding="utf-8") as sink:
        sink.write(turn.json_line())


async def archive_or_fail(turn: FinishedTurn) -> None:
    """An ``on_finish`` coroutine that fails for turns whose id starts with ``bad``."""
    if turn.turn_id.startswith("bad"):
        raise RuntimeError("the archive is down")
    archive(turn)


not_a_hook = "archive"


#: Model calls the buggy model had, per turn (this process's).
BUGGY_CALLS: dict[str, int] = {}


class BuggyModel:
    """A model adapter with a bug: every call raises an error no client maps (a KeyError)."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id

    async def complete(self, request: LLMRequest) -> LLMReply:
        BUGGY_CALLS[self.turn_id] = BUGGY_CALLS.get(self.turn_id, 0) + 1
        raise KeyError("choices")


#: Its model adapter fails with an unexpected error on every call.
buggy = Agent(
    model=lambda ctx: BuggyModel(ctx.turn_id), tools=ToolRegistry([add]),
    system_prompt="You add numbers.",
)  # fmt: skip


@tool(idempotent=True)
async def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds:g} s"


@tool(idempotent=True)
async def lose_store() -> str:
    """Fail as a tool whose store dropped under it."""
    raise StoreError("the effects store went away")


@tool(idempotent=True)
async def refuse_write() -> str:
    """Fail as a tool whose effect's write Redis refused."""
    raise StoreRefused("OOM command not allowed when used memory > 'maxmemory'")


#: A ToolWorker's group of calls ending every way a call can end.
group_ends = dataclasses.replace(
    calculator, tools=ToolRegistry([add, explode, nap, lose_store, refuse_write])
)


#: Eight calls of :func:`meets` must all run at once to pass their barrier.
MEETING = threading.Barrier(8, timeout=20)


@tool(idempotent=True)
def meets(n: int) -> str:
    """Wait at a barrier of eight (a sync tool, so in a thread).

    Args:
        n: Which of the eight.
    """
    MEETING.wait()
    return f"met {n}"


@tool(idempotent=True, timeout_s=1.0)
def hangs() -> str:
    """A sync tool that never returns."""
    threading.Event().wait()
    return "never"


class Crowd:
    """How many calls of :func:`crowds` run at once now, and the most that ever did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0


CROWD = Crowd()


@tool(idempotent=True)
def crowds(n: int) -> str:
    """A sync tool that counts the calls of it running at once (in threads).

    Args:
        n: Which call.
    """
    with CROWD.lock:
        CROWD.now += 1
        CROWD.most = max(CROWD.most, CROWD.now)
    time.sleep(0.2)  # the tool's own work: long enough for the others to queue behind it
    with CROWD.lock:
        CROWD.now -= 1
    return f"crowd {n}"


class BatchModel:
    """Asks once for one batch of the given calls, then answers with what it read."""

    def __init__(self, calls: tuple[ToolCall, ...]) -> None:
        self.calls = calls

    async def complete(self, request: LLMRequest) -> LLMReply:
        results = [m.tool_result for m in request.messages if m.tool_result is not None]
        if not results:
            return LLMReply(Message(role="assistant", text="calling", tool_calls=self.calls))
        text = " | ".join(f"{r.name} {r.status}: {r.output}" for r in results)
        return LLMReply(Message(role="assistant", text=text))


#: Eight sync calls that pass only if they all run at once (not queued in a small pool).
meeting = Agent(
    model=lambda _ctx: BatchModel(
        tuple(ToolCall(id=f"m{i}", name="meets", args={"n": i}) for i in range(8))
    ),
    tools=ToolRegistry([meets]),
)
#: Six sync calls in one batch, which a process with fewer threads for sync tools queues.
crowd = Agent(
    model=lambda _ctx: BatchModel(
        tuple(ToolCall(id=f"c{i}", name="crowds", args={"n": i}) for i in range(6))
    ),
    tools=ToolRegistry([crowds]),
)
#: A sync call that never returns: its turn goes on after the call's timeout, and the process
#: exits when its work is done (the thread is left, not joined).
hanging = Agent(
    model=lambda _ctx: BatchModel((ToolCall(id="h", name="hangs", args={}),)),
    tools=ToolRegistry([hangs]),
)


@tool(idempotent=True)
async def hogs() -> str:
    """An async tool that blocks the event loop (time.sleep instead of asyncio.sleep)."""
    time.sleep(0.8)  # noqa: ASYNC251 (on purpose: the mistake this tool plays)
    await asyncio.sleep(0)
    return "done hogging"


#: One loop-blocking async call: reported, not silent.
hogging = Agent(
    model=lambda _ctx: BatchModel((ToolCall(id="g", name="hogs", args={}),)),
    tools=ToolRegistry([hogs]),
)
