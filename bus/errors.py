"""The phaseline error hierarchy.

Every error phaseline raises on purpose derives from :class:`PhaselineError`, so a caller can
catch "anything phaseline refused" in one place. Third-party errors (``redis.RedisError``,
Ray's ``RayActorError``) are translated into these at the module that talks to the library;
nothing above that boundary should see a raw third-party exception.
"""

from __future__ import annotations


class PhaselineError(Exception):
    """Root of every error raised by phaseline."""


class ConfigError(PhaselineError):
    """A CLI flag, config file or scenario is invalid; the message says which and why."""


class MissingExtra(ConfigError):
    """A feature whose libraries are an optional part of phaseline (an extra: ``console``,
    ``otel``, ``plots``) was asked for where they are not installed; the message names the
    ``pip install`` that brings them."""


class IllegalTransition(PhaselineError):
    """A phase transition not in the table was attempted (raised in strict mode only)."""


class StoreError(PhaselineError):
    """Redis refused or failed an operation (translated ``redis.RedisError``). The subclasses
    say whether waiting helps: :class:`StoreUnavailable` is transient; records that are bad,
    missing or already there (:class:`RecordError`, :class:`RecordNotFound`,
    :class:`TurnExists`) stay so."""


class StoreUnavailable(StoreError):
    """Redis is away for now: connection lost or refused, a timeout, the server loading its
    AOF, out of memory, a failover. The same operation may succeed later."""


class StoreRefused(StoreUnavailable):
    """Redis answered that it did not run the command: out of memory, writes stopped by a
    failing disk, a read-only replica, loading, a cluster slot moving. Unlike a lost
    connection (where a write may or may not have landed) nothing was written, so whatever the
    write guarded (a tool's dispatch, its effect) is known not to have happened and may be
    tried again. A script is refused only before its first write, so none is half applied."""


class StaleOwner(StoreError):
    """A save was refused by fencing: a newer owner (epoch) or a newer checkpoint (seq) exists.

    The writer is a zombie or a losing racer and must stop driving the turn at once.
    """


class AlreadySaved(StoreError):
    """The very save (same epoch and seq) is already stored: a replayed request, not a loss,
    and not a fencing refusal (deliberately no :class:`StaleOwner`): ``save`` answers it with
    an ack; ``save_many`` reports it per record so a resending client can count it acked.
    """


class RecordError(StoreError):
    """A record read from Redis is not a valid phaseline record; it has been quarantined."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class UnknownSchema(RecordError):
    """A record carries a schema version this build does not understand."""


class RecordTooLarge(StoreError):
    """A record is larger than ``[checkpoint] max_record_bytes``; it was not sent. The turn
    ends ``aborted:record_too_large`` on top of its last checkpoint, which stays intact."""


class UnstorableRecord(StoreError):
    """A value could not be encoded for Redis (text no encoder takes, a type msgpack lacks):
    the turn holding it ends on its last record (``aborted:unstorable``); others go on."""


class NotDurable(StoreError):
    """A save was written but did not reach the configured durability (``WAITAOF``/``WAIT``
    timed out, or the server cannot promise it); the caller saves again at its next site."""


class RecordNotFound(StoreError):
    """No record exists for the requested turn."""


#: Characters of an endpoint's error message an :class:`LLMError` keeps (and a record stores).
ERROR_EXCERPT_CHARS = 500


class LLMError(PhaselineError):
    """Base of the typed errors an :class:`~actors.turn.llm.LLMClient` may raise.

    Besides its message, an error carries what a person needs to tell one failure from another:
    the HTTP status, the provider's error code and the request id, when the endpoint gave them.
    The loop keeps these in the turn's record (``Counters.last_error``); a client must never put
    a key or a header in any of them."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message[:ERROR_EXCERPT_CHARS])
        self.status = status
        """The endpoint's HTTP status (None: no HTTP answer, e.g. a refused connection)."""
        self.code = code
        """The provider's error code (``rate_limit_exceeded``, ``context_length_exceeded`` ...)."""
        self.request_id = request_id
        """The endpoint's id of the request (``x-request-id``), to quote to its operator."""


class RetryableLLMError(LLMError):
    """A transient model failure (rate limit, 5xx, timeout); the same request may succeed."""


