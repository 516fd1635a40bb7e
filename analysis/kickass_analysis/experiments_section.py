"""The paper's congestion experiments: the report's section, and the figures
`kickass experiment` prints (issue 24 item 6).

A run (``kickass_testbed.congestion``, stored by
``kickass_db.experiment_store``) is one of

* **(a)**, §III-D1 Fig. 5: long-lived Kick-Ass flows at our router with TCP
  cross traffic switched on and off: the router should enter TCP mode when
  the TCP flows start and leave it when they stop, and Kick-Ass and TCP
  should share the link fairly meanwhile;
* **(b)**, §III-D2 Fig. 7: the same with the congestion at a legacy
  drop-tail bottleneck behind our router: the router keeps advertising
  rates (it is not the bottleneck) and the Kick-Ass endpoints must find the
  congestion by their losses;
* **the TCP-mode floor** (§II-C2, "bounded below by TCP"): ka-router in
  drop-tail mode, no rates: the Kick-Ass flows run in TCP mode throughout.
* **(d)**, §IV-B in miniature (``kickass_testbed.wide_area``, kind
  ``wide-area``): one round of paired trials from our edge to ten emulated
  paths (a few ms to 250 ms, the deeper ones behind a legacy drop-tail
  link), at one access rate per run: per path the matched-flow speedup with
  its interval and completion per arm, the share finished sooner with
  failures kept, and the time in Kick-Ass mode (Σ ka_mode_ms / Σ FCT),
  beside the paper's 1.2-4x and its median 50% in TCP mode at 100 Mbit/s.
  Such a run has no rates and no epochs: it is shown as its per-path table.

Per run the section draws every flow's rate over time (Kick-Ass and TCP in
two colours), the totals against the capacity and the share of Kick-Ass
flows in Kick-Ass mode, with the router's TCP-mode intervals shaded (its
telemetry, ``v_router_telemetry`` by the run's ``router_run_name``; without
any, the intervals in which most Kick-Ass flows were in TCP mode, said so);
a table of each TCP epoch's figures (computed when the run was: Jain's
index over every flow's throughput and the Kick-Ass mean over the TCP mean
in the epoch's second half, utilisation, RTTs until the router entered and
left TCP mode), the Kick-Ass flows' own switch times beside them, and the
paper's words beside ours with the goals of issue 24 ("What must be shown").
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from kickass_db.experiment_store import (
    ExperimentRun,
    FlowSeries,
    experiment_name,
    flow_series,
)

from .figures import MAX_POINTS, Figure, Shading, congestion

if TYPE_CHECKING:
    from .report.markup import Section

# The runs drawn (the latest); the summary table lists every run.
MAX_RUNS = 8
# Issue 24, "What must be shown": (a) and, for fairness, (b).
JAIN_GOAL = 0.9
RATIO_GOAL = (0.8, 1.25)
UTILISATION_GOAL = 0.9
ENTER_RTTS_GOAL = 3.0
LEAVE_RTTS_GOAL = 5.0
TITLES = {
    "a": "experiment (a): TCP cross traffic at the Kick-Ass bottleneck",
    "b": "experiment (b): the bottleneck is a legacy drop-tail router behind ours",
    "floor": "the TCP-mode floor: ka-router in drop-tail mode, no rates",
    "d": "experiment (d): ten wide-area paths from our edge (§IV-B in miniature)",
}
# The paper's words, by experiment: (where, claim, what of ours answers it).
PAPER: dict[str, list[tuple[str, str, str]]] = {
    "a": [
        ("§III-D1, Fig. 5", "the Kick-Ass router avoids starving Kick-Ass flows, and helps them "
         "retain their TCP fair share during such epochs", "fairness"),
        ("§III-D1", "the Kick-Ass router detects excessive queuing caused by non-Kick-Ass "
         "flows, and stops sending fair-share rates to endpoints", "router_enter"),
        ("§III-D1", "The router quickly detects the absence of the TCP cross traffic and "
         "starts sending fair-share rates via fragmentation.", "router_leave"),
        ("§III-D1", "the Kick-Ass flow rate stabilizes at the fair rate [...] the utilization "
         "approaches the full link capacity", "alone"),
    ],
    "b": [
        ("§III-D2, Fig. 7", "We verify that Kick-Ass flows and native TCP flows fairly share "
         "the available bandwidth in such a case.", "fairness"),
        ("§III-D2", "when TCP flows start pushing the queue at the second router, Kick-Ass "
         "flows detect this change and switch to the TCP mode", "flows_enter"),
        ("§III-D2", "As soon as the congestion at the second router eases [...] Kick-Ass "
         "endpoints promptly move back to the Kick-Ass mode", "flows_leave"),
        ("§III-D2", "Since the first Kick-Ass-enabled router is not the bottleneck, it "
         "continues sending explicit-rate signals throughout the entire experiment.",
         "router_stays"),
        ("§III-D2", "In absence of TCP cross traffic at the second router, Kick-Ass flows "
         "effectively utilize the available bandwidth and achieve fairness", "alone"),
    ],
    "d": [
        ("§IV-B", "Kick-Ass outperforms TCP between 1.2 and 4x, depending on the nature of the "
         "given paths and the access link bandwidth.", "speedups"),
        ("§IV-B", "For a 10 Mbps Kick-Ass link, Kick-Ass consistently outperforms TCP in all "
         "scenarios.", "all_faster"),
        ("§IV-B", "When the Kick-Ass access link is raised to 100 Mbps, the fraction of time "
         "spent in the failover TCP mode increases to 50% in the median case.", "tcp_mode"),
        ("§IV-B", "When destinations are deeper in the Internet, it is more often the case that "
         "the bottleneck is not the edge Kick-Ass router's link [...] In such cases Kick-Ass "
         "moves to TCP mode.", "legacy"),
    ],
    "floor": [
        ("§II-C2", "We see that the performance of Kick-Ass is bounded below by TCP", "floor"),
        ("§II-C2", "At the endpoints, failure to receive a rate signal from the router for "
         "more than a RTT indicates that they should revert to TCP mode.", "flows_in_tcp"),
    ],
}  # fmt: skip


@dataclass(frozen=True)
class EpochRow:
    start_s: float
    end_s: float
    jain: float | None
    kickass_over_tcp: float | None
    utilisation: float | None
    router_enter_rtts: float | None
    router_leave_rtts: float | None
    flows_enter_rtts: float | None
    flows_leave_rtts: float | None

    def misses(self, experiment: str) -> list[str]:
        """The goals of issue 24 this epoch misses."""
        out = []
        lo, hi = RATIO_GOAL
        if self.jain is None or self.jain < JAIN_GOAL:
            out.append(f"Jain's index below {JAIN_GOAL}")
        if self.kickass_over_tcp is None or not lo <= self.kickass_over_tcp <= hi:
            out.append(f"Kick-Ass/TCP outside {lo}-{hi}x")
        if self.utilisation is None or self.utilisation < UTILISATION_GOAL:
            out.append(f"utilisation below {UTILISATION_GOAL:.0%}")
        if experiment == "a":
            if self.router_enter_rtts is None or self.router_enter_rtts > ENTER_RTTS_GOAL:
                out.append(f"router into TCP mode later than {ENTER_RTTS_GOAL:g} RTTs")
            if self.router_leave_rtts is None or self.router_leave_rtts > LEAVE_RTTS_GOAL:
                out.append(f"router back later than {LEAVE_RTTS_GOAL:g} RTTs")
        return out


@dataclass
class Experiment:
    """One run with what the section and the command show of it."""

    run_id: int | None
    name: str  # a, b, floor (experiment_store.EXPERIMENTS)
    kind: str
    router_mode: str
    started_at: datetime | None
    capacity_bps: float
    rtt_ms: float
    interval_s: float
    duration_s: float
    figures: Mapping[str, Any]  # epochs, alone, drivers (experiment_runs.figures)
    flows: list[FlowSeries]
    router: list[tuple[float, str]]  # the router's samples: (t_s, marking_mode)
    router_run_name: str | None = None
    spec: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_outcome(cls, outcome: Mapping[str, Any], run_id: int | None = None) -> Experiment:
        """From a run's outcome (``CongestionOutcome.to_json()``), as it ran."""
        spec = outcome["spec"]
        started = outcome.get("started_at")
        return cls(
            run_id,
            experiment_name(spec["kind"], spec.get("router_mode", "kickass")),
            spec["kind"],
            spec.get("router_mode", "kickass"),
            datetime.fromisoformat(started) if started else None,
            float(spec["capacity_bps"]),
            float(spec["rtt_ms"]),
            float(spec.get("interval_s") or 0.1),
            float(spec.get("duration_s") or 0.0),
            {k: outcome.get(k) for k in ("epochs", "alone", "drivers", "paths", "summary")},
            flow_series(outcome),
            [(float(s[0]), str(s[1])) for s in outcome.get("router") or []],
            outcome.get("router_run_name"),
            spec,
        )

    @classmethod
    def from_stored(
        cls, run: ExperimentRun, flows: list[FlowSeries], router: list[tuple[float, str]]
    ) -> Experiment:
        p = run.parameters
        return cls(
            run.run_id,
            run.experiment,
            run.kind,
            run.router_mode,
            run.started_at,
            run.capacity_bps,
            run.rtt_ms,
            float(p.get("interval_s") or 0.1),
            float(p.get("duration_s") or max((t for s in flows for t in s.t_s), default=0.0)),
            run.figures,
            flows,
            router,
            run.router_run_name,
            p,
        )

    # -- what the figures say ----------------------------------------------------------------

    @property
    def epochs(self) -> list[Mapping[str, Any]]:
        return list(self.figures.get("epochs") or [])

    @property
    def paths(self) -> list[Mapping[str, Any]]:
        """A wide-area run's per-path figures (none for the other kinds)."""
        return list(self.figures.get("paths") or [])

    def flow_counts(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for s in self.flows:
            out[s.protocol] += 1
        return dict(out)

    def kickass_mode_share(self) -> tuple[list[float], list[float]]:
        """Per interval, the share of the Kick-Ass flows sampled in it that
        were in Kick-Ass mode."""
        bins: dict[int, list[bool]] = defaultdict(list)
        for s in self.flows:
            if s.protocol == "kickass":
                for t, ka in zip(s.t_s, s.ka_mode, strict=True):
                    bins[round(t / self.interval_s)].append(ka)
        ticks = sorted(bins)
        return (
            [k * self.interval_s for k in ticks],
            [sum(bins[k]) / len(bins[k]) for k in ticks],
        )

    def flows_switches(self) -> list[tuple[float | None, float | None]]:
        """Per epoch, RTTs from its start until most Kick-Ass flows were in TCP
        mode (None if they were already, or never), and from its end until
        most were back in Kick-Ass mode (None if never before the next)."""
        ts, share = self.kickass_mode_share()
        rtt = self.rtt_ms / 1000
        out = []
        bounds = [(float(e["start_s"]), float(e["end_s"])) for e in self.epochs]
        for n, (a, b) in enumerate(bounds):
            before = [s for t, s in zip(ts, share, strict=True) if t < a]
            enter = None
            if before and before[-1] >= 0.5:
                enter = next(
                    (t for t, s in zip(ts, share, strict=True) if a <= t < b and s < 0.5), None
                )
            nxt = bounds[n + 1][0] if n + 1 < len(bounds) else math.inf
            leave = next(
                (t for t, s in zip(ts, share, strict=True) if b <= t < nxt and s >= 0.5), None
            )
            out.append(
                (
                    None if enter is None else round((enter - a) / rtt, 2),
                    None if leave is None else round((leave - b) / rtt, 2),
                )
            )
        return out

    def epoch_rows(self) -> list[EpochRow]:
        rows = []
        for e, (fin, fout) in zip(self.epochs, self.flows_switches(), strict=True):
            rows.append(
                EpochRow(
                    float(e["start_s"]),
                    float(e["end_s"]),
                    e.get("jain"),
                    e.get("kickass_over_tcp"),
                    e.get("utilisation"),
                    e.get("tcp_mode_after_rtts"),
                    e.get("kickass_mode_after_rtts"),
                    fin,
                    fout,
                )
            )
        return rows

    def router_tcp_share(self) -> float | None:
        """The router's share of samples in TCP mode over the run (None: no telemetry)."""
        if not self.router:
            return None
        return sum(m == "tcp" for _, m in self.router) / len(self.router)

    def kickass_samples_in_tcp_mode(self) -> float | None:
        n = sum(len(s.ka_mode) for s in self.flows if s.protocol == "kickass")
        if not n:
            return None
        return sum(not k for s in self.flows if s.protocol == "kickass" for k in s.ka_mode) / n

    def shading(self) -> Shading:
        """The router's TCP-mode intervals, else (no telemetry) the flows'."""
        if self.router:
            pts = [(t, m == "tcp") for t, m in self.router]
            return Shading("router-tcp-mode", "router in TCP mode", _intervals(pts))
        ts, share = self.kickass_mode_share()
        return Shading(
            "flows-tcp-mode",
            "most Kick-Ass flows in TCP mode (no router telemetry stored)",
            _intervals([(t, s < 0.5) for t, s in zip(ts, share, strict=True)]),
        )

    def figure(self, name: str) -> Figure | None:
        by: dict[str, list[tuple[Sequence[float], Sequence[float]]]] = defaultdict(list)
        for s in self.flows:
            by[s.protocol].append(_line(s.t_s, s.rate_bps, self.interval_s))
        totals: dict[str, list[float]] = {}
        ticks: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for s in self.flows:
            for t, r in zip(s.t_s, s.rate_bps, strict=True):
                ticks[s.protocol][round(t / self.interval_s)] += r
        lines = {}
        for protocol, tk in sorted(ticks.items()):
            keys = sorted(tk)
            totals[protocol] = [tk[k] for k in keys]
            lines[protocol] = _line([k * self.interval_s for k in keys], totals[protocol],
                                    self.interval_s)  # fmt: skip
        mode_t, mode_share = self.kickass_mode_share()
        return congestion(
            name,
            self.title(),
            dict(sorted(by.items())),
            lines,
            _line(mode_t, mode_share, self.interval_s),
            capacity_bps=self.capacity_bps,
            shading=self.shading(),
            epochs=[(float(e["start_s"]), float(e["end_s"])) for e in self.epochs],
        )

    def title(self) -> str:
        run = f"run {self.run_id}: " if self.run_id is not None else ""
        return f"{run}{TITLES.get(self.name, self.name)}"

    def setting(self) -> str:
        c = self.flow_counts()
        when = (
            f", flows started {self.started_at.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
            if self.started_at
            else ""
        )
        if self.paths:
            rtts = [float(p["rtt_ms"]) for p in self.paths]
            sp = self.spec
            return (
                f"{self.capacity_bps / 1e6:g} Mbit/s access, {len(self.paths)} paths of "
                f"{min(rtts):g}-{max(rtts):g} ms, {sp.get('pairs', '?')} pairs of "
                f"{sp.get('period_s', '?')} s periods per path (Kick-Ass, CUBIC); "
                f"router {self.router_mode}{when}"
            )
        return (
            f"{self.capacity_bps / 1e6:g} Mbit/s, {self.rtt_ms:g} ms, "
            f"{c.get('kickass', 0)} Kick-Ass + {c.get('tcp', 0)} TCP flows, "
            f"{self.duration_s:g} s, TCP on "
            + (", ".join(f"{float(e['start_s']):g}-{float(e['end_s']):g} s" for e in self.epochs)
               or "never")
            + f"; router {self.router_mode}{when}"
        )  # fmt: skip

    # -- tables (the section's HTML and the command's text) ----------------------------------

    EPOCH_HEAD = (
        "TCP flows on",
        "Jain's index",
        "Kick-Ass / TCP",
        "utilisation",
        "router in TCP mode after",
        "router back after",
        "Kick-Ass flows in TCP mode after",
        "flows back after",
        "goals (issue 24)",
    )

    def epoch_table(self) -> list[list[str]]:
        rows = [
            [
                f"{r.start_s:g}-{r.end_s:g} s",
                _num(r.jain, "{:.3f}"),
                _num(r.kickass_over_tcp, "{:.2f}x"),
                _num(r.utilisation, "{:.1%}"),
                _rtts(r.router_enter_rtts),
                _rtts(r.router_leave_rtts),
                _rtts(r.flows_enter_rtts),
                _rtts(r.flows_leave_rtts),
                "; ".join(r.misses(self.name)) or "all met",
            ]
            for r in self.epoch_rows()
        ]
        alone = self.figures.get("alone") or {}
        if alone:
            rows.append(
                ["Kick-Ass alone (before)", _num(alone.get("jain"), "{:.3f}"), "-",
                 _num(alone.get("utilisation"), "{:.1%}"), "-", "-", "-", "-", "-"]
            )  # fmt: skip
        return rows

    PATH_HEAD = (
        "path",
        "region",
        "RTT",
        "legacy bottleneck",
        "matched flows",
        "speedup",
        "95% interval",
        "completed Kick-Ass / CUBIC",
        "finished sooner",
        "time in Kick-Ass mode",
        "largest goodput Kick-Ass / CUBIC",
    )

    def path_table(self) -> list[list[str]]:
        """A wide-area run's row per path."""
        out = []
        for p in self.paths:
            flows, done = p.get("flows") or {}, p.get("completed") or {}
            good = p.get("goodput_max_bps") or {}
            arms = list(flows)
            low, high = p.get("speedup_low"), p.get("speedup_high")
            out.append(
                [str(p.get("path")), str(p.get("region", "-")), f"{float(p['rtt_ms']):g} ms",
                 "-" if p.get("bottleneck_bps") is None
                 else f"{float(p['bottleneck_bps']) / 1e6:g} Mbit/s",
                 _num(p.get("matched"), "{:d}"), _num(p.get("speedup"), "{:.2f}x"),
                 "-" if low is None or high is None else f"[{low:.2f}, {high:.2f}]",
                 " / ".join(f"{done.get(a, 0)}/{flows.get(a, 0)}" for a in arms) or "-",
                 _num(p.get("sooner"), "{:.0%}"), _num(p.get("ka_mode_share"), "{:.1%}"),
                 " / ".join(_num(None if good.get(a) is None else good[a] / 1e6, "{:.1f}")
                            for a in arms) + " Mbit/s"]
            )  # fmt: skip
        return out

    def _path_claims(self) -> dict[str, str]:
        paths = self.paths
        speedups = [p["speedup"] for p in paths if p.get("speedup") is not None]
        shares = sorted(p["ka_mode_share"] for p in paths if p.get("ka_mode_share") is not None)
        median = None
        if shares:
            n = len(shares)
            median = (shares[(n - 1) // 2] + shares[n // 2]) / 2
        legacy = [p for p in paths if p.get("bottleneck_bps") is not None]
        at = f"at {self.capacity_bps / 1e6:g} Mbit/s: "
        return {
            "speedups": at + (f"{min(speedups):.2f}x to {max(speedups):.2f}x over "
                              f"{len(speedups)} paths" if speedups else "no speedup"),
            "all_faster": at + f"{sum(s > 1 for s in speedups)} of {len(speedups)} paths "
            "faster under Kick-Ass (point estimates), "
            f"{sum((p.get('speedup_low') or 0) > 1 for p in paths)} with the interval above 1",
            "tcp_mode": at + ("no Kick-Ass flow completed" if median is None else
                              f"median time in TCP mode {1 - median:.0%} over the paths "
                              f"({1 - shares[-1]:.0%} to {1 - shares[0]:.0%})"),
            "legacy": at + ("; ".join(
                f"{p['path']} ({float(p['bottleneck_bps']) / 1e6:g} Mbit/s legacy link): "
                f"{_num(_tcp_share(p), '{:.0%}')} in TCP mode" for p in legacy)
                or "no legacy bottleneck"),
        }  # fmt: skip

    def claims(self) -> list[tuple[str, str, str]]:
        """(where, the paper's words, ours) for this experiment."""
        if self.paths:
            mine = self._path_claims()
            return [(where, words, mine[key]) for where, words, key in PAPER["d"]]
        rows = self.epoch_rows()
        alone = self.figures.get("alone") or {}

        def each(fmt: Any) -> str:
            return "; ".join(f"{r.start_s:g}-{r.end_s:g} s: {fmt(r)}" for r in rows) or "no epoch"

        ours = {
            "fairness": each(
                lambda r: f"Jain {_num(r.jain, '{:.3f}')}, Kick-Ass/TCP "
                f"{_num(r.kickass_over_tcp, '{:.2f}x')}, "
                f"utilisation {_num(r.utilisation, '{:.1%}')}"
            ),
            "router_enter": each(
                lambda r: f"router in TCP mode after {_rtts(r.router_enter_rtts)}"
            ),
            "router_leave": each(lambda r: f"router back after {_rtts(r.router_leave_rtts)}"),
            "flows_enter": each(
                lambda r: f"most Kick-Ass flows in TCP mode after {_rtts(r.flows_enter_rtts)}"
            ),
            "flows_leave": each(lambda r: f"most back after {_rtts(r.flows_leave_rtts)}"),
            "alone": f"Kick-Ass alone: Jain {_num(alone.get('jain'), '{:.3f}')}, utilisation "
            f"{_num(alone.get('utilisation'), '{:.1%}')}",
            "router_stays": "no router telemetry stored"
            if self.router_tcp_share() is None
            else f"the router was in TCP mode in {_num(self.router_tcp_share(), '{:.1%}')} of its "
            "samples",
            "floor": each(lambda r: f"Kick-Ass/TCP {_num(r.kickass_over_tcp, '{:.2f}x')}, "
                          f"Jain {_num(r.jain, '{:.3f}')}"),
            "flows_in_tcp": f"Kick-Ass flows in TCP mode in "
            f"{_num(self.kickass_samples_in_tcp_mode(), '{:.1%}')} of their samples",
        }  # fmt: skip
        return [(where, words, ours[key]) for where, words, key in PAPER.get(self.name, [])]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "experiment": self.name,
            "kind": self.kind,
            "router_mode": self.router_mode,
            "flows": self.flow_counts(),
            "epochs": [{**r.__dict__, "misses": r.misses(self.name)} for r in self.epoch_rows()],
            "alone": dict(self.figures.get("alone") or {}),
            "router_tcp_share": self.router_tcp_share(),
            "shading": self.shading().series,
            "paths": self.paths,
            "summary": dict(self.figures.get("summary") or {}),
        }

    def text(self) -> str:
        """The command's summary: the epoch table and the paper beside ours."""
        head, rows = (
            (list(self.PATH_HEAD), self.path_table())
            if self.paths
            else (list(self.EPOCH_HEAD), self.epoch_table())
        )
        table = [head, *rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(head) - 1)]
        lines = [f"{self.title()}", f"  {self.setting()}"]
        for r in table:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False))
                         + "  " + r[-1])  # fmt: skip
        lines.append("  the paper beside ours:")
        for where, words, ours in self.claims():
            lines.append(f'    {where}: "{words}"')
            lines.append(f"      ours: {ours}")
        return "\n".join(lines)


