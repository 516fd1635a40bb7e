"""The figures of the report and of the volunteer's page, as SVG text.

Each function takes numbers already computed by ``kickass_analysis.stats``
and returns a ``Figure`` (its name, title, the SVG to put inline in an HTML
page, and how many marks of each series it drew), or None when there is
nothing to draw: the caller then says "no data yet", never shows an empty
axis.

Drawing uses matplotlib's object API (``matplotlib.figure.Figure``), never
pyplot: no global figure state, no GUI backend, safe in a server's threads;
the rcParams of these figures are applied under a lock. The SVG is made to
live inline in an HTML page:

- text stays text (``svg.fonttype: none``), paths are not simplified (a
  drawn point is a data point), the output is deterministic (fixed hash
  salt, no date);
- no text is ever parsed: labels, titles and tick labels come from data (a
  trial's destination, a campaign's name), and matplotlib would read
  ``$...$`` in them as mathtext (and die on ``$\\kaboom$``) or TeX; mathtext
  and TeX are off for every text of these figures, and log axes number
  their ticks in plain text (``_plain_log``), which matplotlib's default
  formatter writes as mathtext;
- the XML prologue, DOCTYPE and metadata block are dropped; every ``id`` and
  reference is prefixed with the figure's name, so several figures in one
  page never share an id;
- the marks (the data: points, bars) are tagged: every artist drawn with
  ``gid="kamark--SERIES"`` becomes ``class="ka-mark" data-series="SERIES"``,
  and the root ``<svg>`` gets ``class="ka-figure" data-figure=NAME``. A point
  is a ``<use>`` inside its series' group, a bar is one tagged group: tests
  count them against the data.
"""

from __future__ import annotations

import io
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import matplotlib
from kickass_core import sources
from matplotlib.axes import Axes
from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import LogFormatter

from . import stats

# The most points one series draws: longer series (an ECDF of every flow, a
# month of router samples) are thinned (stats.thin) or bucketed before.
MAX_POINTS = 600

RC: dict[str, Any] = {
    # Text from data is drawn as written (module docstring).
    "text.parse_math": False,
    "text.usetex": False,
    "svg.fonttype": "none",
    "svg.hashsalt": "kickass",
    "path.simplify": False,
    "font.size": 9,
    "font.family": "DejaVu Sans",
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
}
_LOCK = threading.Lock()

# A study source's colour is its own (``kickass_core.sources``: ``colour``).
COLOURS = {
    "session": "#111111",
    "all": "#1f77b4",
    "country": "#2ca02c",
    "network": "#9467bd",
    "kickass": "#2ca02c",
    "tcp": "#d62728",
    "paper": "#7f7f7f",
}


def source_colour(name: str) -> str | None:
    """The study source's colour in every figure (None: no source of that name)."""
    found = sources.find(name)
    return found.colour if found else None


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
OUTCOME_COLOURS = {
    "ok": "#2ca02c",
    "running": "#1f77b4",
    "skipped": "#bcbd22",
    "failed": "#d62728",
    "timeout": "#ff7f0e",
}


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    svg: str
    # series -> marks drawn (points, or bars)
    marks: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "marks": dict(self.marks)}


@dataclass(frozen=True)
class Series:
    """Points of one series: x, y and (optionally) the interval around y."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    low: Sequence[float] | None = None
    high: Sequence[float] | None = None
    colour: str | None = None
    line: bool = False


def slug(text: str) -> str:
    """A series or figure name usable in an id and an attribute."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "x"


def mark_gid(series: str) -> str:
    return f"kamark--{slug(series)}"


# -- drawing ----------------------------------------------------------------------------


