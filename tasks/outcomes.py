"""Where a queued write's outcome lives: keyed as the journal keys writes.

The journal scopes an idempotency key to its session, so the outcome of a write is found
by (session, key). The Celery task id of a write is derived from both: two sessions that
use the same key never share a task id, a stored result, or an answer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from celery import Celery, states

from core.blobs.externalize import content_digest
from core.errors import IdempotencyKeyReused
from core.journal.dead_letters import DeadLetter
from core.records import AppendResult

APPEND_TASK = "sessionstore.append"
_PREFIX = "ssw-"
# The message header naming the content a write carries (``write_digest``): its outcome
# repeats it, so a producer can tell its own write's outcome from that of other content
# sent before under the same (session, key). ``NEW_KEY``: a key made for this write, which
# no other content can have used (nothing to compare; the worker computes nothing).
DIGEST_HEADER = "write_digest"
NEW_KEY = "new"
KEY_REUSED = "key_reused"
_DIGEST = re.compile(r"[0-9a-f]{32}\Z")


def write_task_id(session_id: str, idempotency_key: str) -> str:
    """The task id of the write (session, key): stable, and distinct across sessions."""
    digest = hashlib.sha256()
    for part in (session_id, idempotency_key):
        raw = part.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(8, "big") + raw)  # length-prefixed: unambiguous
    return _PREFIX + digest.hexdigest()[:40]


def stored_outcome(app: Celery, session_id: str, idempotency_key: str) -> dict[str, Any] | None:
    """The outcome stored for (session, key) now, or None while it has none (read afresh:
    the backend's cache would keep answering with an outcome since replaced)."""
    return outcome_in(
        app.backend.get_task_meta(write_task_id(session_id, idempotency_key), cache=False)
    )


def outcome_in(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The outcome document a backend's task meta holds (committed or dead-lettered), or
    None while it holds none (pending, a FAILURE of Celery's own)."""
    result = meta.get("result")
    if meta.get("status") == states.SUCCESS and isinstance(result, dict):
        return result
    return None


def write_digest(events: Sequence[Any]) -> str:
    """The digest of a validated write's content (``core.blobs.externalize.content_digest``:
    the same for two sends of one write, whatever differs only in how it is stored)."""
    return content_digest(events)


def digest_or_none(events: Any) -> str | None:
    """``write_digest`` of events that may hold no write at all (a client's that skipped the
    door, a dead letter's): None for those."""
    try:
        return write_digest(events)
    except Exception:
        return None


def digest_in(value: Any) -> str | None:
    """A digest a message header carries, if it is one (a hostile client's is not kept)."""
    return value if isinstance(value, str) and _DIGEST.match(value) else None


def committed(
    idempotency_key: str, result: AppendResult, digest: str | None = None
) -> dict[str, Any]:
    """The outcome document of a write that committed (or was answered as a replay)."""
    outcome = {"status": "ok", "idempotency_key": idempotency_key, **result.to_dict()}
    return _with_digest(outcome, digest)


def answer_for(outcome: dict[str, Any] | None, digest: str | None) -> dict[str, Any] | None:
    """``outcome`` as the answer to a write of content ``digest`` under its (session, key).

    An outcome of other content is not this write's: a commit of it means this write is
    refused (the key is taken: ``KEY_REUSED``), a rejection of it says nothing about this
    write (None: no answer yet). An outcome without a digest (stored before digests)
    answers any write under its key.
    """
    if outcome is None or digest is None:
        return outcome
    theirs = outcome.get("digest")
    if not isinstance(theirs, str) or theirs == digest:
        return outcome
    if outcome.get("status") != "ok":
        return None
    return {**outcome, "status": KEY_REUSED, "digest": digest}


def key_reused_error(outcome: dict[str, Any]) -> IdempotencyKeyReused:
    return IdempotencyKeyReused(
        str(outcome.get("session_id")),
        str(outcome.get("idempotency_key")),
        int(outcome["first_seq"]),
        int(outcome["last_seq"]),
        [int(position) for position in outcome.get("positions", ())],
    )


def store_outcome(
    app: Celery, session_id: str, idempotency_key: str, outcome: dict[str, Any]
) -> None:
    """Record ``outcome`` as the answer for (session, key), where producers look it up, in
    place of any before it (Celery's backends ignore a result stored over a SUCCESS)."""
    replace_outcome(app.backend, write_task_id(session_id, idempotency_key), outcome)


def replace_outcome(backend: Any, task_id: str, outcome: dict[str, Any]) -> None:
    """``outcome`` under ``task_id`` in place of what is stored there (Celery's backends
    ignore a result stored over a SUCCESS): forgotten first, then stored."""
    backend.forget(task_id)
    backend.store_result(task_id, outcome, states.SUCCESS)


def keeps_outcomes(backend: Any) -> bool:
    """Whether outcomes are stored where any process reads them by task id (Redis, a
    database): not rpc:// (replies to the sender only) nor a disabled backend."""
    module = type(backend).__module__
    return not module.startswith(("celery.backends.rpc", "celery.backends.base"))


def forget_rejection(backend: Any, task_id: str) -> None:
    """Drop a rejection (a dead-letter outcome) stored under ``task_id``: Celery never stores
    a result over it, so a later commit of the write would still be answered as rejected.
    A committed outcome stays. Raises what the backend raises (the caller decides)."""
    earlier = outcome_in(backend.get_task_meta(task_id, cache=False))
    if earlier is not None and earlier.get("status") == "dead_lettered":
        backend.forget(task_id)


def dead_lettered(letter: DeadLetter, digest: str | None = None) -> dict[str, Any]:
    """The outcome document of a write kept as ``letter``: small, JSON-safe strings only."""
    outcome = {
        "status": "dead_lettered",
        "dead_letter_id": letter.id,
        "session_id": letter.session_id,
        "idempotency_key": letter.idempotency_key,
        "error_type": letter.error_type,
        "error": letter.error[:1000],
    }
    return _with_digest(outcome, digest)


def _with_digest(outcome: dict[str, Any], digest: str | None) -> dict[str, Any]:
    if digest is not None:
        outcome["digest"] = digest
    return outcome