def _intervals(points: Sequence[tuple[float, bool]]) -> list[tuple[float, float]]:
    """Where ``points`` (time-ordered) are true: from the first true sample to
    the next false one (or the last sample)."""
    out, start = [], None
    for t, on in points:
        if on and start is None:
            start = t
        elif not on and start is not None:
            out.append((start, t))
            start = None
    if start is not None and points:
        out.append((start, points[-1][0]))
    return out


def _line(
    t: Sequence[float], y: Sequence[float], interval: float
) -> tuple[list[float], list[float]]:
    """A series as a figure draws it: means of consecutive samples down to
    ``MAX_POINTS``, broken (NaN) where samples are missing."""
    k = max(1, math.ceil(len(t) / MAX_POINTS))
    xs = [sum(t[i : i + k]) / len(t[i : i + k]) for i in range(0, len(t), k)]
    ys = [sum(y[i : i + k]) / len(y[i : i + k]) for i in range(0, len(y), k)]
    out_x: list[float] = []
    out_y: list[float] = []
    for x, v in zip(xs, ys, strict=True):
        if out_x and x - out_x[-1] > 1.5 * k * interval:
            out_x.append((x + out_x[-1]) / 2)
            out_y.append(math.nan)
        out_x.append(x)
        out_y.append(v)
    return out_x, out_y


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _tcp_share(path: Mapping[str, Any]) -> float | None:
    """A path's time in TCP mode: the rest of its Kick-Ass flows' lifetime."""
    share = path.get("ka_mode_share")
    return None if share is None else 1 - float(share)


