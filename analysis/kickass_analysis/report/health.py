"""The report's schedule health section: scheduled item runs by outcome, the
failed and timed-out ones with their reasons (``v_item_runs``), and the RIPE
Atlas measurements by status (``v_atlas_measurements``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import figures
from .markup import Section, _f, _table, _when
from .readers import ReportData


@dataclass(frozen=True)
class Health:
    runs: dict[str, dict[str, int]]  # "item (kind)" -> outcome -> runs
    failures: list[dict[str, Any]]  # v_item_runs' failed and timed-out runs, the latest first
    atlas_status: dict[str, dict[str, int]]  # campaign -> status -> measurements
    measurements: list[dict[str, Any]]  # v_atlas_measurements' rows
    outcomes: dict[str, int]  # outcome -> runs, over every item

    def summary(self) -> dict[str, Any]:
        return {"item_runs": self.outcomes, "atlas_measurements": len(self.measurements)}


def build(data: ReportData) -> Health:
    runs: dict[str, dict[str, int]] = {}
    outcomes: dict[str, int] = {}
    for r in data.item_outcomes:
        runs.setdefault(f"{r['item']} ({r['kind']})", {})[r["outcome"]] = int(r["runs"])
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + int(r["runs"])
    status: dict[str, dict[str, int]] = {}
    for r in data.atlas_measurements:
        row = status.setdefault(r["campaign"], {})
        key = r["status_name"] or "unknown"
        row[key] = row.get(key, 0) + 1
    return Health(runs, data.item_failures, status, data.atlas_measurements, outcomes)


def _runs_html(m: Health, sec: Section) -> None:
    what = "Scheduled runs by outcome"
    fig = figures.stacked_counts("item-runs", what, m.runs)
    sec.add_figure(fig, what, f"{what}, per item of the schedule (v_item_runs).")
    if m.failures:
        sec.body.append("<h3>Failed and timed-out runs</h3>")
        sec.body.append(
            _table(
                ["item", "kind", "due", "host", "attempt", "outcome", "reason", "duration"],
                [
                    [
                        r["item"],
                        r["kind"],
                        _when(r["due_at"]),
                        r["host"],
                        r["attempt"],
                        r["outcome"],
                        r["reason"] or "(no reason given)",
                        _f(r["duration_s"], "{:.0f} s"),
                    ]
                    for r in m.failures
                ],
                "failures",
            )
        )
    elif m.runs:
        sec.body.append("<p>No run failed or timed out.</p>")


def _atlas_html(m: Health, sec: Section) -> None:
    what = "RIPE Atlas measurements by status"
    fig = figures.stacked_counts(
        "atlas-status", what, m.atlas_status, colours={}, xlabel="measurements"
    )
    sec.add_figure(fig, what, f"{what}, per campaign (v_atlas_measurements).")
    if fig is not None:
        sec.body.append(
            _table(
                [
                    "campaign",
                    "msm_id",
                    "phase",
                    "IP length",
                    "status",
                    "results",
                    "credits",
                    "last fetch",
                    "last error",
                ],
                [
                    [
                        r["campaign"],
                        r["msm_id"],
                        r["phase"],
                        r["ip_len"],
                        r["status_name"] or "-",
                        r["results_fetched"],
                        r["credits_spent"],
                        _when(r["last_fetch_at"]),
                        r["last_error"] or "",
                    ]
                    for r in m.measurements
                ],
            )
        )


def to_html(m: Health) -> Section:
    sec = Section("health", "Schedule health")
    _runs_html(m, sec)
    _atlas_html(m, sec)
    return sec


def section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    m = build(data)
    return to_html(m), m.summary()
