"""SQL views for BI tools (PostgreSQL only; a no-op on SQLite)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 10:00:00

Read-only views over the journal for dashboards and ad-hoc SQL. They are plain views: always
current, nothing to refresh, no storage. Every view carries ``tenant_id``: filter on it (and
on ``session_id`` or a time range) as every reader of this store must (DESIGN invariant 9).

``bi_events``      one row per event: position, session, tenant, seq, type, recorded_at,
                   the entry's id / parentId / timestamp, payload size, and the payload.
``bi_messages``    one row per ``message`` event whose message is an object, flattened:
                   role, text, thinking, tool name (tool results), tool-call names
                   (assistant messages), bash command, error flag, provider, model, stop
                   reason, and usage as numeric columns (input, output, cache read/write,
                   total tokens, cost).
``bi_tool_calls``  one row per ``toolCall`` block of an assistant message, joined with the
                   ``toolResult`` message(s) that answer it in the same session.
``bi_sessions``    one row per session with message and token totals from ``bi_messages``.

``bi_tool_calls`` finds results by (session_id, toolCallId) inside the payload, which no index
covers: on a large journal, filter it by session_id (or tenant and time) first.

Values that were externalized to the blob store appear as their ref
(``blob:sha256:<hex>``); numbers that are not JSON numbers in the event are NULL. Each view
and its columns are also documented with ``COMMENT ON`` (``\\d+ bi_messages`` in psql).
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEWS = ("bi_sessions", "bi_tool_calls", "bi_messages", "bi_events")  # drop order


def _num(path: str, source: str = "m") -> str:
    """A JSON number at ``path`` as numeric; NULL for anything else (never a cast error)."""
    return (
        f"CASE WHEN jsonb_typeof({source} #> '{{{path}}}') = 'number' "
        f"THEN ({source} #>> '{{{path}}}')::numeric END"
    )


def _array(expr: str) -> str:
    """``expr`` if it is a JSON array, else an empty one, so set functions never fail."""
    return f"CASE WHEN jsonb_typeof({expr}) = 'array' THEN {expr} ELSE '[]'::jsonb END"


BI_EVENTS = """
CREATE VIEW bi_events AS
SELECT e.position,
       e.session_id,
       s.tenant_id,
       e.seq,
       e.type,
       e.recorded_at,
       e.payload ->> 'id' AS entry_id,
       e.payload ->> 'parentId' AS parent_entry_id,
       e.payload ->> 'timestamp' AS entry_timestamp,
       octet_length(e.payload::text) AS payload_bytes,
       e.payload
FROM events e
JOIN sessions s ON s.id = e.session_id
"""

BI_MESSAGES = f"""
CREATE VIEW bi_messages AS
SELECT e.position,
       e.session_id,
       s.tenant_id,
       e.seq,
       e.recorded_at,
       e.payload ->> 'id' AS entry_id,
       e.payload ->> 'parentId' AS parent_entry_id,
       e.payload ->> 'timestamp' AS entry_timestamp,
       m ->> 'role' AS role,
       CASE jsonb_typeof(m -> 'content')
           WHEN 'string' THEN m ->> 'content'
           WHEN 'array' THEN blocks.text
           ELSE m ->> 'output'
       END AS text,
       blocks.thinking,
       m ->> 'toolName' AS tool_name,
       m ->> 'toolCallId' AS tool_call_id,
       blocks.tool_call_names,
       blocks.tool_calls,
       blocks.images,
       CASE WHEN jsonb_typeof(m -> 'isError') = 'boolean'
            THEN (m ->> 'isError')::boolean END AS is_error,
       m ->> 'command' AS command,
       m ->> 'provider' AS provider,
       m ->> 'model' AS model,
       m ->> 'stopReason' AS stop_reason,
       {_num("usage,input")} AS input_tokens,
       {_num("usage,output")} AS output_tokens,
       {_num("usage,cacheRead")} AS cache_read_tokens,
       {_num("usage,cacheWrite")} AS cache_write_tokens,
       {_num("usage,totalTokens")} AS total_tokens,
       COALESCE({_num("usage,cost")}, {_num("usage,cost,total")}) AS cost
