"""The probe firmware oracle: a test that needs it fails without it, never skips."""

from __future__ import annotations

from pathlib import Path

import probe_oracle
import pytest


def test_a_missing_oracle_fails_the_test(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(probe_oracle, "ORACLE", tmp_path / "no-oracle-here")
    probe_oracle.busybox.cache_clear()
    try:
        with pytest.raises(pytest.fail.Exception, match="oracle is missing"):
            probe_oracle.busybox()
    finally:
        probe_oracle.busybox.cache_clear()


def test_the_oracle_runs_here() -> None:
    # The prebuilt binary (or build.sh's): `evping --help` answers.
    assert probe_oracle._runs(probe_oracle.busybox())
