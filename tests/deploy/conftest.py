"""The agent's Debian package, built once per test session (tests/deploy/_deployed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _deployed import build_deb


@pytest.fixture(scope="session")
def agent_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`wan-agents/deploy/build-deb.sh` of the tree as it is (minutes when
    ka-agent-recv must be compiled; seconds after)."""
    return build_deb(tmp_path_factory.mktemp("agent-deb"))