@contextmanager
def _figure(
    width: float = 7.0, height: float = 3.4, nrows: int = 1, ncols: int = 1, **kw: Any
) -> Iterator[tuple[MplFigure, Any]]:
    with _LOCK, matplotlib.rc_context(RC):  # type: ignore[arg-type]  # matplotlib types the keys as a Literal of rc names; RC's are str
        fig = MplFigure(figsize=(width, height), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
        yield fig, axes


def _svg(fig: MplFigure, name: str, title: str, marks: Mapping[str, int]) -> Figure:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    return Figure(name, title, inline_svg(buf.getvalue(), name, title), dict(marks))


_MARK = re.compile(r'id="kamark--([A-Za-z0-9_.-]+)"')
_ID = re.compile(r'\bid="([^"]+)"')
_HREF = re.compile(r'xlink:href="#([^"]+)"')
_URL = re.compile(r"url\(#([^)]+)\)")


def inline_svg(svg: str, name: str, title: str) -> str:
    """matplotlib's SVG document as an element for an HTML page (module docstring)."""
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("not an SVG document")
    svg = svg[start:]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    svg = _MARK.sub(r'class="ka-mark" data-series="\1"', svg)
    prefix = slug(name)
    svg = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', svg)
    svg = _HREF.sub(lambda m: f'xlink:href="#{prefix}-{m.group(1)}"', svg)
    svg = _URL.sub(lambda m: f"url(#{prefix}-{m.group(1)})", svg)
    label = _attr(title)
    return svg.replace(
        "<svg ",
        f'<svg class="ka-figure" data-figure="{_attr(name)}" role="img" aria-label="{label}" ',
        1,
    ).strip()


def _attr(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")
    )


class _PlainLogFormatter(LogFormatter):
    """matplotlib's choice of which log ticks to number, numbered as plain
    text (``1,024``, ``0.5``)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        if not super().__call__(x, pos):
            return ""
        return f"{x:,.0f}" if x >= 1 and x == round(x) else f"{x:g}"


def _plain_log(ax: Axes, which: str, base: float = 10) -> None:
    """A log scale on ``ax``'s x or y axis, its tick numbers plain text."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=base)
    axis.set_major_formatter(_PlainLogFormatter(base))
    axis.set_minor_formatter(_PlainLogFormatter(base, labelOnlyBase=False))


def _points(
    ax: Axes, s: Series, colour: str, *, size: float = 3.5, label: str | None = None
) -> int:
    """One series as markers (with an error bar per point when it has an
    interval); returns the markers drawn (NaN points are not)."""
    xs = [float(v) for v in s.x]
    ys = [float(v) for v in s.y]
    if all(math.isnan(y) for y in ys):
        return 0  # nothing to draw: no empty tagged group either
    if s.low is not None and s.high is not None:
        lo = [
            max(0.0, y - float(v)) if not math.isnan(float(v)) else 0.0
            for y, v in zip(ys, s.low, strict=True)
        ]
        hi = [
            max(0.0, float(v) - y) if not math.isnan(float(v)) else 0.0
            for y, v in zip(ys, s.high, strict=True)
        ]
        bars = ax.errorbar(
            xs, ys, yerr=[lo, hi], fmt="none", ecolor=colour, elinewidth=0.7, alpha=0.55
        )
        for part in bars.lines[2]:
            part.set_gid(f"interval--{slug(s.label)}")
    ax.plot(
        xs,
        ys,
        marker="o",
        markersize=size,
        linestyle="-" if s.line else "none",
        linewidth=1.0,
        color=colour,
        label=label if label is not None else s.label,
        gid=mark_gid(s.label),
    )
    return sum(1 for y in ys if not math.isnan(y))


# -- the study -----------------------------------------------------------------------------


def drop_rate(
    name: str, title: str, xlabel: str, series: Sequence[Series], *, note: str | None = None
) -> Figure | None:
    """Drop rate (percent) against a size, one marker per size with its
    Wilson interval, one colour per series (source, or session and groups)."""
    series = [s for s in series if len(s.x)]
    if not series:
        return None
    marks: dict[str, int] = {}
    with _figure() as (fig, axes):
        ax = axes[0][0]
        for i, s in enumerate(series):
            colour = s.colour or PALETTE[i % len(PALETTE)]
            pct = Series(
                s.label,
                s.x,
                [100 * v for v in s.y],
                None if s.low is None else [100 * v for v in s.low],
                None if s.high is None else [100 * v for v in s.high],
                line=s.line,
            )
            marks[slug(s.label)] = _points(ax, pct, colour, size=3.0 if len(s.x) > 60 else 4.0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("drop rate (%)")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        if note:
            ax.text(0.99, 0.97, note, transform=ax.transAxes, ha="right", va="top", fontsize=7)
        # Beside the axes, never over the points.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        return _svg(fig, name, title, marks)


def rates(label: str, points: Sequence[stats.SizeRate], **kw: Any) -> Series:
    """A drop-rate series from ``stats.drop_by_size``."""
    return Series(
        label,
        [p.size for p in points],
        [p.rate.rate for p in points],
        [p.rate.low for p in points],
        [p.rate.high for p in points],
        **kw,
    )


# The study's two drop-rate figures: by packet size (whole packets) and by the
# split (a 1500-byte datagram in two fragments), named NAME-by-size and NAME-by-split.
DROP_PHASES = {
    "whole": ("size", "IP length (B)"),
    "split": ("split", "leading fragment IP length (B)"),
}


@dataclass(frozen=True)
class DropLine:
    """One series of both drop-rate figures: a source's, a session's or a
    group's rates (``stats.drop_by_size``) per phase; a phase with none draws
    nothing of it."""

    label: str
    rates: Mapping[str, Sequence[stats.SizeRate]]  # phase -> rates
    colour: str | None = None
    line: bool = False


def drop_by_phase(
    name: str, titles: Mapping[str, str], lines: Sequence[DropLine]
) -> dict[str, Figure | None]:
    """The drop rate against packet size and against the split (the report's
    study, the volunteer's page), one series per line in each: phase -> figure."""
    return {
        phase: drop_rate(
            f"{name}-by-{suffix}",
            titles[phase],
            xlabel,
            [rates(d.label, d.rates.get(phase, ()), colour=d.colour, line=d.line) for d in lines],
        )
        for phase, (suffix, xlabel) in DROP_PHASES.items()
    }


def shares(
    name: str,
    title: str,
    groups: Mapping[str, Sequence[stats.GroupShare]],
    *,
    paper: float = stats.PAPER["intolerant_share"],
    max_groups: int = 12,
) -> Figure | None:
    """The share of fragment-intolerant clients per group (country, network),
    one bar per group and source with its Wilson interval; the paper's 8.3%
    as a line. ``groups``: source -> shares (largest group first)."""
    rows = [
        (source, g) for source, gs in groups.items() for g in list(gs)[:max_groups] if g.clients > 0
    ]
    if not rows:
        return None
    marks: dict[str, int] = {}
    with _figure(height=max(2.4, 0.6 + 0.22 * len(rows))) as (fig, axes):
        ax = axes[0][0]
        labels = []
        for i, (source, g) in enumerate(rows):
            colour = source_colour(source) or PALETTE[i % len(PALETTE)]
            value = 100 * g.share.rate
            lo, hi = 100 * g.share.low, 100 * g.share.high
            ax.barh(
                i,
                value,
                height=0.7,
                color=colour,
                gid=mark_gid(source),
                label=source if source not in marks else None,
            )
            ax.errorbar(
                value,
                i,
                xerr=[[max(0.0, value - lo)], [max(0.0, hi - value)]],
                fmt="none",
                ecolor="#333",
                elinewidth=0.8,
            )
            marks[slug(source)] = marks.get(slug(source), 0) + 1
            labels.append(f"{g.group} ({source}, n={g.clients})")
        ax.axvline(
            100 * paper,
            color=COLOURS["paper"],
            linestyle="--",
            linewidth=1.0,
            label=f"paper: {100 * paper:.1f}% of {stats.PAPER['clients']}",
        )
        ax.set_yticks(range(len(rows)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("fragment-intolerant clients (%), 95% Wilson interval")
        ax.set_xlim(0, max(100 * paper * 1.5, max(100 * g.share.high for _, g in rows) * 1.05))
        ax.set_title(title)
        ax.legend(loc="lower right")
        return _svg(fig, name, title, marks)


# -- the trials ----------------------------------------------------------------------------


def fct_by_size(
    name: str,
    title: str,
    panels: Mapping[str, Mapping[str, Mapping[int, stats.FctSummary]]],
) -> Figure | None:
    """FCT against flow size: one panel per access capacity, one series per
    arm (protocol), a marker at each size bin's median FCT with a bar from
    the median to the 95th percentile."""
    panels = {
        k: {a: b for a, b in v.items() if any(s.completed for s in b.values())}
        for k, v in panels.items()
    }
    panels = {k: v for k, v in panels.items() if v}
    if not panels:
        return None
    marks: dict[str, int] = {}
    with _figure(height=3.2, ncols=len(panels), sharey=True) as (fig, axes):
        for col, (panel, arms) in enumerate(panels.items()):
            ax = axes[0][col]
            for i, (arm, bins) in enumerate(sorted(arms.items())):
                done = [(b, s) for b, s in bins.items() if s.completed and s.p50_ms is not None]
                series = f"{panel} {arm}"
                colour = COLOURS.get(arm.split(":")[0], PALETTE[i % len(PALETTE)])
                s = Series(
                    series,
                    [b for b, _ in done],
                    [float(s.p50_ms or 0.0) for _, s in done],
                    [float(s.p50_ms or 0.0) for _, s in done],
                    [float(s.p95_ms or 0.0) for _, s in done],
                    line=True,
                )
                marks[slug(series)] = _points(ax, s, colour, label=arm)
            _plain_log(ax, "x", base=2)
            _plain_log(ax, "y")
            ax.set_title(panel)
            ax.legend(loc="upper left")
        axes[0][0].set_ylabel("FCT (ms): median, bar to p95")
        fig.supxlabel("flow size (1500-byte packets, bins of powers of two)", fontsize=9)
        fig.suptitle(title)
        return _svg(fig, name, title, marks)


def speedups(
    name: str,
    title: str,
    rows: Sequence[Mapping[str, Any]],
    buckets: Sequence[str] = (*stats.SIZE_BUCKETS, "all"),
) -> Figure | None:
    """The paired speedup (rows of v_trial_speedups) per size bucket with its
    interval over period pairs, one series per comparison; the paper's 1.2-4x shaded."""
    rows = [r for r in rows if r.get("speedup") is not None]
    if not rows:
        return None
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        cap = r.get("access_capacity_bps")
        where = f"{r['destination']}" + (f" {cap / 1e6:g} Mbit/s" if cap else "")
        by.setdefault(f"{r['arm']} vs {r['baseline_arm']}, {where}", []).append(r)
    marks: dict[str, int] = {}
    with _figure() as (fig, axes):
        ax = axes[0][0]
        ax.axhspan(
            stats.PAPER["speedup_low"],
            stats.PAPER["speedup_high"],
            color="#2ca02c",
            alpha=0.08,
            label="paper: 1.2-4x",
        )
        ax.axhline(1.0, color="#555", linewidth=0.8)
        n = len(by)
        for i, (series, rs) in enumerate(sorted(by.items())):
            pos = {b: j for j, b in enumerate(buckets)}
            rs = [r for r in rs if r["size_bucket"] in pos]
            offset = (i - (n - 1) / 2) * 0.6 / max(n, 1)
            s = Series(
                series,
                [pos[r["size_bucket"]] + offset for r in rs],
                [float(r["speedup"]) for r in rs],
                [
                    float(r["speedup_low"] if r["speedup_low"] is not None else r["speedup"])
                    for r in rs
                ],
                [
                    float(r["speedup_high"] if r["speedup_high"] is not None else r["speedup"])
                    for r in rs
                ],
            )
            marks[slug(series)] = _points(ax, s, PALETTE[i % len(PALETTE)], size=5)
        ax.set_xticks(
            range(len(buckets)), [f"{b} pkts" if b != "all" else "all sizes" for b in buckets]
        )
        _plain_log(ax, "y")
        lo, hi = ax.get_ylim()
        ticks = [t for t in (0.5, 0.75, 1, 1.2, 1.5, 2, 3, 4, 6, 8, 12, 16) if lo <= t <= hi]
        ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
        ax.minorticks_off()
        ax.set_ylabel("speedup: FCT(baseline) / FCT(Kick-Ass)")
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=7)
        return _svg(fig, name, title, marks)


def cdfs(
    name: str,
    title: str,
    xlabel: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
) -> Figure | None:
    """Empirical CDFs (``stats.ecdf``), each drawn through at most
    ``MAX_POINTS`` of its points (``stats.thin``), one marker per point drawn."""
    series = {k: v for k, v in series.items() if len(v[0])}
    if not series:
        return None
    marks: dict[str, int] = {}
    with _figure(height=3.0) as (fig, axes):
        ax = axes[0][0]
        for i, (label, (xs, ys)) in enumerate(sorted(series.items())):
            keep = stats.thin(len(xs), MAX_POINTS)
            colour = PALETTE[i % len(PALETTE)]
            ax.step(
                [xs[j] for j in keep],
                [ys[j] for j in keep],
                where="post",
                color=colour,
                linewidth=1.0,
            )
            s = Series(label, [xs[j] for j in keep], [ys[j] for j in keep])
            marks[slug(label)] = _points(ax, s, colour, size=2.0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("share of flows at or below")
        ax.set_ylim(0, 1.02)
        ax.set_title(title)
        ax.legend(loc="upper left")
        return _svg(fig, name, title, marks)


# -- the router ------------------------------------------------------------------------------

ROUTER_PANELS = (
    ("advertised_rate", "advertised rate (Mbit/s)", 1e-6),
    ("leading_fragment_len", "leading fragment (B)", 1.0),
    ("queue", "queue (kB)", 1e-3),
    ("kickass_mode", "in Kick-Ass mode (share)", 1.0),
)


@dataclass(frozen=True)
class RunSeries:
    """One router run's samples (or time buckets of them): seconds from the
    run's first sample, and a value per panel (None where not known)."""

    label: str
    t: Sequence[float]
    values: Mapping[str, Sequence[float | None]]


def router(name: str, title: str, runs: Sequence[RunSeries]) -> Figure | None:
    """Advertised rate, leading-fragment length, queue and mode over time, one
    panel each (shared time axis), one series per router run."""
    runs = [r for r in runs if len(r.t)]
    if not runs:
        return None
    marks: dict[str, int] = {}
    with _figure(height=6.4, nrows=len(ROUTER_PANELS), sharex=True) as (fig, axes):
        for row, (panel, ylabel, scale) in enumerate(ROUTER_PANELS):
            ax = axes[row][0]
            for i, run in enumerate(runs):
                vals = run.values.get(panel) or []
                pts = [(t, v * scale) for t, v in zip(run.t, vals, strict=True) if v is not None]
                s = Series(
                    f"{panel} {run.label}", [p[0] for p in pts], [p[1] for p in pts], line=True
                )
                marks[slug(s.label)] = _points(
                    ax, s, PALETTE[i % len(PALETTE)], size=1.8, label=run.label
                )
            ax.set_ylabel(ylabel, fontsize=8)
            if panel == "kickass_mode":
                ax.set_ylim(-0.05, 1.05)
        axes[0][0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        axes[-1][0].set_xlabel("time since the run's first sample (s)")
        fig.suptitle(title)
        return _svg(fig, name, title, marks)


# -- the congestion experiments --------------------------------------------------------------


@dataclass(frozen=True)
class Shading:
    """Time intervals to shade (the router in TCP mode), tagged as one series."""

    series: str
    label: str
    intervals: Sequence[tuple[float, float]]


def congestion(
    name: str,
    title: str,
    flows: Mapping[str, Sequence[tuple[Sequence[float], Sequence[float]]]],
    totals: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    kickass_mode: tuple[Sequence[float], Sequence[float]],
    *,
    capacity_bps: float,
    shading: Shading,
    epochs: Sequence[tuple[float, float]] = (),
) -> Figure | None:
    """A congestion experiment as the paper draws it (Fig. 5, Fig. 7): every
    flow's rate over time, one colour per protocol (``flows``: protocol ->
    (t, bit/s) per flow; each flow one line, tagged with its protocol); the
    protocols' total rates against the capacity (``totals``); the share of
    Kick-Ass flows in Kick-Ass mode; the shading's intervals on every panel
    (tagged once each), the TCP flows' epochs as dotted lines."""
    drawn = {p: [f for f in fs if len(f[0])] for p, fs in flows.items()}
    drawn = {p: fs for p, fs in drawn.items() if fs}
    if not drawn:
        return None
    marks: dict[str, int] = {}
    names = {"kickass": "Kick-Ass", "tcp": "TCP"}
    with _figure(height=6.0, nrows=3, sharex=True, height_ratios=(3, 2, 1.2)) as (fig, axes):
        rate_ax, total_ax, mode_ax = (axes[i][0] for i in range(3))
        for i, (protocol, fs) in enumerate(drawn.items()):
            colour = COLOURS.get(protocol, PALETTE[i % len(PALETTE)])
            for j, (t, rate) in enumerate(fs):
                rate_ax.plot(
                    t,
                    [r / 1e6 for r in rate],
                    color=colour,
                    linewidth=0.7,
                    alpha=0.75,
                    label=f"{names.get(protocol, protocol)} flows ({len(fs)})" if j == 0 else None,
                    gid=mark_gid(protocol),
                )
            marks[slug(protocol)] = len(fs)
        for i, (label, (t, rate)) in enumerate(totals.items()):
            if not len(t):
                continue
            series = f"total {label}"
            total_ax.plot(
                t,
                [r / 1e6 for r in rate],
                color=COLOURS.get(label, PALETTE[i % len(PALETTE)]),
                linewidth=1.0,
                label=f"{names.get(label, label)}: all flows",
                gid=mark_gid(series),
            )
            marks[slug(series)] = 1
        total_ax.axhline(
            capacity_bps / 1e6,
            color=COLOURS["paper"],
            linestyle="--",
            linewidth=0.8,
            label=f"capacity {capacity_bps / 1e6:g} Mbit/s",
        )
        if len(kickass_mode[0]):
            mode_ax.plot(
                kickass_mode[0],
                kickass_mode[1],
                color=COLOURS["kickass"],
                linewidth=1.0,
                gid=mark_gid("kickass-mode"),
            )
            marks["kickass-mode"] = 1
        for k, ax in enumerate((rate_ax, total_ax, mode_ax)):
            for n, (a, b) in enumerate(shading.intervals):
                ax.axvspan(
                    a,
                    b,
                    color="#999999",
                    alpha=0.25,
                    linewidth=0,
                    label=shading.label if k == 0 and n == 0 else None,
                    gid=mark_gid(shading.series) if k == 0 else None,
                )
            for a, b in epochs:
                for x in (a, b):
                    ax.axvline(x, color="#555555", linestyle=":", linewidth=0.8)
        if shading.intervals:
            marks[slug(shading.series)] = len(shading.intervals)
        rate_ax.set_ylabel("rate per flow (Mbit/s)", fontsize=8)
        rate_ax.set_ylim(bottom=0)
        total_ax.set_ylabel("total (Mbit/s)", fontsize=8)
        total_ax.set_ylim(bottom=0)
        mode_ax.set_ylabel("Kick-Ass flows in\nKick-Ass mode", fontsize=8)
        mode_ax.set_ylim(-0.05, 1.05)
        mode_ax.set_xlabel("time since the flows started (s); dotted: TCP flows on and off")
        rate_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        total_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        fig.suptitle(title)
        return _svg(fig, name, title, marks)


# -- schedule health ------------------------------------------------------------------------


def stacked_counts(
    name: str,
    title: str,
    counts: Mapping[str, Mapping[str, int]],
    *,
    colours: Mapping[str, str] = OUTCOME_COLOURS,
    xlabel: str = "runs",
) -> Figure | None:
    """Horizontal stacked bars: per row (an item, a campaign) the count of each
    category (an outcome, a status); one tagged bar per non-zero count."""
    rows = [(k, v) for k, v in counts.items() if any(v.values())]
    if not rows:
        return None
    cats: list[str] = []
    for _, v in rows:
        cats += [c for c in v if c not in cats]
    marks: dict[str, int] = {}
    with _figure(height=max(1.8, 0.6 + 0.3 * len(rows))) as (fig, axes):
        ax = axes[0][0]
        for i, (_, v) in enumerate(rows):
            left = 0
            for j, cat in enumerate(cats):
                n = int(v.get(cat, 0))
                if n <= 0:
                    continue
                ax.barh(
                    i,
                    n,
                    left=left,
                    height=0.6,
                    color=colours.get(cat, PALETTE[j % len(PALETTE)]),
                    gid=mark_gid(cat),
                    label=cat if slug(cat) not in marks else None,
                )
                ax.text(
                    left + n / 2, i, str(n), ha="center", va="center", fontsize=7, color="white"
                )
                marks[slug(cat)] = marks.get(slug(cat), 0) + 1
                left += n
        ax.set_yticks(range(len(rows)), [k for k, _ in rows])
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
        return _svg(fig, name, title, marks)


def seconds_since(times: Sequence[datetime]) -> list[float]:
    if not times:
        return []
    t0 = times[0]
    return [(t - t0).total_seconds() for t in times]