FROM events e
JOIN sessions s ON s.id = e.session_id
CROSS JOIN LATERAL (SELECT e.payload -> 'message' AS m) AS msg
CROSS JOIN LATERAL (
    SELECT string_agg(b ->> 'text', E'\\n' ORDER BY i)
               FILTER (WHERE b ->> 'type' = 'text') AS text,
           string_agg(b ->> 'thinking', E'\\n' ORDER BY i)
               FILTER (WHERE b ->> 'type' = 'thinking') AS thinking,
           string_agg(b ->> 'name', ',' ORDER BY i)
               FILTER (WHERE b ->> 'type' = 'toolCall') AS tool_call_names,
           count(*) FILTER (WHERE b ->> 'type' = 'toolCall') AS tool_calls,
           count(*) FILTER (WHERE b ->> 'type' = 'image') AS images
    FROM jsonb_array_elements({_array("m -> 'content'")}) WITH ORDINALITY AS c(b, i)
) AS blocks
WHERE e.type = 'message' AND jsonb_typeof(e.payload -> 'message') = 'object'
"""

BI_TOOL_CALLS = f"""
CREATE VIEW bi_tool_calls AS
SELECT e.position,
       e.session_id,
       s.tenant_id,
       e.seq,
       e.recorded_at,
       e.payload ->> 'id' AS entry_id,
       b ->> 'id' AS tool_call_id,
       b ->> 'name' AS tool_name,
       b -> 'arguments' AS arguments,
       r.position AS result_position,
       r.seq AS result_seq,
       r.payload ->> 'id' AS result_entry_id,
       CASE WHEN jsonb_typeof(r.payload #> '{{message,isError}}') = 'boolean'
            THEN (r.payload #>> '{{message,isError}}')::boolean END AS is_error
FROM events e
JOIN sessions s ON s.id = e.session_id
CROSS JOIN LATERAL jsonb_array_elements({_array("e.payload #> '{message,content}'")}) AS c(b)
LEFT JOIN events r
       ON r.session_id = e.session_id
      AND r.type = 'message'
      AND r.payload #>> '{{message,role}}' = 'toolResult'
      AND r.payload #>> '{{message,toolCallId}}' = b ->> 'id'
WHERE e.type = 'message'
  AND e.payload #>> '{{message,role}}' = 'assistant'
  AND b ->> 'type' = 'toolCall'
"""

BI_SESSIONS = """
CREATE VIEW bi_sessions AS
SELECT s.id AS session_id,
       s.tenant_id,
       s.title,
       s.cwd,
       s.parent_id,
       s.forked_from_seq,
       s.head_seq AS events,
       COALESCE(m.messages, 0) AS messages,
       COALESCE(m.tool_calls, 0) AS tool_calls,
       COALESCE(m.input_tokens, 0) AS input_tokens,
       COALESCE(m.output_tokens, 0) AS output_tokens,
       COALESCE(m.total_tokens, 0) AS total_tokens,
       COALESCE(m.cost, 0) AS cost,
       s.created_at,
       s.updated_at
FROM sessions s
LEFT JOIN (
    SELECT session_id,
           count(*) AS messages,
           sum(tool_calls) AS tool_calls,
           sum(input_tokens) AS input_tokens,
           sum(output_tokens) AS output_tokens,
           sum(total_tokens) AS total_tokens,
           sum(cost) AS cost
    FROM bi_messages
    GROUP BY session_id
) m ON m.session_id = s.id
"""

COMMENTS = {
    "bi_events": (
        "One row per journal event. Filter on tenant_id.",
        {
            "position": "Global position: commit order across all sessions.",
            "seq": "Position within the session, gapless from 1.",
            "recorded_at": "When the journal committed the event (UTC).",
            "entry_id": "The entry's id (coding-agent entry format), if any.",
            "parent_entry_id": "The entry's parentId: the id/parentId tree.",
            "entry_timestamp": "The producer's own timestamp, as sent.",
            "payload_bytes": "Size of the payload as JSON text.",
        },
    ),
    "bi_messages": (
        "One row per message event whose message is an object, flattened. "
        "Blob-externalized values show as refs.",
        {
            "role": "user, assistant, toolResult, bashExecution, custom, ...",
            "text": "String content, or the text blocks joined by newlines "
            "(bashExecution: its output).",
            "thinking": "Thinking blocks joined by newlines.",
            "tool_name": "toolResult messages: the tool that produced the result.",
            "tool_call_id": "toolResult messages: the call answered.",
            "tool_call_names": "Assistant messages: names of the tools called, comma-separated.",
            "tool_calls": "Assistant messages: number of toolCall blocks.",
            "images": "Number of image blocks.",
            "is_error": "toolResult messages: whether the tool failed.",
            "input_tokens": "usage.input",
            "output_tokens": "usage.output",
            "cache_read_tokens": "usage.cacheRead",
            "cache_write_tokens": "usage.cacheWrite",
            "total_tokens": "usage.totalTokens",
            "cost": "usage.cost.total (or usage.cost when it is a number).",
        },
    ),
    "bi_tool_calls": (
        "One row per toolCall block of an assistant message, with its toolResult "
        "(NULL while unanswered; one row per result if answered more than once).",
        {
            "arguments": "The call's arguments object.",
            "result_position": "Position of the toolResult message.",
            "is_error": "Whether the result reports an error.",
        },
    ),
    "bi_sessions": (
        "One row per session, with message and token totals over every branch.",
        {"events": "Number of events (the session's head seq)."},
    ),
}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite is the embedded journal; BI tools connect to PostgreSQL
    for statement in (BI_EVENTS, BI_MESSAGES, BI_TOOL_CALLS, BI_SESSIONS):
        op.execute(statement)
    for view, (about, columns) in COMMENTS.items():
        op.execute(f"COMMENT ON VIEW {view} IS {_quote(about)}")
        for column, text in columns.items():
            op.execute(f"COMMENT ON COLUMN {view}.{column} IS {_quote(text)}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
