"""Every error of ``core.errors`` survives pickling whole (type, message, attributes): a
process pool or a task result hands back the same error. Errors whose ``__init__`` takes
other parameters than a message failed to unpickle (TypeError) or doubled their message."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import core.errors as errors_module
from core.errors import SessionStoreError

ERRORS = sorted(
    (
        cls
        for cls in vars(errors_module).values()
        if inspect.isclass(cls)
        and issubclass(cls, SessionStoreError)
        and cls.__module__ == errors_module.__name__
    ),
    key=lambda cls: cls.__name__,
)


def _sample(annotation: Any) -> Any:
    text = str(annotation)
    if "list" in text or "Sequence" in text:
        return ["a/b"]
    if "dict" in text or "Mapping" in text:  # a task's outcome (WriteRejected)
        return {"dead_letter_id": 3, "session_id": "s", "error_type": "InvalidEvent", "error": "e"}
    if text in ("int", "<class 'int'>", "int | None"):
        return 7
    if "float" in text:
        return 1.5
    if "Exception" in text:
        return ValueError("cause")
    return "some-id"


def _instance(cls: type[SessionStoreError]) -> SessionStoreError:
    """The error built with a sample value for each parameter its ``__init__`` requires."""
    args, kwargs = [], {}
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.default is not inspect.Parameter.empty or param.kind in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            continue
        value = _sample(param.annotation)
        if param.kind == param.KEYWORD_ONLY:
            kwargs[param.name] = value
        else:
            args.append(value)
    return cls(*args, **kwargs)


def test_every_error_class_is_found() -> None:
    assert len(ERRORS) > 30 and SessionStoreError in ERRORS


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_error_survives_pickling_whole(cls: type[SessionStoreError]) -> None:
    try:
        error = _instance(cls)
    except TypeError as exc:  # a parameter this sampler cannot fill
        pytest.fail(f"cannot build {cls.__name__} from samples: {exc}")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls
    assert (again.args, again.message) == (error.args, error.message)
    # exceptions held as attributes (a cause) compare by identity: by their repr here
    assert {k: repr(v) for k, v in vars(again).items()} == {
        k: repr(v) for k, v in vars(error).items()
    }
