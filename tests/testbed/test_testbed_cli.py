"""`kickass testbed` builds the wide-area testbed, runs a command in it and
removes everything, also when the command fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kickass_db as db
import pytest
from sqlalchemy import text

# netns: it builds namespaces, and the namespace stream compares the machine's
# namespaces before and after a test, which a test beside it would upset.
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces"),
]
KICKASS = Path(sys.executable).parent / "kickass"

# One TCP connect to a closed port on the receiver: SYN out, RST back, one RTT
# (after an ARP exchange that crosses the emulated WAN as well).
CONNECT = """
import json, os, socket, time
info = json.load(open(os.environ["KICKASS_TESTBED"]))
dst = list(info["receivers"].values())[0]
s = socket.socket(); s.settimeout(5)
s.connect_ex((dst, 9))  # warms ARP
s.close(); s = socket.socket(); s.settimeout(5)
t = time.monotonic(); s.connect_ex((dst, 9))
print(json.dumps({"rtt_ms": (time.monotonic() - t) * 1000}))
"""


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_testbed_runs_command_with_wan_delay_and_cleans_up(database_url: str) -> None:
    before = _netns()
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
    proc = subprocess.run(
        [
            str(KICKASS),
            "testbed",
            "--senders",
            "2",
            "--rtt",
            "60",
            "--ns",
            "s1",
            "--",
            "python3",
            "-c",
            CONNECT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rtt = json.loads(proc.stdout.strip().splitlines()[-1])["rtt_ms"]
    assert 58 <= rtt <= 75, rtt  # 60 ms configured, plus the datapath
    assert _netns() == before
    with db.make_engine(database_url).connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM v_router_telemetry")).scalar()
    assert n and n > 0  # the router's telemetry reached PostgreSQL


def test_testbed_failure_exit_code_and_cleanup() -> None:
    before = _netns()
    proc = subprocess.run(
        [str(KICKASS), "testbed", "--senders", "1", "--", "false"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert _netns() == before
    bad = subprocess.run(
        [str(KICKASS), "testbed", "--ns", "nope", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "ERROR: no namespace 'nope'" in bad.stderr
    assert _netns() == before
