"""The report's page: its sections (``SECTIONS``, in the order shown), the
page around them, and ``write_report``, which reads, renders and replaces
the file atomically."""

from __future__ import annotations

import html
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .. import __version__, experiments_section
from ..networks import NetworkTable
from . import health, router, study, trials
from .markup import NO_DATA, Section, _when
from .readers import Filters, ReportData, ReportStore

# Each section's builder, in the order the page shows them (READERS reads for them).
SECTIONS = (
    study.section,
    trials.section,
    router.section,
    experiments_section.section,
    health.section,
)


CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:62rem;
padding:1rem 1.5rem;color:#222;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{border-bottom:1px solid #ccc;margin-top:2.2rem}
h3{margin-bottom:.3rem}.meta{color:#555;font-size:.9rem}
figure{margin:1rem 0}figure svg{width:100%;height:auto}
figcaption{font-size:.85rem;color:#444}
table{border-collapse:collapse;font-size:.85rem;margin:.6rem 0}
th,td{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
th{background:#f3f3f3}.nodata{color:#777;font-style:italic}
nav a{margin-right:1rem}
"""


@dataclass(frozen=True)
class ReportResult:
    path: Path
    bytes: int
    sections: dict[str, bool]  # section -> has data
    figures: dict[str, dict[str, int]]  # figure -> series -> marks
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "bytes": self.bytes,
            "sections": self.sections,
            "figures": self.figures,
            "summary": self.summary,
        }


def render(
    data: ReportData,
) -> tuple[str, dict[str, bool], dict[str, dict[str, int]], dict[str, Any]]:
    """The report's HTML, which sections have data, the figures' marks, the headline numbers."""
    sections: list[Section] = []
    summary: dict[str, Any] = {}
    for build in SECTIONS:
        sec, numbers = build(data)
        sections.append(sec)
        summary.update(numbers)
    e = html.escape
    f = data.filters
    scope = []
    if f.campaign:
        scope.append(
            f"Atlas campaign {e(f.campaign)} (volunteers, trials, router and "
            "scheduled runs have no campaign: shown whole)"
        )
    if f.since:
        scope.append(f"since {e(_when(f.since))}")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # Nothing to fetch, not even the favicon: the file stands alone.
        '<link rel="icon" href="data:,">',
        "<title>Kick-Ass measurement report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Kick-Ass measurement report</h1>",
        f'<p class="meta">Generated {e(_when(data.generated_at))} from {e(data.database)} by '
        f"kickass-analysis {e(__version__)}; "
        + (e("; ".join(scope)) if scope else "everything measured")
        + ". Every number from kickass_analysis.stats; the paper's numbers beside ours.</p>",
        "<nav>" + "".join(f'<a href="#{s.key}">{e(s.title)}</a>' for s in sections) + "</nav>",
    ]
    for s in sections:
        out.append(f'<section id="{s.key}" data-empty="{str(s.empty).lower()}">')
        out.append(f"<h2>{e(s.title)}</h2>")
        if s.empty:
            out.append(f'<p class="nodata">{e(s.title)}: {NO_DATA}.</p>')
        else:
            out.extend(s.body)
        out.append("</section>")
    out.append("</body></html>")
    marks = {fig.name: fig.marks for s in sections for fig in s.figures}
    return "\n".join(out) + "\n", {s.key: not s.empty for s in sections}, marks, summary


def write_report(
    database_url: str | None,
    path: str | Path,
    campaign: str | None = None,
    since: datetime | None = None,
    *,
    network_table: str | Path | None = None,
) -> ReportResult:
    """Write the report of the database at ``database_url`` (None: the
    configured one) to ``path`` (replaced atomically) and say what it holds."""
    networks = NetworkTable.load(network_table) if network_table else None
    with ReportStore(database_url) as store:
        data = store.read(Filters(campaign, since), networks)
    page, sections, marks, summary = render(data)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    raw = page.encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ReportResult(target.resolve(), len(raw), sections, marks, summary)
