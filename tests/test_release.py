"""The release's record agrees with the package: CHANGELOG.md's newest release is the installed version."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import subquad

CHANGELOG = pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def test_changelog_names_the_installed_version():
    text = CHANGELOG.read_text()
    released = re.findall(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)
    assert released, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' release heading"
    assert "## [Unreleased]" in text.split(f"## [{released[0][0]}]")[0], "Keep a Changelog: [Unreleased] comes first"
    assert released[0][0] == subquad.__version__ == importlib.metadata.version("subquad"), (
        f"CHANGELOG.md's newest release {released[0][0]}, subquad.__version__ {subquad.__version__}, "
        f"installed metadata {importlib.metadata.version('subquad')}"
    )
