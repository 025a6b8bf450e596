"""A finished turn as an archive holds it: what ``phaseline export`` writes, a line per turn,
and what an ``on_finish`` hook receives the moment a turn ends.

Both give the same value, so an operator who archives continuously (the hook) and one who
catches up later (``export --since``) get the same lines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from store.codec import dump_model
from store.records import CheckpointRecord, LedgerEntry

__all__ = ["FinishedTurn"]


@dataclass(frozen=True, slots=True)
class FinishedTurn:
    """A turn whose final record is saved: everything its keys hold that matters later."""

    record: CheckpointRecord
    """The final record: transcript and meta, counters (tokens, outcome, last error)."""
    ledger: Mapping[str, LedgerEntry]
    """Its tool calls by call key, each with its state and result."""

    @property
    def turn_id(self) -> str:
        return self.record.turn_id

    def to_json(self) -> dict[str, Any]:
        """The export's JSON object (keys: ``record``, ``ledger``), ledger sorted by call key."""
        return {
            "record": dump_model(self.record),
            "ledger": {k: dump_model(e) for k, e in sorted(self.ledger.items())},
        }

    def json_line(self) -> str:
        """One line of ``phaseline export``'s JSON Lines (newline included)."""
        return json.dumps(self.to_json(), ensure_ascii=False) + "\n"
