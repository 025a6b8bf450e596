"""Tools as the loop sees them: specs, the registry and the :func:`tool` decorator (the
built-in tools are in ``actors.engine.tools.builtin_tools``).

A tool is an async function ``(args, ctx) -> str``. Its spec carries what the runtime needs to
run it safely: a timeout, a concurrency limit, whether re-running it is harmless (``idempotent``)
and whether a human must approve each call (``requires_approval``), plus what the model is told
about it (a description and the JSON schema of its arguments).

:func:`tool` makes a spec of a plain Python function: pydantic builds the argument schema from
its type hints and the docstring's ``Args:`` section, and validates what the model sends before
the function runs. Invalid arguments raise :class:`~bus.errors.ToolArgumentsError`, which, like
any exception of a tool, becomes an ``error`` result the model reads; the turn goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import time
import typing
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, overload

import docstring_parser
import pydantic
import pydantic_core

from bus.errors import ConfigError, ToolArgumentsError, ToolRaised, UnknownTool

log = logging.getLogger(__name__)


class EffectSink(Protocol):
    async def increment(self, turn_id: str, call_key: str) -> int: ...


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a running tool may know about its call."""

    turn_id: str
    """The turn that made the call."""
    call_key: str
    """Stable idempotency key; pass it downstream so a retried call can be deduplicated."""
    effects: EffectSink | None = None
    """Where ``counter_increment`` performs its side effect (None: no side-effect store)."""
    agent: str = ""
    """Import path of the agent that made the call."""
    epoch: int = 0
    """Owner epoch of the turn that runs the call (0: not told, as on a ToolWorker)."""


ToolFn = Callable[[Mapping[str, Any], ToolContext], Awaitable[str]]

#: The schema of a tool without arguments.
NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A registered tool and the rules for running it."""

    name: str
    """Name the model calls it by."""
    fn: ToolFn
    """The implementation."""
    idempotent: bool
    """Re-running it after a crash is harmless; if False a call caught in flight is never
    re-run but reported as ``outcome_unknown``."""
    requires_approval: bool = False
    """Each call waits in ``awaiting_approval`` for a decision (``on_timeout`` after the cap)."""
    approval_timeout_s: float | None = None
    """How long a call waits for its decision; None: the deployment's ``[loop]
    approval_timeout_s`` (5 minutes)."""
    on_timeout: Literal["deny", "approve"] = "deny"
    """What happens to a call nobody decided on in time (recorded as decided by
    ``timeout``)."""
    timeout_s: float = 30.0
    """Per-call timeout; the call's result is ``timeout`` past it."""
    max_concurrency: int = 64
    """Calls of this tool running at once in one process."""
    sync: bool = False
    """A plain function's: each call runs in a thread of its own, of which a process runs at
    most ``[tools] threads`` at once (a call waits for one)."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resources a call of this tool needs (its ToolWorker pool is keyed by them)."""
    description: str = ""
    """What the model is told the tool does."""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))
    """JSON schema of the arguments (an object schema)."""


