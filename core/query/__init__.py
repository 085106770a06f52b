"""Reading the journal: the projection (a fold over events), session state at any seq,
snapshots, and analysts' queries."""

from core.query.analytics import EventFilter, Stats
from core.query.state import SessionState

__all__ = ["EventFilter", "SessionState", "Stats"]
