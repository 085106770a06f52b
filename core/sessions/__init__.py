"""Session operations beyond appending: fork at a seq, the fork's artifact copy, moves
between tenants, and deletion. (The journal creates sessions and owns their rows.)"""

from core.sessions.fork_copy import CopyReport, ForkCopier, ForkCopies
from core.sessions.forks import Forks
from core.sessions.lifecycle import DeleteReport, SessionLifecycle
from core.sessions.moves import MoveRepair, Moves

__all__ = [
    "CopyReport",
    "DeleteReport",
    "ForkCopier",
    "ForkCopies",
    "Forks",
    "MoveRepair",
    "Moves",
    "SessionLifecycle",
]
