"""The poison-turn policy: tell a turn that kills its hosts from one that was only unlucky.

Pure logic, no Ray and no Redis: the resume planner (``actors.engine.resume``) applies it at every
claim, and docs/RECOVERY.md gives the reasoning. In short:

* A host death on a shared host is no evidence against any one of its turns: every turn it ran
  dies with it. A turn that lost its host :data:`ISOLATE_AFTER` times in a row without saving a
  checkpoint in between is therefore not aborted but *isolated*: it is resumed alone on the
  isolation host, one turn at a time, until its next checkpoint (its *probation*), while its
  slot-mates go on without it.
* Only a death of the isolation host while the turn was alone on it, inside a step it had
  durably noted as started (a model call or a tool batch), counts against the turn. Deaths the
  turn cannot have caused do not: a Redis failure cutting its task (the host lives on), a
  freeze (the supervisor replaced a host that stopped answering, not one that died), a kill
  before its first step.
* A turn is suspended (``suspended:poison``, not aborted: ``phaseline resume TURN`` runs it
  again after a fix) once :data:`SAME_STEP_DEATHS` isolated deaths happened at the same step,
  or :data:`MAX_ISOLATED_DEATHS` at any steps. A random kill rarely lands twice on the same
  step of a turn that runs alone for a fraction of a second; a turn that crashes its process
  does so at the same step every time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

#: Stalled resumes (claims with no checkpoint between) after which a turn runs isolated.
ISOLATE_AFTER = 2
#: Isolated deaths at one step that suspend the turn.
SAME_STEP_DEATHS = 2
#: Isolated deaths at any steps that suspend the turn.
MAX_ISOLATED_DEATHS = 4
#: Backoff before the n-th isolated attempt after a death: base * 2**(n-1), capped.
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0


class Placement(StrEnum):
    """Where the next owner of a turn runs it."""

    SHARED = "shared"
    """On its slot's host, with the other turns of the slot."""
    ISOLATED = "isolated"
    """Alone on the isolation host until its next checkpoint."""
    SUSPEND = "suspend"
    """Nowhere: parked as ``suspended:poison`` with the evidence in its record."""


def place(stalled_resumes: int, isolated_deaths: Sequence[str]) -> Placement:
    """The placement of a turn about to be claimed for the ``stalled_resumes``-th time in a row
    without progress, whose isolated hosts died under it at ``isolated_deaths`` (steps)."""
    if isolated_deaths:
        worst = max(Counter(isolated_deaths).values())
        if worst >= SAME_STEP_DEATHS or len(isolated_deaths) >= MAX_ISOLATED_DEATHS:
            return Placement.SUSPEND
    if stalled_resumes >= ISOLATE_AFTER:
        return Placement.ISOLATED
    return Placement.SHARED


def isolation_backoff_s(isolated_deaths: int) -> float:
    """Seconds to wait before the next isolated attempt of a turn with that many deaths: a
    crash loop costs the cluster at most one process start per backoff."""
    if isolated_deaths <= 0:
        return 0.0
    return float(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (isolated_deaths - 1)))


def step_name(phase: str, position: int) -> str:
    """The identity of a step: what the turn was doing and how long its transcript was. A
    deterministic crash repeats the same step; a random kill lands on any."""
    return f"{phase}@{position}"


def evidence(stalled_resumes: int, isolated_deaths: Sequence[str]) -> str:
    """Why a turn was suspended, in words (``phaseline inspect``)."""
    if not isolated_deaths:
        return "no isolated host died under it"
    steps = ", ".join(f"{s} x{n}" for s, n in Counter(isolated_deaths).most_common())
    return (
        f"its isolation host died {len(isolated_deaths)} times while it ran alone "
        f"(at steps {steps}), after {stalled_resumes} stalled resumes on shared hosts"
    )
