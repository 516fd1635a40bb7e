"""The trial's TCP metrics cache (kickass_wan.environment.MetricsCache), each
case in a private network namespace of its own.

``tcp_no_metrics_save`` is per network namespace, so a process started by
``unshare --net`` gets its own, at the kernel's default (0: the cache on),
and nothing another test or trial on this host does can change it under the
test; the namespace goes with the process. What the runner stores with a
trial (``environment.tcp_metrics_cache``) must say what was in effect.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare (util-linux)"),
]

# Runs inside the private namespace: sets the knob as the case wants, then
# takes the record as the runner does (the host's record inside the cache's
# context, as runner.TrialRunner.run takes it).
SNIPPET = """
import json, sys
from kickass_wan.environment import SYSCTL_DIR, MetricsCache, local
mode, initial = sys.argv[1], sys.argv[2]
knob = SYSCTL_DIR / "tcp_no_metrics_save"
if initial != "default":
    knob.write_text(initial + "\\n")
out = {"before": knob.read_text().strip()}
with MetricsCache(mode) as cache:
    out["record"] = cache.record
    out["during"] = knob.read_text().strip()
    out["recorded"] = local()["sysctl"]["tcp_no_metrics_save"]
out["after"] = knob.read_text().strip()
print(json.dumps(out))
"""


def _in_private_namespace(mode: str, initial: str, *, unprivileged: bool = False) -> dict:
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if unprivileged else []
    proc = subprocess.run(
        ["unshare", "--net", *drop, sys.executable, "-c", SNIPPET, mode, initial],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out: dict = json.loads(proc.stdout)
    return out


def test_the_cache_is_disabled_for_the_trial_and_restored() -> None:
    out = _in_private_namespace("disable", "default")
    assert out["before"] == "0"  # a new namespace starts with the cache on
    assert out["record"] == {
        "mode": "disabled for the trial",
        "tcp_no_metrics_save": "1",
        "restored_to": "0",
    }
    assert out["during"] == out["recorded"] == "1"
    assert out["after"] == "0"


def test_a_cache_already_off_is_recorded_and_left_off() -> None:
    out = _in_private_namespace("disable", "1")
    assert out["record"] == {"mode": "off already", "tcp_no_metrics_save": "1"}
    assert out["during"] == out["recorded"] == out["after"] == "1"


def test_asked_to_leave_it_the_cache_stays_on_and_the_record_says_so() -> None:
    out = _in_private_namespace("leave", "default")
    assert out["record"] == {
        "mode": "left on",
        "tcp_no_metrics_save": "0",
        "why": "asked to leave it",
    }
    assert out["during"] == out["recorded"] == out["after"] == "0"


def test_a_runner_that_cannot_disable_it_records_why() -> None:
    out = _in_private_namespace("disable", "default", unprivileged=True)
    record = out["record"]
    assert (record["mode"], record["tcp_no_metrics_save"]) == ("left on", "0")
    assert "cannot disable it" in record["why"] and "run the runner as root" in record["why"]
    assert out["during"] == out["recorded"] == out["after"] == "0"
