"""The report's router section: advertised rate, leading-fragment length,
queue and marking mode over time, per run, with each run's means."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import figures
from .markup import Section, _capacity, _f, _table
from .readers import MAX_ROUTER_RUNS, ReportData, _run_label


@dataclass(frozen=True)
class RouterRun:
    label: str
    capacity_bps: float | None
    samples: int
    duration_s: float
    advertised_rate_mean: float | None  # bit/s
    queue_mean: float | None  # bytes
    kickass_share: float | None  # of the samples, in Kick-Ass marking mode


@dataclass(frozen=True)
class Router:
    series: list[figures.RunSeries]  # the MAX_ROUTER_RUNS latest runs, drawn
    runs: list[RouterRun]  # every run, the latest first

    def summary(self) -> dict[str, Any]:
        return {"router_runs": len(self.runs)}


def build(data: ReportData) -> Router:
    runs = [
        RouterRun(
            _run_label(r),
            r["capacity_bps"],
            r["samples"],
            (r["last_at"] - r["first_at"]).total_seconds(),
            r["advertised_rate_mean"],
            r["queue_mean"],
            r["kickass_share"],
        )
        for r in data.router_runs
    ]
    return Router(data.router_series, runs)


def to_html(m: Router) -> Section:
    sec = Section("router", "The edge router")
    what = "The router over time"
    fig = figures.router("router", what, m.series)
    sec.add_figure(
        fig,
        what,
        f"{what}: advertised rate, leading-fragment length, queue and the "
        "share of samples in Kick-Ass marking mode (0: TCP mode), per run; long runs "
        f"are drawn as the means of {figures.MAX_POINTS} time buckets.",
    )
    rows = [
        [
            r.label,
            _capacity(r.capacity_bps),
            r.samples,
            _f(r.duration_s, "{:.0f} s"),
            _f(r.advertised_rate_mean / 1e6 if r.advertised_rate_mean is not None else None,
               "{:.2f}"),
            _f(r.queue_mean / 1e3 if r.queue_mean is not None else None, "{:.1f}"),
            _f(r.kickass_share),
        ]
        for r in m.runs
    ]  # fmt: skip
    if rows:
        more = len(m.runs) - MAX_ROUTER_RUNS
        if more > 0:
            sec.body.append(
                f"<p>The figure shows the {MAX_ROUTER_RUNS} latest runs of {len(m.runs)}.</p>"
            )
        sec.body.append(
            _table(
                [
                    "run",
                    "capacity",
                    "samples",
                    "duration",
                    "mean advertised rate (Mbit/s)",
                    "mean queue (kB)",
                    "in Kick-Ass mode",
                ],
                rows,
            )
        )
    return sec


def section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    m = build(data)
    return to_html(m), m.summary()