class RateLimitedLLMError(RetryableLLMError):
    """The endpoint refused the call for its rate limit (HTTP 429, or the provider's rate-limit
    code): not a failure of the call, a turn to wait. The recovery policy waits as long as the
    endpoint asked, without spending the attempts meant for transient errors."""

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, request_id=request_id)
        self.retry_after_s = retry_after_s
        """How long the endpoint asked to wait (``retry-after-ms``, ``retry-after``,
        ``x-ratelimit-reset-*``); None when it did not say."""


class AwaitingAdmission(RateLimitedLLMError):
    """The cluster's limiter for the endpoint holds the call back (a declared limit, or the
    provider's pause after a 429): nothing was sent. Waited for like a rate-limit refusal, but
    not an error of the turn."""

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        held_s: float = 0.0,
        status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(
            message, retry_after_s=retry_after_s, status=status, code=code, request_id=request_id
        )
        self.held_s = held_s
        """Seconds the call was already held where it runs (a model worker waits for the
        limiter itself before it answers this): part of the turn's rate-limit wait."""


class ContextLengthError(LLMError):
    """The transcript no longer fits the model's context window; compaction may help."""


class FatalLLMError(LLMError):
    """A model failure that retrying will not fix (bad request, auth)."""


class HardIdleTimeout(LLMError):
    """The watchdog cancelled an LLM call that sat idle past the hard timeout."""


class ToolError(PhaselineError):
    """A tool call could not be executed as asked."""


class UnknownTool(ToolError):
    """The model or a scenario named a tool that is not registered."""


class ToolArgumentsError(ToolError):
    """The model called a tool with arguments its schema refuses; the model reads why."""


class TurnExists(StoreError):
    """A turn with this id was already submitted."""


class ServiceRestarting(PhaselineError):
    """A Ray service actor died with a call in flight; Ray is restarting it, so the call may be
    repeated (translated ``RayActorError``)."""


class AgentCodeError(PhaselineError):
    """The agent's own model code raised on the model worker that ran the call (a bug, not a
    model failure): the turn's run fails as it would have in its host, and is suspended after
    a few runs (``suspended:failing``) instead of being retried as a model error."""


class PoisonGeneration(PhaselineError):
    """A model call killed the worker that ran it, and then the isolation worker that ran it
    alone, again and again: the poison-turn policy parks the turn (``suspended:poison``)
    instead of letting it take more workers, and the generations on them, down."""

    def __init__(self, message: str, deaths: int) -> None:
        super().__init__(message)
        self.deaths = deaths
        """Workers that died under the call (on its shared worker, then on the isolation
        worker)."""


class SessionBusy(PhaselineError):
    """A session already has a turn in progress (or suspended): its next turn must wait.

    A message for the running turn goes to its inbox instead (``Runtime.inject``)."""

    def __init__(self, message: str, turn_id: str) -> None:
        super().__init__(message)
        self.turn_id = turn_id
        """The session's turn that is not final."""


class NamespaceHeld(ConfigError):
    """Another deployment (another Ray cluster, or another process) runs this namespace: a
    second one is refused rather than run the same turns beside it."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder
        """Who holds it, for a person."""


class NotAwaitingApproval(ConfigError):
    """A decision on a tool call that is not waiting for one: no question was asked for it
    (call keys can be computed, so a decision taken before the question would let a call run
    that nobody approved)."""


class TurnNotRunning(ConfigError):
    """A message or a cancel for a turn that is not in progress (finished, suspended, or no
    such turn): nothing would ever read it, so it is refused."""

    def __init__(self, message: str, turn_id: str) -> None:
        super().__init__(message)
        self.turn_id = turn_id
        """The turn."""


class BudgetExhausted(PhaselineError):
    """A session has spent its agent's token budget (``AgentSettings.max_tokens_per_session``):
    it opens no more turns."""

    def __init__(self, message: str, spent: int, budget: int) -> None:
        super().__init__(message)
        self.spent = spent
        """Tokens the session's turns used, as their endpoints reported them."""
        self.budget = budget
        """The agent's budget per session."""


class ToolRaised(ToolError):
    """A tool's body raised what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
    a ``CancelledError`` of its own, a bare ``BaseException``): that call's error, stopped at
    the tool's boundary before it could end the process that ran it."""


class ToolExecutorLost(ToolError):
    """What ran a tool call went away mid-call (an MCP server process died, its connection
    dropped): nobody can tell whether the call took effect. An idempotent tool is re-run, any
    other is reported ``outcome_unknown``, as for a ToolWorker that died."""


class ToolUnavailable(ToolError):
    """What would run a tool call is not there (an MCP server that does not start): the call
    never began, so it is an error result the model reads."""
