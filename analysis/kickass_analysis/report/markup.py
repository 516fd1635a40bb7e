"""The HTML every section of the report is made of: a ``Section`` (its
title, body fragments and figures), tables, figures with their captions
(or "no data yet"), and numbers as the report writes them."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .. import stats
from ..figures import Figure

NO_DATA = "no data yet"


@dataclass
class Section:
    key: str
    title: str
    body: list[str] = field(default_factory=list)  # HTML fragments
    figures: list[Figure] = field(default_factory=list)
    empty: bool = True

    def add_figure(
        self, fig: Figure | None, what: str, caption: str, *, fills: bool = True
    ) -> None:
        """The figure with its caption (or "no data yet" for ``what``) in the
        body; drawn, it is kept in ``figures`` and, with ``fills``, the
        section is no longer empty."""
        self.body.append(_figure(fig, what, caption))
        if fig is not None:
            self.figures.append(fig)
            if fills:
                self.empty = False


def _f(x: float | None, fmt: str = "{:.1%}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _interval(r: stats.Rate) -> str:
    if math.isnan(r.rate):
        return "-"  # nothing to take a share of
    return f"{_f(r.rate)} ({_f(r.low)}-{_f(r.high)})"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    e = html.escape
    out = [f'<table class="{e(cls)}"><thead><tr>']
    out += [f"<th>{e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(fig: Figure | None, what: str, caption: str) -> str:
    if fig is None:
        return f'<p class="nodata" data-figure="{html.escape(what)}">{what}: {NO_DATA}.</p>'
    return f"<figure>{fig.svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _capacity(bps: float | None) -> str:
    return f"{bps / 1e6:g} Mbit/s" if bps else "capacity unknown"


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
