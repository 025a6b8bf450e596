"""Token totals per agent, counted once: the final save of a turn adds its tokens; and the
writes fencing refused.

The totals live in one hash per shard (``KeyLayout.usage``, fields ``<counter>|<agent>``), so
the save script (``store/lua/checkpoint_save.lua``) adds a finished turn's counters in the same
atomic step that writes its final record: a turn is added exactly when its record goes from in
progress to final, never twice (a replayed or fenced save writes nothing) and never lost (no
final record without its tally). A suspended turn is not final and is not added; it is when it
finishes after an operator resumes it. Running turns' tokens are in their records; a session's
total is its newest turn's ``session_prior`` plus its ``tokens``
(``actors.engine.submission.session_tokens``).

Tokens of model calls lost with a host (made after the turn's last checkpoint) are in no record:
``resumes`` counts the lost incarnations whose usage is unknown.

The same hash counts every write a script refused because a newer owner holds the turn
(``fenced|<what>``, :class:`FencedWrite`): a zombie host, a partitioned one whose held writes
arrive after its successor claimed its turns, a rival resumer. Counted by Redis itself, so a
writer that died with its refusal unread is counted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from bus.messages import Usage
from bus.outcomes import Outcome
from store.codec import EncodedRecord
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.views.shard_sums import summed

__all__ = [
    "FENCED_SAVE",
    "TALLY_COUNTERS",
    "AgentUsage",
    "FencedWrite",
    "Tally",
    "agent_usage",
    "fenced_writes",
    "outcome_counts",
]

#: What the save script adds per agent, in the order of its ARGV.
TALLY_COUNTERS = ("turns", "prompt", "completion", "cached", "unmetered", "resumes")


class FencedWrite(StrEnum):
    """A write refused by fencing, by what it was (a field ``fenced|<value>`` of the hash)."""

    SAVE = "save"
    """A checkpoint save (``checkpoint_save.lua``'s ``stale_epoch``)."""
    CLAIM = "claim"
    """A tool batch's claim: its calls not dispatched (``ledger_claim.lua``)."""
    CAS = "cas"
    """A fenced change of ledger entries (``ledger_cas.lua``)."""


#: The field the ``multi_exec`` save counts a fenced save in, as the save script does.
FENCED_SAVE = f"fenced|{FencedWrite.SAVE}"


@dataclass(frozen=True, slots=True)
class AgentUsage:
    """One agent's finished turns and their tokens."""

    agent: str
    """The agent's import path (empty: turns of records written before schema 3)."""
    turns: int
    """Finished turns."""
    tokens: Usage
    """Their tokens, as the endpoints reported them."""
    unmetered_calls: int
    """Their model calls whose endpoint reported no usage."""
    lost_incarnations: int
    """Their resumes after a lost host: each lost the usage of the calls it made after its
    last checkpoint (usually one)."""


@dataclass(frozen=True, slots=True)
class Tally:
    """What a save that ends its turn adds to the shard's counters (the save script adds it
    only if the stored record was in progress: once per turn)."""

    agent: str
    """The agent's import path (``-`` for none); empty: the save adds nothing."""
    counters: tuple[int, ...]
    """One value per :data:`TALLY_COUNTERS`, in that order."""
    outcome: str
    """The outcome it ends with (counted as ``outcome|<outcome>``); empty: none."""

    @classmethod
    def of(cls, record: EncodedRecord) -> Tally:
        """``record``'s tally: its agent, counters and outcome when the save ends the turn
        (a suspension does not), else nothing."""
        nothing = cls("", (0,) * len(TALLY_COUNTERS), "")
        if record.in_progress:
            return nothing
        c = record.counters()
        if c.outcome is not None and c.outcome.suspended:
            return nothing
        t = c.tokens
        return cls(
            str(record.fields.get("agent", "")) or "-",
            (
                1,
                t.prompt_tokens,
                t.completion_tokens,
                t.cached_tokens,
                c.unmetered_calls,
                c.resume_attempts,
            ),
            "" if c.outcome is None else c.outcome.value,
        )

    def argv(self) -> list[str | int]:
        """The save script's tally ARGV: the agent, the counters, the outcome."""
        return [self.agent, *self.counters, self.outcome]

    def commands(self, usage_key: str) -> list[tuple[str, str, str, int]]:
        """The same additions as commands (the ``multi_exec`` save's)."""
        if not self.agent:
            return []
        out = [
            ("HINCRBY", usage_key, f"{name}|{self.agent}", n)
            for name, n in zip(TALLY_COUNTERS, self.counters, strict=True)
            if n
        ]
        if self.outcome:
            out.append(("HINCRBY", usage_key, f"outcome|{self.outcome}", 1))
        return out


async def agent_usage(client: StoreClient, keys: KeyLayout) -> list[AgentUsage]:
    """Every agent's totals in the namespace (one read per shard), by agent."""
    sums: dict[str, dict[str, int]] = {}
    for field, n in (await summed(client, keys, keys.usage, "the agents' token totals")).items():
        counter, _, agent = field.partition("|")
        if counter in TALLY_COUNTERS:
            sums.setdefault(agent, dict.fromkeys(TALLY_COUNTERS, 0))[counter] += n
    return [
        AgentUsage(
            agent="" if agent == "-" else agent,
            turns=n["turns"],
            tokens=Usage(
                prompt_tokens=max(0, n["prompt"]),
                completion_tokens=max(0, n["completion"]),
                cached_tokens=max(0, n["cached"]),
            ),
            unmetered_calls=n["unmetered"],
            lost_incarnations=n["resumes"],
        )
        for agent, n in sorted(sums.items())
    ]


async def outcome_counts(client: StoreClient, keys: KeyLayout) -> dict[Outcome, int]:
    """Finished turns per outcome, all time (the final saves count them with the tokens; a
    turn whose record expired or was purged stays counted)."""
    counts: dict[Outcome, int] = {}
    for field, n in (await summed(client, keys, keys.usage, "the outcome counts")).items():
        kind, _, value = field.partition("|")
        if kind == "outcome" and value in Outcome.__members__.values() and n > 0:
            counts[Outcome(value)] = n
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


async def fenced_writes(client: StoreClient, keys: KeyLayout) -> dict[FencedWrite, int]:
    """Writes refused by fencing, all time, by kind (every kind present, zeros included)."""
    counts = dict.fromkeys(FencedWrite, 0)
    for field, n in (await summed(client, keys, keys.usage, "the fenced writes")).items():
        kind, _, value = field.partition("|")
        if kind == "fenced" and value in FencedWrite.__members__.values():
            counts[FencedWrite(value)] += n
    return counts
