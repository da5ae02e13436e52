"""Every ``SUBQUAD_*`` variable is read one way (issue 57): the table lists each variable the code
reads, docs/settings.md shows the same table, and a switch's values mean the same everywhere."""

from __future__ import annotations

import pathlib
import re

import pytest

from subquad import _native, _settings
from subquad._backends import base, calibration
from subquad._errors import ArgumentError

SRC = pathlib.Path(_settings.__file__).parent
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_every_variable_the_code_reads_is_in_the_table():
    read = set()
    for path in SRC.rglob("*.py"):
        read |= set(re.findall(r"\b(SUBQUAD_[A-Z0-9_]+)\b", path.read_text()))
    assert read == set(_settings.SETTINGS), read ^ set(_settings.SETTINGS)


def test_the_docs_table_lists_them_all():
    text = DOCS.read_text()
    for name, s in _settings.SETTINGS.items():
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/settings.md has no row for {name}"
        assert s.default in row, (name, row)


@pytest.mark.parametrize(
    "value,on",
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", True),
    ],
)
def test_a_switch_means_the_same_everywhere(monkeypatch, value, on):
    for name, read in (
        ("SUBQUAD_COMPILE", lambda: base.compile_allowed(None)),
        ("SUBQUAD_CALIBRATE", calibration.enabled),
    ):
        monkeypatch.setenv(name, value)
        assert read() is on, (name, value)
    monkeypatch.setenv("SUBQUAD_TRITON", value)
    assert _settings.switch("SUBQUAD_TRITON") is on


@pytest.mark.parametrize("name", ["SUBQUAD_COMPILE", "SUBQUAD_TRITON", "SUBQUAD_CALIBRATE", "SUBQUAD_COMFYUI_DEFAULT"])
def test_a_mistyped_switch_is_an_error_naming_it(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ArgumentError, match=f"{name} must be one of 1, true, yes, on, 0, false, no, off .*'maybe'"):
        _settings.switch(name)


def test_a_switch_off_by_default(monkeypatch):
    monkeypatch.delenv("SUBQUAD_COMFYUI_DEFAULT", raising=False)
    assert _settings.switch("SUBQUAD_COMFYUI_DEFAULT") is False
    monkeypatch.setenv("SUBQUAD_NATIVE", " Build ")
    assert _native.mode() == "build"
