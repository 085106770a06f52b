"""The Grafana dashboard in deploy/ asks only for metrics the code exports."""

from __future__ import annotations

import dataclasses
import json
import re

from core.metrics import metrics
from tests.support import ROOT


def _exported() -> set[str]:
    names: set[str] = set()
    exported = metrics()
    for metric in (getattr(exported, f.name) for f in dataclasses.fields(exported)):
        for family in metric.describe():
            names.add(family.name)
    return names


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "sessionstore.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        re.sub(r"_(total|bucket|sum|count)$", "", name)
        for expr in exprs
        for name in re.findall(r"\bsessionstore_\w+", expr)
    }
    assert used and used <= _exported(), sorted(used - _exported())
    assert _exported() <= used, f"not on the dashboard: {sorted(_exported() - used)}"
