"""The report's study section: drop rate against packet size and against
the split by source, and the fragment-intolerant clients overall, by country
and by network, the paper's 8.3% of 405 beside them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kickass_core import sources

from .. import figures, stats
from .markup import Section, _f, _interval, _table
from .readers import ReportData


def source_title(name: str) -> str:
    """How the report names a study source (its registered title; else its name)."""
    found = sources.find(name)
    return found.title if found else name


def _source_order(name: str) -> tuple[int, str]:
    """Registered sources in their order; a stored name of an unknown one after them."""
    found = sources.find(name)
    return (found.order, found.name) if found else (1_000, name)


# The two drop-rate figures: phase, the summary's key, what each shows.
DROP_FIGURES = (
    ("whole", "size", "Drop rate against packet size (whole packets)"),
    ("split", "split", "Drop rate against the split (1500-byte datagrams in two fragments)"),
)


@dataclass(frozen=True)
class SourceDrop:
    """One source's drop rates in one phase, pooled over its sizes."""

    source: str
    sizes: int
    sessions: int  # the most at one size
    sent: int
    pooled: stats.Rate
    worst: stats.SizeRate


@dataclass(frozen=True)
class Study:
    rates: dict[str, dict[str, list[stats.SizeRate]]]  # phase -> source -> per size
    drops: dict[str, list[SourceDrop]]  # phase -> per source
    intolerant: dict[str, stats.GroupShare]  # source -> its clients overall
    by_country: dict[str, list[stats.GroupShare]]  # source -> per country
    by_asn: dict[str, list[stats.GroupShare]]  # source -> per network
    paper_intolerant: int  # the paper's 8.3% of 405: 34 clients
    paper_share: stats.Rate  # 34 of 405, with its interval

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for phase, key, _ in DROP_FIGURES:
            for d in self.drops[phase]:
                out[f"{key}_{d.source}"] = {"sizes": d.sizes, "pooled": d.pooled.to_json()}
        for src, total in self.intolerant.items():
            out[f"intolerant_{src}"] = total.to_json()
        return out


def _pooled(source: str, pts: list[stats.SizeRate]) -> SourceDrop:
    sent = sum(p.rate.sent for p in pts)
    lost = sum(p.rate.lost for p in pts)
    return SourceDrop(
        source,
        len(pts),
        max(p.sessions for p in pts),
        sent,
        stats.drop(sent, sent - lost),
        max(pts, key=lambda p: p.rate.rate),
    )


def build(data: ReportData) -> Study:
    rates = {"whole": data.size, "split": data.split}
    drops = {phase: [_pooled(src, pts) for src, pts in by.items()] for phase, by in rates.items()}
    intolerant: dict[str, stats.GroupShare] = {}
    by_country: dict[str, list[stats.GroupShare]] = {}
    by_asn: dict[str, list[stats.GroupShare]] = {}
    for src, vs in data.verdicts.items():
        label = source_title(src)
        intolerant[src] = stats.intolerant_share([v for _, _, v in vs], label)
        by_country[src] = stats.intolerant_by_group((c, v) for c, _, v in vs)
        by_asn[src] = stats.intolerant_by_group((a, v) for _, a, v in vs)
    paper = stats.PAPER
    paper_k = round(paper["intolerant_share"] * paper["clients"])
    paper_share = stats.share(paper_k, int(paper["clients"]))
    return Study(rates, drops, intolerant, by_country, by_asn, paper_k, paper_share)


def _drops_html(m: Study, sec: Section) -> None:
    names = sorted({src for by in m.rates.values() for src in by}, key=_source_order)
    lines = [
        figures.DropLine(
            source_title(src),
            {phase: by[src] for phase, by in m.rates.items() if src in by},
            figures.source_colour(src),
        )
        for src in names
    ]
    drawn = figures.drop_by_phase("drop", {ph: what for ph, _, what in DROP_FIGURES}, lines)
    for phase, _, what in DROP_FIGURES:
        fig = drawn[phase]
        sec.add_figure(
            fig,
            what,
            f"{what}: pooled over every session (volunteers) and probe (Atlas); "
            "bars are 95% Wilson intervals.",
        )
        rows = [
            [
                source_title(d.source),
                d.sizes,
                d.sessions,
                f"{d.sent:,}",
                _interval(d.pooled),
                f"{d.worst.size} B: {_f(d.worst.rate.rate)}",
            ]
            for d in m.drops[phase]
        ]
        if rows:
            sec.body.append(
                _table(
                    ["source", "sizes", "sessions", "probes sent", "drop (95% CI)", "worst size"],
                    rows,
                )
            )


def _intolerant_html(m: Study, sec: Section) -> None:
    paper = stats.PAPER
    if m.intolerant:
        sec.empty = False
        rows = [
            [g.group, g.clients, g.intolerant, g.inconclusive, _interval(g.share)]
            for g in m.intolerant.values()
        ]
        # The paper states 8.3% of 405 (34 clients); the interval is 34 of 405's.
        low, high = _f(m.paper_share.low), _f(m.paper_share.high)
        stated = f"{_f(paper['intolerant_share'])} ({low}-{high})"
        rows.append(
            ["the paper (Kick-Ass, §IV-C)", paper["clients"], m.paper_intolerant, "-", stated]
        )
        sec.body.append("<h3>Fragment-intolerant clients</h3>")
        sec.body.append(
            _table(
                ["clients", "conclusive", "fragment-intolerant", "inconclusive", "share (95% CI)"],
                rows,
                "shares",
            )
        )
    for groups, name, what in (
        (m.by_country, "intolerant-by-country", "Fragment-intolerant clients by country"),
        (m.by_asn, "intolerant-by-asn", "Fragment-intolerant clients by network (ASN)"),
    ):
        fig = figures.shares(name, what, groups)
        sec.add_figure(
            fig,
            what,
            f"{what}: share among clients with a conclusive verdict, 95% "
            f"Wilson interval; the dashed line is the paper's "
            f"{paper['intolerant_share']:.1%} of {paper['clients']} clients.",
            fills=False,
        )


def to_html(m: Study) -> Section:
    sec = Section("study", "The fragment viability study")
    _drops_html(m, sec)
    _intolerant_html(m, sec)
    return sec


def section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    m = build(data)
    return to_html(m), m.summary()