def _rtts(x: float | None) -> str:
    return "-" if x is None else f"{x:g} RTT"


# -- the report's section ----------------------------------------------------------------------


class ExperimentsData(Protocol):
    """What the section reads of the report's data (report.readers.ReportData,
    which ``report.readers.read_experiments`` fills): a structural type, so
    this module never imports the readers that import it."""

    experiment_runs: list[ExperimentRun]
    experiments: list[Experiment]


def section(data: ExperimentsData) -> tuple[Section, dict[str, Any]]:
    from .report.markup import Section, _table

    sec = Section("experiments", "The paper's congestion experiments")
    runs: list[ExperimentRun] = data.experiment_runs
    if not runs:
        return sec, {"experiments": []}
    sec.empty = False
    e = html.escape
    sec.body.append(
        "<p>The paper's partial-deployment experiments (§III-D) on the testbed, run by "
        "<code>kickass experiment run a|b|floor</code> (long-lived flows; TCP cross traffic "
        "switched on and off), and its wide-area evaluation (§IV-B) in miniature, "
        "<code>kickass experiment run d</code> (a round of paired trials to ten emulated paths, "
        "shown as a table per path). The paper ran 64 Kick-Ass and 64 TCP flows at 150 Mbit/s, "
        "100 ms and a 1000-packet queue; ours are scaled to two cores (by default 8 + 8 flows "
        "at 20 Mbit/s, 100 ms and a one-BDP buffer: 10.4 packets per RTT per flow while TCP is "
        "on, the paper's 9.8). Each epoch's figures are over its second half: Jain's index over "
        "every flow's throughput, the Kick-Ass flows' mean over the TCP flows' and the "
        "utilisation (wire bytes over the capacity); the router's switch times come from its "
        "telemetry, the Kick-Ass flows' from the mode each reported every interval (when most "
        "of them were in TCP mode). Goals (issue 24): Jain's index at least "
        f"{JAIN_GOAL}, Kick-Ass/TCP within {RATIO_GOAL[0]}-{RATIO_GOAL[1]}x, "
        f"utilisation at least {UTILISATION_GOAL:.0%}; in (a) the router in TCP mode "
        f"within {ENTER_RTTS_GOAL:g} RTTs of an epoch's start and back within "
        f"{LEAVE_RTTS_GOAL:g} RTTs of its end.</p>"
    )
    summary_rows = []
    for r in runs:
        if r.figures.get("paths"):
            summary_rows.append(_wide_area_row(r))
            continue
        epochs = r.figures.get("epochs") or []
        jains = [x["jain"] for x in epochs if x.get("jain") is not None]
        ratios = [x["kickass_over_tcp"] for x in epochs if x.get("kickass_over_tcp") is not None]
        summary_rows.append(
            [r.run_id, r.experiment, f"{r.started_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC",
             f"{r.capacity_bps / 1e6:g} Mbit/s, {r.rtt_ms:g} ms",
             f"{r.flows.get('kickass', 0)} + {r.flows.get('tcp', 0)}", len(epochs),
             _num(min(jains, default=None), "{:.3f}"),
             " / ".join(f"{x:.2f}x" for x in ratios) or "-"]
        )  # fmt: skip
    sec.body.append(
        _table(
            ["run", "experiment", "flows started", "link", "Kick-Ass + TCP flows", "TCP epochs",
             "lowest Jain's index", "Kick-Ass / TCP per epoch"],
            summary_rows,
            "experiment-runs",
        )
    )  # fmt: skip
    if len(runs) > len(data.experiments):
        sec.body.append(
            f"<p>The figures below show the {len(data.experiments)} latest runs of {len(runs)}.</p>"
        )
    shown = []
    for x in reversed(data.experiments):
        name = f"experiment-{x.run_id}"
        if x.paths:
            sec.body.append(_wide_area_html(x, name))
            shown.append(x.to_json())
            continue
        fig = x.figure(name)
        shade = x.shading()
        sec.body.append(f'<h3 id="{e(name)}">{e(x.title())}</h3><p>{e(x.setting())}.</p>')
        sec.add_figure(
            fig,
            x.title(),
            "Top: every flow's payload rate every "
            f"{x.interval_s:g} s (green Kick-Ass, red TCP); middle: each protocol's total "
            "against the capacity; bottom: the share of Kick-Ass flows in Kick-Ass mode. "
            + (
                "Shaded: the router in TCP mode (its telemetry)."
                if shade.series == "router-tcp-mode"
                else "No router telemetry was stored with this run: shaded where most "
                "Kick-Ass flows were in TCP mode."
            )
            + " Dotted: the TCP flows switched on and off.",
        )
        sec.body.append(_table(list(Experiment.EPOCH_HEAD), x.epoch_table(), "experiment-epochs"))
        claims = x.claims()
        if claims:
            sec.body.append(
                _table(
                    ["paper", "the paper's words", "ours"],
                    [[where, f"“{words}”", ours] for where, words, ours in claims],
                    "experiment-claims",
                )
            )
        shown.append(x.to_json())
    return sec, {"experiments": shown, "experiment_runs": len(runs)}


