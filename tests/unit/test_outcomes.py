"""Which stored outcome answers which write (``tasks.outcomes.answer_for``)."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import IdempotencyKeyReused
from core.records import AppendResult
from tasks.outcomes import KEY_REUSED, answer_for, committed, digest_in, write_digest
from tasks.producer import to_result

OK = committed("k", AppendResult("s", 3, 4, [7, 8]), "a" * 32)
REJECTED = {"status": "dead_lettered", "dead_letter_id": 1, "digest": "a" * 32}


@pytest.mark.parametrize(
    ("outcome", "digest", "answer"),
    [
        (None, "a" * 32, None),
        (OK, None, OK),  # a write under a new key sends no digest: any outcome is its own
        (OK, "a" * 32, OK),
        ({**OK, "digest": None}, "b" * 32, {**OK, "digest": None}),  # a client sent none
        (REJECTED, "a" * 32, REJECTED),
        (REJECTED, "b" * 32, None),  # another write's rejection: no answer for this one
    ],
)
def test_an_outcome_answers_the_write_whose_content_it_names(
    outcome: dict[str, Any] | None, digest: str | None, answer: dict[str, Any] | None
) -> None:
    assert answer_for(outcome, digest) == answer


def test_a_commit_of_other_content_refuses_the_write_typed() -> None:
    answer = answer_for(OK, "b" * 32)
    assert answer is not None and answer["status"] == KEY_REUSED
    with pytest.raises(IdempotencyKeyReused) as caught:
        to_result(answer)
    assert (caught.value.session_id, caught.value.idempotency_key) == ("s", "k")
    assert (caught.value.first_seq, caught.value.last_seq) == (3, 4)


def test_the_digest_names_the_content_exactly() -> None:
    events = [{"type": "n", "v": 1}]
    assert write_digest(events) == write_digest([{"type": "n", "v": 1}])
    for other in ([{"type": "n", "v": 1.0}], [{"v": 1, "type": "n"}], [{"type": "n", "v": 2}]):
        assert write_digest(other) != write_digest(events)
    assert digest_in(write_digest(events)) is not None
    assert [digest_in(v) for v in (None, 7, "", "x" * 65)] == [None] * 4
