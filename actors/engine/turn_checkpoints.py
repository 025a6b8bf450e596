"""One turn's checkpoints: its saves, and the tool outcomes its batches leave.

A batch returns the outcomes it did not journal (``BatchRun.settles``: those of its last calls,
and any whose own write failed); the loop hands them over once, with the save after the batch
or alone when that boundary saves nothing. :class:`TurnCheckpoints` alone decides how each is
journaled: carried by the save script (before its fence, whatever the fence says), or by the
ledger's compare-and-set from the call's dispatch. One it cannot journal now (Redis away) waits
here for the turn's next save or hand-over, the final save at the latest, so a finished turn's
ledger holds every result its transcript does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from actors.engine.tools.call_ends import refusals_waited
from actors.turn.deps import Checkpointer
from bus.errors import RecordTooLarge, StaleOwner, StoreError, UnstorableRecord
from store.codec import unpack_model
from store.domain.ledger import Change, Ledger
from store.records import CheckpointRecord, LedgerEntry, SaveAck, Settle

__all__ = ["TurnCheckpoints"]

log = logging.getLogger(__name__)


class TurnCheckpoints:
    """A :class:`~actors.turn.deps.TurnCheckpointer` for one turn, over the engine's
    checkpointer and the tool ledger."""

    def __init__(self, saves: Checkpointer, ledger: Ledger) -> None:
        self.saves = saves
        self.ledger = ledger
        self._waiting: tuple[Settle, ...] = ()
        """Outcomes not journaled yet (their write failed): the next save carries them."""

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        """Save ``record`` with ``settles`` and whatever waits. A save fenced off journaled
        them all the same; one that failed, or could not be stored, hands them to the ledger
        alone (a failed save may have landed: journaling again is a no-op)."""
        carried, self._waiting = (*self._waiting, *settles), ()
        try:
            return await self.saves.save(record, carried)
        except StaleOwner:
            raise
        except (RecordTooLarge, UnstorableRecord, StoreError):
            await self.settle(record.turn_id, carried)
            raise

    async def settle(self, turn_id: str, settles: Sequence[Settle]) -> None:
        """Journal ``settles`` and whatever waits, each a compare-and-set from its dispatch
        (so it never overwrites what a successor settled). A failure is logged, not raised:
        the outcomes wait for the next save, and the model reads the results meanwhile; only
        a resume from before that save finds those calls dispatched (and runs an idempotent
        one again, reports another ``outcome_unknown``): true, as their results are lost
        then."""
        todo, self._waiting = (*self._waiting, *settles), ()
        if not todo:
            return
        changes = {
            s.call_key: Change(s.dispatched, unpack_model(LedgerEntry, s.settled, key=s.call_key))
            for s in todo
        }
        try:
            await refusals_waited(
                f"journal {len(changes)} outcomes of {turn_id}",
                partial(self.ledger.transition, turn_id, changes, epoch=None),
            )
        except StoreError as exc:
            log.warning("turn %s: outcomes of a batch not journaled yet: %s", turn_id, exc)
            self._waiting = (*todo, *self._waiting)
