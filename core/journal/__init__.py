"""The journal: sessions and their append-only events, the blob manifest, idempotency
records and dead letters. The only code that writes events."""

from core.journal.dead_letters import DeadLetter, DeadLetters
from core.journal.journal import Journal
from core.journal.validation import check_batch

__all__ = ["DeadLetter", "DeadLetters", "Journal", "check_batch"]
