"""Periodic maintenance: blob GC, TTL expiry of oversized outputs, and the run log."""

from core.maintenance.expiry import ExpireRunReport, expire_artifacts
from core.maintenance.gc import GcReport, GcResume, gc_blobs
from core.maintenance.runs import MaintenanceRun, MaintenanceRuns, Progress

__all__ = [
    "ExpireRunReport",
    "GcReport",
    "GcResume",
    "MaintenanceRun",
    "MaintenanceRuns",
    "Progress",
    "expire_artifacts",
    "gc_blobs",
]
