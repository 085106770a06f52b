"""The journal's PostgreSQL statements: the one-statement append and position allocation.

(SQLite runs the generic SQLAlchemy path in ``core.journal.journal``.)
"""

from sqlalchemy import text

WRITER_LOCK_KEY = 0x5E5510_0001  # PostgreSQL advisory lock serializing event inserts
PG_NEXT_POSITIONS = text(
    "SELECT nextval(pg_get_serial_sequence('events', 'position')) FROM generate_series(1, :n)"
)
SQLITE_LAST_POSITION = text("SELECT seq FROM sqlite_sequence WHERE name = 'events'")

# PostgreSQL append in one statement, so an append costs the same round trips as a raw
# INSERT: take the writers' lock (the session-row claim depends on it, so positions are
# allocated only while it is held, and it is held until commit), claim seqs on the session
# row (only at the expected head, and only for a key not yet written), insert the batch in
# seq order so positions follow seqs, and (keyed variant) record the write. No row back:
# no session, the head moved, or the key was already written.
PG_APPEND_CTES = """
WITH writer_lock AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(:lock_key)
), claimed AS (
    UPDATE sessions SET head_seq = head_seq + :n, updated_at = :now
    WHERE id = :sid AND (CAST(:expected AS BIGINT) IS NULL OR head_seq = :expected)
      AND EXISTS (SELECT 1 FROM writer_lock)
      AND (CAST(:key AS TEXT) IS NULL OR NOT EXISTS (
          SELECT 1 FROM writes WHERE session_id = :sid AND idempotency_key = :key))
    RETURNING head_seq
), inserted AS (
    INSERT INTO events (session_id, seq, type, payload, recorded_at)
    SELECT :sid, claimed.head_seq - :n + e.ord, e.payload ->> 'type', e.payload, :now
    FROM claimed,
         jsonb_array_elements(CAST(:payloads AS jsonb)) WITH ORDINALITY AS e(payload, ord)
    ORDER BY e.ord
    RETURNING position, seq
)"""
PG_APPEND = text(PG_APPEND_CTES + "\nSELECT position, seq FROM inserted ORDER BY seq")
PG_APPEND_KEYED = text(
    PG_APPEND_CTES
    + """, recorded AS (
    INSERT INTO writes (session_id, idempotency_key, first_seq, last_seq, positions, created_at)
    SELECT :sid, :key, min(seq), max(seq), to_json(array_agg(position ORDER BY seq)), :now
    FROM inserted HAVING count(*) > 0
)
SELECT position, seq FROM inserted ORDER BY seq"""
)
