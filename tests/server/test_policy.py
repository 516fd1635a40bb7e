"""Server policy: plan bounds, admission windows and token-bucket pacing (all pure)."""

from __future__ import annotations

import pytest
from kickass_core.errors import KickassError
from kickass_core.pacing import TokenBucket, prefix_of
from kickass_core.plan import PlanError, ProbePlan, plan_bytes
from kickass_server.policy import Admission, Policy


def test_plan_bounds() -> None:
    p = Policy(max_repetitions=10, max_window=4)
    assert p.plan_from_request({"quick": True}) == ProbePlan.quick()
    assert p.plan_from_request({"repetitions": 10, "window": 4}).total_probes == 10 * 366
    for bad in ({"repetitions": 11}, {"window": 5}, {"step": 12}, {"phases": ["other"]}):
        with pytest.raises(PlanError):
            p.plan_from_request(bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"repetitions": float("inf")},
        {"repetitions": float("nan")},
        {"repetitions": 1e400},
        {"repetitions": 10.0},
        {"repetitions": "10"},
        {"repetitions": True},
        {"repetitions": None},
        {"repetitions": 0},
        {"repetitions": -1},
        {"step": 10**40},
        {"window": [1]},
        {"quick": "yes"},
        {"quick": 1},
        {"phases": "whole"},
        {"phases": []},
        {"phases": ["whole", "whole"]},
        {"phases": [None]},
        {"phases": [["whole"]]},
        [],
        "quick",
        None,
    ],
)
def test_plan_requests_of_the_wrong_type_are_plan_errors(bad: object) -> None:
    """Untrusted JSON: every wrong type or value is a PlanError (HTTP 400),
    never an OverflowError or TypeError (HTTP 5xx)."""
    with pytest.raises(PlanError):
        Policy().plan_from_request(bad)


def test_policy_values_are_checked() -> None:
    with pytest.raises(KickassError, match="KICKASS_POLICY_PPS_GLOBAL"):
        Policy.from_env({"KICKASS_POLICY_PPS_GLOBAL": "fast"})
    with pytest.raises(KickassError, match="pps_global"):
        Policy(pps_global=0)
    with pytest.raises(KickassError, match="min_timeout_ms"):
        Policy(min_timeout_ms=500, max_timeout_ms=100)
    with pytest.raises(KickassError):
        Policy(silence_timeout_s=float("nan"))


def test_policy_from_env() -> None:
    p = Policy.from_env({"KICKASS_POLICY_PPS_GLOBAL": "123.5", "KICKASS_POLICY_MAX_WINDOW": "3"})
    assert p.pps_global == 123.5 and p.max_window == 3


def test_prefixes() -> None:
    assert prefix_of("198.51.100.77") == "198.51.100.0/24"
    assert prefix_of("2001:db8::1") == "2001:db8::/48"


def test_hourly_sessions_and_bytes_per_address_and_prefix() -> None:
    t = 1000.0
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
        )
    )
    for _ in range(2):
        assert adm.check("192.0.2.1", full, t) is None
        adm.release(adm.admit("192.0.2.1", full, t))
    assert "bytes per address" in (adm.check("192.0.2.1", full, t) or "")
    assert adm.check("192.0.2.1", 1000, t) is None
    adm.admit("192.0.2.1", 1000, t)
    assert "sessions per address per hour" in (adm.check("192.0.2.1", 1000, t) or "")
    for a in ("192.0.2.2", "192.0.2.3"):
        adm.admit(a, 1000, t)
    assert "per 192.0.2.0/24 per hour" in (adm.check("192.0.2.9", 1000, t) or "")
    t += 3601  # the windows slide
    assert adm.check("192.0.2.1", full, t) is None and adm.check("192.0.2.9", full, t) is None
    adm.sweep(t)
    assert adm.history_by_address == {} and adm.history_by_prefix == {}


def test_a_refunded_admission_counts_against_nothing() -> None:
    adm = Admission(Policy(sessions_per_address=1, sessions_per_address_hour=1))
    ticket = adm.admit("192.0.2.1", 1000, 0.0)
    assert adm.check("192.0.2.1", 1000, 1.0) is not None
    adm.refund(ticket)  # the database did not store the session
    assert adm.check("192.0.2.1", 1000, 1.0) is None
    assert adm.active_total == 0 and adm.history_by_address == {}


def test_concurrent_and_global_session_caps() -> None:
    adm = Admission(Policy(sessions_per_address=1, sessions_per_prefix=2, max_sessions=3))
    first = adm.admit("192.0.2.1", 1, 0.0)
    assert "concurrent sessions per address" in (adm.check("192.0.2.1", 1, 0.0) or "")
    adm.admit("192.0.2.2", 1, 0.0)
    assert "concurrent sessions per 192.0.2.0/24" in (adm.check("192.0.2.3", 1, 0.0) or "")
    adm.admit("198.51.100.1", 1, 0.0)
    assert "maximum number of sessions" in (adm.check("203.0.113.1", 1, 0.0) or "")
    adm.release(first)
    assert adm.check("192.0.2.1", 1, 0.0) is None


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
