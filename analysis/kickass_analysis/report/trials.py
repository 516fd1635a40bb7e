"""The report's trials section: FCT against flow size per access capacity and
arm (the workload's floor stated), the Kick-Ass flows that fell back to TCP,
the paired speedup beside the flows finished sooner with failures kept, and
the time in Kick-Ass mode, the paper's 1.2-4x beside them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import figures, rollups, stats
from .markup import Section, _capacity, _f, _interval, _table
from .readers import ReportData

# What the summary keeps of each speedup row.
SPEEDUP_KEYS = (
    "destination",
    "arm",
    "baseline_arm",
    "size_bucket",
    "pairs",
    "matched",
    "speedup",
    "speedup_low",
    "speedup_high",
    "completion_arm",
    "completion_baseline",
    "sooner",
    "sooner_low",
    "sooner_high",
    "sooner_pairs",
)


@dataclass(frozen=True)
class Fallback:
    """The Kick-Ass flows of one access capacity and arm that ran as TCP from the start."""

    access_capacity_bps: float | None
    arm: str
    flows: int
    fell_back: int
    share: stats.Rate

    def to_json(self) -> dict[str, Any]:
        return {
            "access_capacity_bps": self.access_capacity_bps,
            "arm": self.arm,
            "flows": self.flows,
            "fell_back": self.fell_back,
            "share": self.share.to_json(),
        }


@dataclass(frozen=True)
class Trials:
    source: str  # where the FCT and mode figures come from: "rollup", or "live" (the flows)
    binned: dict[str, dict[str, dict[int, stats.FctSummary]]]  # capacity -> arm -> size bin
    buckets: dict[tuple[str, str], dict[str, stats.FctSummary]]  # (capacity, arm) -> bucket
    smallest_bin: int | None  # the smallest size bin with a flow
    fallbacks: list[Fallback]
    speedups: list[dict[str, Any]]  # v_trial_speedups' rows, or computed from the flows
    speedups_computed: bool
    modes: dict[str, stats.KaModeTime]  # "arm @ capacity" -> time in Kick-Ass mode

    def summary(self) -> dict[str, Any]:
        return {
            "smallest_size_bin": self.smallest_bin,
            "fallbacks": [f.to_json() for f in self.fallbacks],
            "speedups": [{k: r.get(k) for k in SPEEDUP_KEYS} for r in self.speedups],
            "kickass_mode": {k: m.to_json() for k, m in self.modes.items()},
        }


def _fct_summary(r: Mapping[str, Any]) -> stats.FctSummary:
    flows, completed = int(r["flows"]), int(r["completed"])
    return stats.FctSummary(
        flows,
        completed,
        completed / flows if flows else math.nan,
        r["fct_ms_mean"],
        r["fct_ms_p50"],
        r["fct_ms_p95"],
    )


def build(data: ReportData) -> Trials:
    binned: dict[str, dict[str, dict[int, stats.FctSummary]]] = {}
    buckets: dict[tuple[str, str], dict[str, stats.FctSummary]] = {}
    for r in data.fct_bins:
        cap = _capacity(r["access_capacity_bps"])
        s = _fct_summary(r)
        if r["size_bin"] is not None:
            binned.setdefault(cap, {}).setdefault(r["arm"], {})[int(r["size_bin"])] = s
        elif r["size_bucket"] is not None:
            buckets.setdefault((cap, r["arm"]), {})[r["size_bucket"]] = s
    binned = {
        cap: {arm: dict(sorted(bins.items())) for arm, bins in sorted(arms.items())}
        for cap, arms in sorted(binned.items())
    }
    smallest = min(
        (int(r["size_bin"]) for r in data.fct_bins if r["size_bin"] is not None and r["flows"]),
        default=None,
    )
    fallbacks = []
    for r in sorted(data.fallbacks, key=lambda r: (r["access_capacity_bps"] or 0.0, r["arm"])):
        flows, fell = int(r["flows"]), int(r["fell_back"])
        fallbacks.append(
            Fallback(r["access_capacity_bps"], r["arm"], flows, fell, stats.share(fell, flows))
        )
    modes = {
        f"{r['arm']} @ {_capacity(r['access_capacity_bps'])}": stats.KaModeTime(
            int(r["flows"]),
            r["mean"],
            r["median"],
            r["share_of_time"],
            (list(r["cdf_x"] or []), list(r["cdf_y"] or [])),
        )
        for r in data.ka_mode
    }
    return Trials(
        data.trials_source,
        binned,
        buckets,
        smallest,
        fallbacks,
        data.speedups,
        data.speedups_computed,
        dict(sorted(modes.items())),
    )


def _fct_html(m: Trials, sec: Section) -> None:
    how = (
        "the refresh rollup (v_report_fct_bins, v_report_ka_mode)"
        if m.source == "rollup"
        else "the flows, on this read (report_fct_bins, report_ka_mode)"
    )
    smallest = m.smallest_bin
    if smallest is not None:
        label = "1" if smallest == 1 else f"{smallest}-{2 * smallest - 1}"
        sec.body.append(
            "<p>Flow sizes are the paper's workload (§IV-A) as <code>kickass trials run</code> "
            "draws it by default: bounded Pareto, shape 1.8, mean 100 packets of 1500 bytes, "
            "within 1..2000. With that mean and shape the Pareto's scale is 45.7 packets, so "
            "<strong>no flow is shorter than 46 packets</strong>: the 1-10 bucket stays empty "
            "and 11-100 holds 46-100 only (a reading of the paper, which gives the range, the "
            "mean and the shape). The paper's range taken literally is "
            "<code>--literal-range</code> (71% of the flows of one packet, mean 1.9). "
            f"The smallest flows shown here are in the {label} packet bin (below 46: trials "
            "of another workload).</p>"
        )
    what = "FCT against flow size"
    fig = figures.fct_by_size("fct-by-size", what, m.binned)
    sec.add_figure(
        fig,
        what,
        f"{what}, per access capacity and arm: the marker is the median FCT of "
        "the completed flows in each power-of-two size bin, the bar reaches the 95th "
        "percentile; flows that did not complete count in the table's completion rate "
        f"(from {how}).",
    )
    rows = []
    for (cap, arm), by_bucket in sorted(m.buckets.items()):
        for bucket in stats.SIZE_BUCKETS:
            b = by_bucket.get(bucket)
            if b is not None and b.flows:
                rows.append(
                    [
                        cap,
                        arm,
                        bucket,
                        b.flows,
                        _f(b.completion_rate),
                        _f(b.p50_ms, "{:.0f}"),
                        _f(b.p95_ms, "{:.0f}"),
                    ]
                )
    if rows:
        sec.body.append(
            _table(
                [
                    "access",
                    "arm",
                    "size (packets)",
                    "flows",
                    "completed",
                    "FCT p50 (ms)",
                    "FCT p95 (ms)",
                ],
                rows,
            )
        )


def _fallbacks_html(m: Trials, sec: Section) -> None:
    frows = [[_capacity(f.access_capacity_bps), f.arm, f.flows, f.fell_back, _interval(f.share)]
             for f in m.fallbacks]  # fmt: skip
    if frows:
        sec.body.append(
            "<h3>Kick-Ass flows that fell back to TCP</h3><p>A flow of a Kick-Ass period whose "
            "handshake fell back to TCP from the start (the negotiated protocol stored with "
            "each flow) ran as TCP. It stays in its arm's figures, completion rates and speedup "
            "(compared as assigned), so the share says how much of each Kick-Ass arm was TCP. "
            "Flows stored before the negotiated protocol was recorded count as not fallen "
            "back.</p>"
        )
        sec.body.append(
            _table(["access", "arm", "Kick-Ass flows", "fell back to TCP", "share (95% CI)"], frows)
        )


def _speedup_row(r: Mapping[str, Any]) -> list[Any]:
    speedup = "-"
    if r.get("speedup") is not None:
        speedup = (
            f"{r['speedup']:.2f}x ({_f(r['speedup_low'], '{:.2f}')}-"
            f"{_f(r['speedup_high'], '{:.2f}')})"
        )
    sooner = "-"
    if r.get("sooner") is not None:
        sooner = (
            f"{_f(r['sooner'])} ({_f(r.get('sooner_low'))}-{_f(r.get('sooner_high'))}) "
            f"of {r['sooner_pairs']}"
        )
    return [
        r["destination"],
        _capacity(r["access_capacity_bps"]),
        r["arm"],
        r["baseline_arm"],
        f"{r['matched']}/{r['pairs']}",
        speedup,
        f"{_f(r['completion_arm'])} / {_f(r['completion_baseline'])}",
        sooner,
        "1.2-4x",
    ]


def _speedups_html(m: Trials, sec: Section) -> None:
    what = "Speedup of Kick-Ass over the baseline, on matched flows"
    fig = figures.speedups("speedup", what, m.speedups)
    source = (
        "computed from the flows shown (rollups.compute)"
        if m.speedups_computed
        else "v_trial_speedups, the refresh rollup"
    )
    sec.add_figure(
        fig,
        what,
        f"{what}: geometric mean of FCT(baseline) / FCT(Kick-Ass) over the "
        f"same flows under each arm, with a 95% interval over period pairs ({source}; "
        "none from a single pair); the "
        "shaded band is the paper's 1.2-4x.",
    )
    srows = [
        _speedup_row(r)
        for r in m.speedups
        if r.get("size_bucket") == rollups.ALL_SIZES
        and (r.get("speedup") is not None or r.get("sooner") is not None)
    ]
    if srows:
        sec.body.append(
            "<p>Two comparisons of the same flows, each with its 95% interval over period "
            "pairs. The <strong>speedup</strong> is how much faster the arm finished the flows "
            "that both arms finished: the geometric mean of FCT(baseline) / FCT(arm). A pair in "
            "which either arm did not finish its flow leaves it, so it says nothing of those "
            "flows and flatters the arm that fails more. <strong>Finished sooner</strong> keeps "
            "every matched flow: the share in which the arm's flow finished before the "
            "baseline's, a flow that did not finish counted slower than any that did and a tie "
            "as half (50%: no difference); only flows never given their time (a skipped period, "
            "a stopped trial) are left out, and how many it compares follows it. It says how "
            "often the arm was sooner, not by how much. Completion (the share of matched flows "
            "each arm finished) is beside both.</p>"
        )
        sec.body.append(
            _table(
                [
                    "destination",
                    "access",
                    "arm",
                    "baseline",
                    "matched/pairs",
                    "speedup, all sizes (95% CI)",
                    "completed: arm / baseline",
                    "finished sooner under the arm (95% CI), failures kept",
                    "paper",
                ],
                srows,
            )
        )


def _modes_html(m: Trials, sec: Section) -> None:
    what = "Time in Kick-Ass mode"
    fig = figures.cdfs(
        "kickass-mode-cdf",
        what,
        "share of the flow's time in Kick-Ass mode",
        {k: mode.cdf for k, mode in m.modes.items()},
    )
    sec.add_figure(
        fig,
        what,
        f"{what}: the CDF over Kick-Ass flows of the share of each flow's time "
        "spent in Kick-Ass mode (the rest in TCP mode). The paper: at 10 Mbit/s flows "
        "stay in Kick-Ass mode; at 100 Mbit/s on a ~2000-mile path about half the time "
        "is in TCP mode.",
    )
    mrows = [
        [k, mode.flows, _f(mode.mean), _f(mode.median), _f(mode.share_of_time)]
        for k, mode in m.modes.items()
        if mode.flows
    ]
    if mrows:
        sec.body.append(
            _table(["arm @ access", "flows", "mean", "median", "share of all time"], mrows)
        )


def to_html(m: Trials) -> Section:
    sec = Section("trials", "The wide-area trials")
    _fct_html(m, sec)
    _fallbacks_html(m, sec)
    _speedups_html(m, sec)
    _modes_html(m, sec)
    return sec


def section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    m = build(data)
    return to_html(m), m.summary()
