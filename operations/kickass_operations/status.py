"""``kickass schedule status``: what ran, what failed and why, what is next,
and what is overdue, read from ``item_runs`` against the schedule file.

Overdue: an item whose latest due time started more than ``OVERDUE_AFTER_S``
ago with no run recorded for it, or with a run whose host stopped
heartbeating: the host that should run it (a trial runner host, say) went
silent, or nobody runs the schedule at all.

Refused claims: how often each host's claims were refused and why (an item
it may not run, a due time not due), the schedule's items by name and any
other name as ``(not in the schedule)``.

Partitions: the raw tables hold one partition per UTC day (migration 0022)
and a write for a day with none is refused; the ``housekeeping`` item makes
them ahead. Fewer than ``WARN_AHEAD`` days ahead of today is a warning: the
housekeeping item has not run for days (or fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .schedule_file import Schedule

# cron runs the schedule every minute: three missed minutes is not a hiccup.
OVERDUE_AFTER_S = 180.0
# Fewer days of partitions ahead than this is a warning (housekeeping makes 7).
WARN_AHEAD = 2


@dataclass
class ItemStatus:
    name: str
    kind: str
    cron: str
    host: str | list[str] | None
    enabled: bool
    due_at: datetime | None
    next_start: datetime
    last: dict[str, Any] | None
    overdue: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "cron": self.cron,
            "host": self.host,
            "enabled": self.enabled,
            "due_at": _iso(self.due_at),
            "next_start": _iso(self.next_start),
            "last": None if self.last is None else {k: _iso(v) for k, v in self.last.items()},
            "overdue": self.overdue,
        }


@dataclass
class Status:
    schedule: str
    now: datetime
    items: list[ItemStatus]
    failures: list[dict[str, Any]] = field(default_factory=list)
    atlas_credits_today: int = 0
    flows_per_agent_today: dict[str, int] = field(default_factory=dict)
    upload_backlog: dict[str, int] = field(default_factory=dict)
    runs_today: dict[str, int] = field(default_factory=dict)
    refused_claims: list[dict[str, Any]] = field(default_factory=list)
    # Per raw table: days after today that have a partition.
    partitions_ahead: dict[str, int] = field(default_factory=dict)

    @property
    def overdue(self) -> list[ItemStatus]:
        return [i for i in self.items if i.overdue]

    @property
    def warnings(self) -> list[str]:
        return [
            f"{table} has partitions for {n} day{'' if n == 1 else 's'} ahead of today, fewer "
            f"than {WARN_AHEAD}: a write for a day without one is refused (run the "
            "housekeeping item, or `kickass db partitions ahead`)"
            for table, n in sorted(self.partitions_ahead.items())
            if n < WARN_AHEAD
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "now": _iso(self.now),
            "items": [i.to_json() for i in self.items],
            "overdue": [i.name for i in self.overdue],
            "failures": [{k: _iso(v) for k, v in f.items()} for f in self.failures],
            "atlas_credits_today": self.atlas_credits_today,
            "flows_per_agent_today": self.flows_per_agent_today,
            "upload_backlog": self.upload_backlog,
            "runs_today": self.runs_today,
            "refused_claims": [{k: _iso(v) for k, v in r.items()} for r in self.refused_claims],
            "partitions_ahead": self.partitions_ahead,
            "warnings": self.warnings,
        }


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def collect(schedule: Schedule, store: Any, now: datetime | None = None) -> Status:
    """The schedule's state from ``store`` (a ``kickass_db.schedule_store.ScheduleStore``)."""
    now = now or datetime.now(UTC)
    names = [i.name for i in schedule.item]
    last = store.last_runs(names, per_item=1)
    stale = timedelta(seconds=schedule.schedule.stale_after_s)
    out: list[ItemStatus] = []
    for item in schedule.item:
        runs = last.get(item.name) or []
        newest = runs[0] if runs else None
        due = item.due_now(now)
        st = ItemStatus(
            name=item.name,
            kind=item.kind,
            cron=item.cron,
            host=item.host,
            enabled=item.enabled,
            due_at=due,
            next_start=item.next_start(now),
            last=None
            if newest is None
            else {
                k: newest[k]
                for k in (
                    "due_at",
                    "host",
                    "attempt",
                    "outcome",
                    "reason",
                    "claimed_at",
                    "heartbeat_at",
                    "finished_at",
                    "counts",
                )  # fmt: skip
            },
        )
        if item.enabled and due is not None:
            started = due + item.slip(due)
            late = (now - started).total_seconds() > OVERDUE_AFTER_S
            who = (
                f"host {' or '.join(item.owners)} has not claimed it"
                if item.owners
                else "no host has claimed it"
            )
            if newest is None or newest["due_at"] < due:
                if late:
                    st.overdue = (
                        f"due {due.isoformat()} and not started after "
                        f"{(now - started).total_seconds() / 60:.0f} min ({who})"
                    )
            elif newest["outcome"] == "running" and now - newest["heartbeat_at"] > stale:
                st.overdue = (
                    f"its run on {newest['host']} has not been heard of since "
                    f"{newest['heartbeat_at'].isoformat()}"
                )
        out.append(st)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    today = store.counts_since(names, midnight)
    credits = 0
    runs_today: dict[str, int] = {}
    for r in today:
        runs_today[r["outcome"]] = runs_today.get(r["outcome"], 0) + 1
        if r["kind"] == "atlas":
            credits += int((r["counts"] or {}).get("credits_delta") or 0)
    backlog = {
        name: int(((runs[0].get("counts") or {}).get("upload_backlog")) or 0)
        for name, runs in last.items()
        if runs and runs[0]["kind"] == "trials"
    }
    return Status(
        schedule=schedule.schedule.name,
        now=now,
        items=out,
        failures=store.failures(names, limit=20),
        atlas_credits_today=credits,
        flows_per_agent_today=store.flows_per_destination(midnight),
        upload_backlog=backlog,
        runs_today=runs_today,
        refused_claims=store.refusals(names),
        partitions_ahead=store.partitions_ahead(),
    )


