"""One SessionStore per Celery app per process, built on first use (after any fork)."""

from __future__ import annotations

import os
import threading

from celery import Celery

from core.records import Session
from core.store import SessionStore
from tasks.app import settings_of
from tasks.enqueue import enqueue_copy_artifacts

_stores: dict[int, SessionStore] = {}
_lock = threading.Lock()


def store_for(app: Celery) -> SessionStore:
    key = id(app)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = attach_fork_copier(SessionStore.from_settings(settings_of(app)), app)
            _stores[key] = store
        return store


def attach_fork_copier(store: SessionStore, app: Celery) -> SessionStore:
    """Make ``store.fork`` enqueue ``sessionstore.copy_artifacts`` on ``app``; returns it."""

    def copier(fork: Session) -> None:
        enqueue_copy_artifacts(fork.id, app)

    store.fork_copier = copier
    return store


def close_stores() -> None:
    with _lock:
        for store in _stores.values():
            store.close()
        _stores.clear()


def _forget_after_fork() -> None:
    # A forked pool process must not share the parent's pooled connections: drop them
    # without closing (closing would break the parent's), and build anew on first use.
    for store in _stores.values():
        store.engine.dispose(close=False)
    _stores.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