def _wide_area_row(r: ExperimentRun) -> list[Any]:
    """A wide-area run's line in the runs' table: its paths and speedups."""
    paths = r.figures.get("paths") or []
    rtts = [float(p["rtt_ms"]) for p in paths]
    speedups = [p["speedup"] for p in paths if p.get("speedup") is not None]
    flows: dict[str, int] = defaultdict(int)
    for p in paths:
        for arm, n in (p.get("flows") or {}).items():
            flows[arm] += int(n)
    return [
        r.run_id, r.experiment, f"{r.started_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC",
        f"{r.capacity_bps / 1e6:g} Mbit/s, {len(paths)} paths of "
        f"{min(rtts, default=0):g}-{max(rtts, default=0):g} ms",
        " + ".join(str(n) for n in flows.values()) or "-", "-", "-",
        f"per path {min(speedups):.2f}x to {max(speedups):.2f}x" if speedups else "-",
    ]  # fmt: skip


def _wide_area_html(x: Experiment, name: str) -> str:
    """A wide-area run: its setting, the per-path table and the paper's words."""
    from .report.markup import _table

    e = html.escape
    parts = [
        f'<h3 id="{e(name)}">{e(x.title())}</h3><p>{e(x.setting())}. Per path: the paired '
        "speedup on matched flows (geometric mean of CUBIC's FCT over Kick-Ass's) with its "
        "95% interval over period pairs and completion per arm; the share of matched flows "
        "finished sooner under Kick-Ass with failures kept; the time in Kick-Ass mode "
        "(Σ ka_mode_ms / Σ FCT over the Kick-Ass flows that completed); the largest payload "
        "rate a flow of each arm reached (below the access rate when the path or the senders "
        "could not fill it).</p>",
        _table(list(Experiment.PATH_HEAD), x.path_table(), "experiment-paths"),
    ]
    claims = x.claims()
    if claims:
        parts.append(
            _table(
                ["paper", "the paper's words", "ours"],
                [[where, f"“{words}”", ours] for where, words, ours in claims],
                "experiment-claims",
            )
        )
    return "".join(parts)