def render(status: Status) -> str:
    """The human view (rich-free on purpose: it goes to cron mail and logs too)."""
    lines = [f"schedule {status.schedule} at {status.now:%Y-%m-%d %H:%M:%S} UTC"]
    w = max([len(i.name) for i in status.items] + [4])
    lines.append(f"{'item':<{w}}  {'kind':<12} {'last run':<26} {'outcome':<8} next start")
    for i in status.items:
        last = i.last or {}
        when = last.get("due_at")
        ran = f"{when:%Y-%m-%d %H:%M} #{last.get('attempt')}" if when else "-"
        lines.append(
            f"{i.name:<{w}}  {i.kind:<12} {ran:<26} "
            f"{last.get('outcome', '-'):<8} "
            f"{i.next_start:%Y-%m-%d %H:%M:%S}" + ("" if i.enabled else "  (disabled)")
        )
    if status.overdue:
        lines.append("")
        lines.append("OVERDUE:")
        lines += [f"  {i.name}: {i.overdue}" for i in status.overdue]
    if status.warnings:
        lines.append("")
        lines += [f"WARNING: {w}" for w in status.warnings]
    if status.failures:
        lines.append("")
        lines.append("recent failures:")
        for f in status.failures[:10]:
            lines.append(
                f"  {f['item']} due {f['due_at']:%Y-%m-%d %H:%M} on {f['host']} "
                f"({f['outcome']}): {f['reason']}"
            )
    if status.refused_claims:
        lines.append("")
        lines.append("refused claims (nothing stored):")
        for r in status.refused_claims[:10]:
            lines.append(
                f"  {r['host']} {r['item'] or '(not in the schedule)'} {r['reason']}: "
                f"{r['refusals']}x, last {r['last_at']:%Y-%m-%d %H:%M} ({r['last_message']})"
            )
    lines.append("")
    lines.append(
        f"today: runs {status.runs_today or {}}; Atlas credits spent {status.atlas_credits_today}"
    )
    if status.flows_per_agent_today:
        lines.append(
            "flows stored per agent today: "
            + ", ".join(f"{k} {v}" for k, v in status.flows_per_agent_today.items())
        )
    if any(status.upload_backlog.values()):
        lines.append(
            "upload backlog (records still spooled on runner hosts): "
            + ", ".join(f"{k} {v}" for k, v in status.upload_backlog.items() if v)
        )
    return "\n".join(lines)
