"""Interop with the session files agents write: pi / oh-my-pi JSONL and Claude Code
transcripts. Converters turn a file into a ``ParsedSession`` (``core.interop.model``);
the importer appends it to the journal idempotently; exporters write it back."""
