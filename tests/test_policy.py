"""Server policy: plan bounds, admission windows and token-bucket pacing."""

from __future__ import annotations

import pytest
from kickass_core.plan import PlanError, ProbePlan, plan_bytes
from kickass_server.policy import Admission, Policy, TokenBucket, prefix_of


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_plan_bounds() -> None:
    p = Policy(max_repetitions=10, max_window=4)
    assert p.plan_from_request({"quick": True}) == ProbePlan.quick()
    assert p.plan_from_request({"repetitions": 10, "window": 4}).total_probes == 10 * 366
    for bad in ({"repetitions": 11}, {"window": 5}, {"step": 12}, {"phases": ["other"]}):
        with pytest.raises(PlanError):
            p.plan_from_request(bad)


def test_policy_from_env() -> None:
    p = Policy.from_env({"KICKASS_POLICY_PPS_GLOBAL": "123.5", "KICKASS_POLICY_MAX_WINDOW": "3"})
    assert p.pps_global == 123.5 and p.max_window == 3


def test_prefixes() -> None:
    assert prefix_of("198.51.100.77") == "198.51.100.0/24"
    assert prefix_of("2001:db8::1") == "2001:db8::/48"


def test_hourly_sessions_and_bytes_per_address_and_prefix() -> None:
    clock = Clock()
    full = plan_bytes(ProbePlan.build())
    assert 40e6 < full < 45e6  # ~41.6 MB: the paper's full plan
    adm = Admission(
        Policy(
            sessions_per_address=100,
            sessions_per_prefix=100,
            sessions_per_address_hour=3,
            sessions_per_prefix_hour=5,
            bytes_per_address_hour=int(2.5 * full),
            bytes_per_prefix_hour=10 * full,
        ),
        clock,
    )
    for _ in range(2):
        assert adm.check("192.0.2.1", full) is None
        adm.admit("192.0.2.1", full)
        adm.release("192.0.2.1")
    assert "bytes per address" in (adm.check("192.0.2.1", full) or "")
    assert adm.check("192.0.2.1", 1000) is None
    adm.admit("192.0.2.1", 1000)
    assert "sessions per address per hour" in (adm.check("192.0.2.1", 1000) or "")
    for a in ("192.0.2.2", "192.0.2.3"):
        adm.admit(a, 1000)
    assert "per 192.0.2.0/24 per hour" in (adm.check("192.0.2.9", 1000) or "")
    clock.t += 3601  # the windows slide
    assert adm.check("192.0.2.1", full) is None and adm.check("192.0.2.9", full) is None


def test_concurrent_and_global_session_caps() -> None:
    adm = Admission(Policy(sessions_per_address=1, sessions_per_prefix=2, max_sessions=3), Clock())
    adm.admit("192.0.2.1", 1)
    assert "concurrent sessions per address" in (adm.check("192.0.2.1", 1) or "")
    adm.admit("192.0.2.2", 1)
    assert "concurrent sessions per 192.0.2.0/24" in (adm.check("192.0.2.3", 1) or "")
    adm.admit("198.51.100.1", 1)
    assert "maximum number of sessions" in (adm.check("203.0.113.1", 1) or "")
    adm.release("192.0.2.1")
    assert adm.check("192.0.2.1", 1) is None


def test_token_bucket_rate() -> None:
    b = TokenBucket(1000.0, now=0.0)
    sent, t = 0, 0.0
    while t < 2.0:
        b.refill(t)
        while b.tokens >= 1.0:
            b.tokens -= 1
            sent += 1
        t += 0.001
    # 1000/s for 2 s plus the initial burst of a tenth of a second.
    assert 2000 <= sent <= 2000 + 100 + 1
    assert TokenBucket(10.0, 0.0).burst == 1.0
