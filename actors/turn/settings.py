"""The knobs of a turn loop (:class:`LoopSettings`); defaults are the production values."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.turn.loopdetect import LoopThresholds


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Knobs of the loop; defaults are the production values of DESIGN §3-4."""

    strict: bool = False
    """Illegal phase transitions raise (tests) instead of being logged and counted."""
    checkpoint_min_interval_s: float = 2.0
    """Minimum seconds between mid-turn saves (0 in tests); never delays the final save."""
    checkpoint_mid_turn: bool = True
    """False skips every mid-turn save (only the final one is written): what ``phaseline
    bench`` compares against to price durability. Never off in production."""
    approval_timeout_s: float = 300.0
    """Cap on ``awaiting_approval``; the call is denied past it."""
    approval_poll_s: float = 0.2
    """How often a pending approval is re-read from Redis."""
    backoff_scale: float = 1.0
    """Multiplier of the 1 s / 2 s / 4 s retry backoff and of a rate-limit backoff the endpoint
    did not name (tests shrink it); a wait the endpoint asked for is kept as asked."""
    rate_limit_max_wait_s: float = 600.0
    """Cap on the seconds one model call waits on the endpoint's rate limit; past it the turn
    aborts ``rate_limited``."""
    loop_thresholds: LoopThresholds = field(default_factory=LoopThresholds)
    """When the loop detector suspects and stops."""
    max_tool_rounds: int | None = None
    """Tool rounds a turn may run; past it the turn wraps up in ``force_stop`` (the agent's
    limit)."""
    compact_at_chars: int | None = None
    """Compact before a model call once the transcript holds this many characters."""
    max_tokens_per_turn: int | None = None
    """The agent's token budget per turn; past it the turn wraps up (``budget_exhausted``)."""
    max_tokens_per_session: int | None = None
    """The agent's token budget per session (this turn's and its earlier turns' tokens); past
    it the turn wraps up the same way."""
    max_reply_bytes: int = 1 << 20
    """Cap on one model reply (its text and tool calls' arguments, UTF-8 bytes): a larger one
    is not kept; the model is told its size and the cap (a nudge), and asked again."""
