"""The README's configuration table is generated from Settings and must not drift."""

from __future__ import annotations

import pytest

from core.settings import Settings, settings_markdown
from tests.support import ROOT


@pytest.mark.smoke
def test_readme_settings_table_matches_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- settings:start -->") + len("<!-- settings:start -->")
    end = readme.index("<!-- settings:end -->")
    assert readme[start:end].strip() == settings_markdown(), (
        "README configuration table is stale: paste `sessionstore settings --markdown`"
    )
    for name in Settings.model_fields:
        assert f"`SESSIONSTORE_{name.upper()}`" in readme
