"""Reading the journal: the projection (a fold over events), session state at any seq,
snapshots, and analysts' queries."""

from core.query.analytics import EventFilter
from core.query.state import SessionState
from core.query.stats import Stats

__all__ = ["EventFilter", "SessionState", "Stats"]