class ToolRegistry:
    """Name -> spec. Immutable after construction; derive variants with :meth:`with_approval`."""

    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self._specs = {s.name: s for s in specs}

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def get(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownTool(f"unknown tool {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self._specs)

    def require(self, names: Iterable[str]) -> None:
        """Raise ConfigError naming every tool in ``names`` that is not registered."""
        missing = sorted(set(names) - set(self._specs))
        if missing:
            raise ConfigError(f"unknown tools {missing}; registered: {self.names()}")

    def with_approval(self, names: Iterable[str]) -> ToolRegistry:
        """This registry with ``names`` requiring approval (itself when none is named: a
        turn's registry is built at every start, so the common case builds nothing)."""
        wanted = set(names)
        if not wanted:
            return self
        self.require(wanted)
        return ToolRegistry(
            replace(s, requires_approval=True) if s.name in wanted else s
            for s in self._specs.values()
        )


@overload
def tool(fn: Callable[..., Any], /) -> ToolSpec: ...
@overload
def tool(
    *,
    name: str | None = None,
    idempotent: bool = False,
    requires_approval: bool = False,
    approval_timeout_s: float | None = None,
    on_timeout: Literal["deny", "approve"] = "deny",
    timeout_s: float = 30.0,
    max_concurrency: int = 64,
    resources: Mapping[str, float] | None = None,
) -> Callable[[Callable[..., Any]], ToolSpec]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    idempotent: bool = False,
    requires_approval: bool = False,
    approval_timeout_s: float | None = None,
    on_timeout: Literal["deny", "approve"] = "deny",
    timeout_s: float = 30.0,
    max_concurrency: int = 64,
    resources: Mapping[str, float] | None = None,
) -> ToolSpec | Callable[[Callable[..., Any]], ToolSpec]:
    """Make a :class:`ToolSpec` of a plain function (``@tool`` or ``@tool(...)``).

    The function may be async or sync (a sync one runs in a thread, off the event loop; a
    timeout abandons it there but cannot stop it). Its parameters, with type hints, are the
    tool's arguments; one parameter annotated :class:`ToolContext` receives the call's context
    instead. It returns a string, or anything pydantic can serialise (sent to the model as
    JSON). Not idempotent unless it says so: a call caught in flight by a crash is then
    reported ``outcome_unknown`` and never re-run.
    """

    def build(f: Callable[..., Any]) -> ToolSpec:
        return _python_tool(
            f,
            name=name or f.__name__,
            idempotent=idempotent,
            requires_approval=requires_approval,
            approval_timeout_s=approval_timeout_s,
            on_timeout=on_timeout,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            resources=dict(resources or {}),
        )

    return build if fn is None else build(fn)


#: A stretch an async tool may run without awaiting before it is reported as blocking the
#: event loop (every turn and call of the process waits while it runs).
BLOCKING_S = 0.5
#: Steps of async tools that held the event loop past :data:`BLOCKING_S`, by tool.
BLOCKED = Counter[str]()


class TimedSteps:
    """Awaits an async tool's coroutine one step at a time, timing each stretch it runs
    without awaiting: a step past :data:`BLOCKING_S` held the event loop (a ``time.sleep``, a
    blocking client), stalling every other turn and call of the process, and is reported.
    It cannot be stopped (a timeout fires only once the step yields), only made known."""

    __slots__ = ("_coro", "_name")

    def __init__(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._coro = coro
        self._name = name

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        value: Any = None
        error: BaseException | None = None
        while True:
            started = time.perf_counter()
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:
                self._timed(started)
                return done.value
            except BaseException:
                self._timed(started)
                raise
            self._timed(started)
            try:
                value, error = (yield step), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task: a cancel, most often
                value, error = None, exc

    def _timed(self, started: float) -> None:
        held = time.perf_counter() - started
        if held > BLOCKING_S:
            BLOCKED[self._name] += 1
            log.warning(
                "tool %s held the event loop for %.1f s without awaiting: every turn and call "
                "of this process waited meanwhile; make it await, or a plain function (which "
                "runs in a thread of its own)",
                self._name,
                held,
            )


#: Sync tool calls whose caller stopped waiting (a timeout, a cancel) while their thread ran on.
ABANDONED = Counter[str]()


async def in_own_thread(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Run a sync tool in a daemon thread of its own: never queued behind other turns' calls
    in a small shared pool, and never holding the process at exit when it does not return
    (asyncio's pool joins its threads at shutdown; a thread cannot be stopped, only left).
    A call given up while its thread runs is counted in :data:`ABANDONED` and logged."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, exc: BaseException | None) -> None:
        if done.done():  # its caller gave up on it
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(value)

    def work() -> None:
        value, error = None, None
        try:
            value = context.run(fn, **kwargs)
        except BaseException as exc:  # handed to the caller, whose boundary judges it
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=f"tool {name}", daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:
        ABANDONED[name] += 1
        log.warning(
            "tool %s: its call was given up while its thread runs on (a thread cannot be "
            "stopped; %d such calls of it so far)",
            name,
            ABANDONED[name],
        )
        raise


async def within_boundary(body: Awaitable[str]) -> str:
    """Await a tool's body so that nothing it raises ends the process running it: an
    ``Exception`` passes as it is (the runner makes it the call's error), anything else
    (``SystemExit``, ``KeyboardInterrupt``, a ``CancelledError`` nobody asked for, a bare
    ``BaseException``) becomes :class:`ToolRaised`. A real cancel of the call (its timeout,
    its turn's cancel) still cancels. Awaited inside the caller's task, so asyncio never sees
    the exception reach a task's edge (where it would stop the event loop)."""
    try:
        return await body
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the call itself was cancelled
        raise ToolRaised("the tool raised CancelledError of its own") from None
    except Exception:
        raise
    except BaseException as exc:
        raise ToolRaised(f"the tool raised {type(exc).__name__}: {exc}") from None


def _python_tool(f: Callable[..., Any], *, name: str, **rules: Any) -> ToolSpec:
    doc = docstring_parser.parse(inspect.getdoc(f) or "")
    described = {p.arg_name: p.description for p in doc.params if p.description}
    hints = typing.get_type_hints(f, include_extras=True)
    ctx_param: str | None = None
    fields: dict[str, Any] = {}
    for param in inspect.signature(f).parameters.values():
        hint = hints.get(param.name, Any)
        if hint is ToolContext:
            ctx_param = param.name
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(f"tool {name}: parameter {param.name} must be a named parameter")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hint, pydantic.Field(default, description=described.get(param.name)))
    try:
        args_model = pydantic.create_model(
            f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        schema = args_model.model_json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError) as exc:
        raise ConfigError(f"tool {name}: its arguments have no JSON schema: {exc}") from exc
    schema.pop("title", None)
    description = "\n\n".join(d for d in (doc.short_description, doc.long_description) if d)
    is_async = inspect.iscoroutinefunction(f)

    async def call(args: Mapping[str, Any], ctx: ToolContext) -> str:
        try:
            parsed = args_model.model_validate(dict(args))
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            raise ToolArgumentsError(f"invalid arguments for {name}: {problems}") from None
        kwargs = {k: getattr(parsed, k) for k in fields}
        if ctx_param is not None:
            kwargs[ctx_param] = ctx
        if is_async:
            result = await TimedSteps(f(**kwargs), name)
        else:
            result = await in_own_thread(name, f, kwargs)
        return result if isinstance(result, str) else pydantic_core.to_json(result).decode()

    return ToolSpec(
        name, call, description=description, parameters=schema, sync=not is_async, **rules
    )
