"""What each kind of scheduled item does when its run is claimed.

Each kind is a function ``(item, context) -> Result`` (a study source's
kind: the source's ``item_runner``, ``kickass_core.sources``) that calls the room
that owns the work (``kickass_atlas.service``, ``kickass_wan.trials.service``,
``kickass_analysis``, ``kickass_db``) and says what it did in counts. The
rooms are imported when an item of theirs runs, so a trial runner host (core,
wan-agents and this package only) never imports the database.

Each run happens in a child process of ``kickass schedule run`` (see
``runner``), which heartbeats the claim and ends the child at the item's
timeout.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kickass_core import sources
from kickass_core.errors import KickassError

from .schedule_file import Item, database_kinds

OK = "ok"
FAILED = "failed"
SKIPPED = "skipped"
TIMEOUT = "timeout"
OUTCOMES = (OK, FAILED, SKIPPED, TIMEOUT)

# A session still live with nothing written for this long has lost its server
# (the study's own time limits end a session long before).
LINGERING_S = 3600.0


@dataclass
class Result:
    outcome: str
    reason: str | None = None
    counts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    """What a run knows besides its item."""

    base_dir: Path
    database_url: str | None
    host: str
    due_at: datetime
    run_id: int
    attempt: int
    # The dead attempt this run took over, if any (what it was, and why dead).
    took_over: dict[str, Any] | None
    stop: threading.Event
    progress: Callable[[str, dict[str, Any]], None]
    # Kept across the retries of one run (``execute``): what it found first.
    memo: dict[str, Any] = field(default_factory=dict)

    def path(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base_dir / p


def round_seed(item: str, due_at: datetime) -> int:
    """The seed of a scheduled round: drawn from the item and its due time, so
    the same round is the same on every host and a takeover replays it."""
    digest = hashlib.sha256(f"{item}|{due_at.isoformat()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# -- atlas ------------------------------------------------------------------------------


def run_atlas(item: Item, ctx: Context) -> Result:
    from kickass_atlas import service
    from kickass_atlas.campaign import Campaign

    assert item.campaign is not None
    campaign = Campaign.load(ctx.path(item.campaign))
    settings = service.AtlasSettings.resolve(database_url=ctx.database_url)
    counts: dict[str, Any] = {"campaign": campaign.name}
    warnings: list[str] = []

    def warn(exc: KickassError) -> None:
        warnings.append(exc.message)
        ctx.progress("warning", {"message": exc.message})

    held = _atlas_credits(settings, campaign)
    # What the run adds is counted from its first attempt: a retry after a
    # database outage fetches on from what the failed attempt committed.
    before = ctx.memo.setdefault("atlas_before", held)
    if held is None or held["missing"]:
        # Never twice: create() makes only what the database does not hold,
        # and first adopts what an earlier (killed) run created unanswered.
        created = service.create(settings, campaign, warn=warn)
        counts["created"] = created.created
        ctx.progress("created", {"measurements": created.created})
    report = service.fetch(
        settings,
        campaign,
        progress=lambda msg: ctx.progress("fetch", {"message": msg}),
    )
    after = _atlas_credits(settings, campaign)
    counts.update(
        measurements=report.measurements,
        results_new=report.results_new,
        results_late=report.results_late,
        results_seen=report.results_seen,
        join=dict(report.join),
        results_stored=(after or {}).get("results", 0) - (before or {}).get("results", 0),
        credits_spent=(after or {}).get("spent", 0),
        credits_delta=(after or {}).get("spent", 0) - (before or {}).get("spent", 0),
    )
    warnings += [w.message for w in report.warnings]
    if warnings:
        counts["warnings"] = warnings[:20]
    if after and after["settled"] and report.results_new == 0 and report.results_late == 0:
        why = "settled: every measurement has stopped and its results are in"
        if item.archive is not None:
            # The settled campaign's outcomes as a Parquet snapshot (kept as
            # it is while the database holds the same; never dropped).
            from kickass_analysis import archive

            snap = archive.write_campaign(
                ctx.database_url, ctx.path(item.archive), campaign.name,
                tag=partial_tag(ctx.run_id, ctx.attempt),
            )  # fmt: skip
            counts["archive"] = {
                "rows": snap.rows, "bytes": snap.bytes, "written": snap.wrote,
                "manifest_sha256": snap.manifest_sha256,
            }  # fmt: skip
            why += "; its outcomes archived" if snap.wrote else "; its outcomes' archive is current"
        return Result(SKIPPED, why, counts)
    return Result(OK, None, counts)


def _atlas_credits(settings: Any, campaign: Any) -> dict[str, Any] | None:
    """What the database holds of the campaign: measurements missing from its
    plan, results stored and credits spent so far, and whether all have
    stopped long enough ago."""
    from kickass_atlas.ingest import DEFAULT_LATE_HORIZON_S

    with settings.store() as store:
        campaign_id = store.campaign_id(campaign.name)
        if campaign_id is None:
            return None
        rows = store.measurements(campaign_id)
        st = store.status(campaign.name)
    have = {r["key"] for r in rows}
    missing = [m.key for m in campaign.plan().measurements if m.key not in have]
    now = datetime.now(UTC)
    horizon = timedelta(seconds=DEFAULT_LATE_HORIZON_S)
    settled = bool(rows) and all(
        r.get("stop_time") is not None and r["stop_time"] + horizon < now for r in rows
    )
    spent = sum(m.get("credits_spent") or 0 for m in st["measurements"])
    results = sum(m.get("results_fetched") or 0 for m in st["measurements"])
    return {"missing": missing, "results": int(results), "spent": int(spent), "settled": settled}


# -- trials -----------------------------------------------------------------------------


def run_trials(item: Item, ctx: Context) -> Result:
    from kickass_wan.trials.service import RoundSettings, run_round

    assert item.trials is not None
    data = dict(item.trials)
    # Paths in the schedule file are read from its folder.
    for key in ("spool_dir", "runner_token_file"):
        if isinstance(data.get(key), str):
            data[key] = str(ctx.path(data[key]))
    if isinstance(data.get("agents"), list):
        data["agents"] = [
            {**a, "secret_file": str(ctx.path(a["secret_file"]))}
            if isinstance(a, dict) and isinstance(a.get("secret_file"), str)
            else a
            for a in data["agents"]
        ]
    seed = round_seed(item.name, ctx.due_at)
    rng = random.Random(seed)
    agents = list(data.get("agents") or [])
    rng.shuffle(agents)  # the order the agents take turns in, per round
    data["agents"] = agents
    workload = dict(data.get("workload") or {})
    workload["seed"] = seed  # the periods' order and the flows, per round
    data["workload"] = workload
    settings = RoundSettings.from_mapping(data, where=f"item {item.name!r}: trials")
    scheduled = {
        "item": item.name,
        "due_at": ctx.due_at.isoformat(),
        "run_id": ctx.run_id,
        "attempt": ctx.attempt,
        "seed": seed,
        "agent_order": [a.name for a in settings.agents],
    }
    ctx.progress("round", {"seed": seed, "agent_order": scheduled["agent_order"]})
    out = run_round(
        settings,
        stop=ctx.stop,
        scheduled=scheduled,
        progress=lambda p: ctx.progress(
            "period", {"index": p.index, "destination": p.destination, "arm": p.arm}
        ),
    )
    completed = {
        dest: {arm: len(fcts) for arm, fcts in arms.items()}
        for dest, arms in (out.get("summary") or {}).items()
    }
    counts = {
        "trials": out.get("trials"),
        "agent_order": scheduled["agent_order"],
        "seed": seed,
        "flows_completed": completed,
        "flows_failed": out.get("failed_flows", 0),
        "skipped_periods": len(out.get("skipped_periods") or []),
        "late_periods": len(out.get("late_periods") or []),
        "upload_backlog": out.get("spooled", 0),
        "rejected": out.get("rejected", 0),
    }
    if ctx.stop.is_set():
        return Result(FAILED, "stopped before the round ended (results so far spooled)", counts)
    if out.get("spooled"):
        errors = out.get("upload_errors") or []
        return Result(
            OK,
            f"{out['spooled']} records still spooled for the next upload"
            + (f" ({errors[-1]})" if errors else ""),
            counts,
        )
    return Result(OK, None, counts)


# -- refresh ----------------------------------------------------------------------------


def run_refresh(item: Item, ctx: Context) -> Result:
    from kickass_analysis import rollups
    from kickass_db.schedule_store import ScheduleStore

    t0 = time.monotonic()
    # One refresh at a time, whatever the number of refresh items or hosts:
    # two at once fail on each other's rows (serialization errors), and the
    # one running serves this due time too.
    with ScheduleStore(ctx.database_url) as store, store.exclusive("refresh") as mine:
        if not mine:
            return Result(SKIPPED, "another refresh is running; it serves this due time too")
        counts: dict[str, Any] = dict(rollups.refresh(ctx.database_url))
    counts["seconds"] = round(time.monotonic() - t0, 3)
    return Result(OK, None, counts)


# -- export -----------------------------------------------------------------------------


def run_export(item: Item, ctx: Context) -> Result:
    """Each view's rows from where its last published window ended to this due
    time, in a file named by that window (``export.window_name``), published
    once (``kickass_analysis.publish``): an attempt that takes over a dead one
    finds the windows the dead one published and does not export them again,
    and first removes the dead attempts' partial files (counted:
    ``swept_partials``). Each window is noted in the run's row as soon as it is
    published, so a run that dies half-way and is never taken over (reaped)
    still tells the next run where each of its views goes on from."""
    from kickass_analysis import publish
    from kickass_analysis.export import export_view, views, window_name
    from kickass_db.schedule_store import ScheduleStore

    assert item.directory is not None and item.views is not None
    directory = ctx.path(item.directory)
    directory.mkdir(parents=True, exist_ok=True)
    until = ctx.due_at
    tag = partial_tag(ctx.run_id, ctx.attempt)
    with ScheduleStore(ctx.database_url) as store:
        swept = publish.sweep(directory, _dead_attempts(directory, ctx, store))
        if swept.files:
            ctx.progress("swept", swept.to_json())
        # What arrived since the last export: from its upper bound to this due time.
        since, published = store.export_since(item.name, ctx.due_at)
        counts: dict[str, Any] = {
            "since": since.isoformat() if since else None,
            "until": until.isoformat(),
            "rows": {},
            "files": [],
            "windows": {},
            "published": {},
            "swept_partials": swept.to_json(),
        }
        whole, already = [], []
        known = views()
        for view in item.views:
            if ctx.stop.is_set():
                return Result(FAILED, "stopped", counts)
            spec = known.get(view)
            dated = spec is not None and (spec.time is not None or spec.session_time)
            if dated:
                lo = max((t for t in (since, published.get(view)) if t is not None), default=None)
                name = window_name(view, item.format, lo, until)
                window = {"since": lo, "until": until}
            else:
                # A view that pools all time is exported whole each time, named
                # by the due time it stands for.
                lo = None
                name = window_name(view, item.format, at=until)
                window = {}
                whole.append(view)
            res = export_view(
                ctx.database_url, view, item.format, directory,
                since=lo, until=until if dated else None, name=name, tag=tag,
            )  # fmt: skip
            if dated:
                store.mark_published(ctx.run_id, ctx.attempt, view, until)
                counts["windows"][view] = {k: v.isoformat() if v else None
                                           for k, v in window.items()}  # fmt: skip
                counts["published"][view] = until.isoformat()
            if res.already_published:
                already.append(view)
            counts["rows"][view] = res.rows
            counts["files"] += [str(res.data_path), str(res.schema_path)]
            ctx.progress("exported", {"view": view, "rows": res.rows,
                                      "already_published": res.already_published})  # fmt: skip
    if whole:
        counts["whole_views"] = whole
    if already:
        counts["already_published"] = already
    return Result(OK, None, counts)


def partial_tag(run_id: int, attempt: int) -> str:
    """The tag of a scheduled export's partial files: its run and attempt."""
    return f"r{run_id}a{attempt}"


_PARTIAL_TAG = re.compile(r"r(\d{1,19})a(\d{1,9})")


def _dead_attempts(directory: Path, ctx: Context, store: Any) -> Callable[[str], bool]:
    """Which partial files' tags belong to attempts that will never finish
    them: this run's earlier attempts (this one took over), and any other
    run's attempt that is no longer the one running (over, or taken over).
    Tags of other writers (``kickass export`` by hand: a process id) and of
    files that appear after this look are left alone."""
    from kickass_analysis import publish

    seen: dict[str, tuple[int, int]] = {}
    for path in directory.iterdir():
        found = publish.partial_of(path)
        m = _PARTIAL_TAG.fullmatch(found[1]) if found else None
        if found and m:
            seen[found[1]] = (int(m[1]), int(m[2]))
    others = sorted({run for run, _ in seen.values()} - {ctx.run_id})
    running: dict[int, int] = store.running_attempts(others)
    running[ctx.run_id] = ctx.attempt

    def dead(tag: str) -> bool:
        if tag not in seen:
            return False
        run, attempt = seen[tag]
        return running.get(run) != attempt

    return dead


# -- housekeeping -----------------------------------------------------------------------


def run_housekeeping(item: Item, ctx: Context) -> Result:
    from kickass_db.journal import pending
    from kickass_db.partitions import Partitions
    from kickass_db.study_store import StudyStore

    with StudyStore(ctx.database_url) as store:
        lingering = store.lingering_sessions(LINGERING_S)
    # The raw tables' day partitions, ahead (migration 0022): a write for a
    # day without one is refused.
    with Partitions(ctx.database_url) as days:
        made = days.ensure_ahead(item.partitions_ahead)
        ahead = days.status()
    journals = {d: pending(ctx.path(d)) for d in (item.journals or [])}
    counts: dict[str, Any] = {
        "partitions": {
            table: {
                "made": [d.isoformat() for d in made[table]],
                "days_ahead": ahead[table]["days_ahead"],
            }
            for table in made
        },
        "lingering_sessions": {
            r["server_instance"]: {
                "sessions": int(r["sessions"]),
                "oldest_update": r["oldest_update"].isoformat(),
            }
            for r in lingering
        },
        "journals": journals,
    }
    findings = []
    n = sum(int(r["sessions"]) for r in lingering)
    if n:
        findings.append(
            f"{n} sessions live with nothing written for {LINGERING_S / 3600:g} h "
            f"(instances: {', '.join(r['server_instance'] for r in lingering)}; "
            "each server closes its own at its next start)"
        )
    waiting = sum(j["unreplayed_records"] for j in journals.values())
    if waiting:
        findings.append(f"{waiting} journaled records wait for their server's next start")
    refused = sum(j["failed_records"] for j in journals.values())
    if refused:
        findings.append(f"{refused} records the database refused are set aside (failed-*)")
    if item.archive is None:
        return Result(OK, "; ".join(findings) or None, counts)
    # The raw days past keeping: archived, verified, detached, dropped; a
    # killed run's unfinished days finished (kickass_analysis.archive).
    from kickass_analysis import archive

    retired = archive.retire(
        ctx.database_url,
        ctx.path(item.archive),
        item.keep_raw_days,
        tag=partial_tag(ctx.run_id, ctx.attempt),
        progress=lambda step, data: ctx.progress("archive", {"step": step, **data}),
        stop=ctx.stop.is_set,
    )
    counts["archive"] = retired.counts()
    for d in retired.blocked:
        findings.append(f"{d.table} {d.day} kept: " + "; ".join(d.reasons[:3]))
    if retired.failed:
        failed = [f"{d.table} {d.day}: " + "; ".join(d.reasons) for d in retired.failed]
        return Result(FAILED, "; ".join(findings + failed), counts)
    return Result(OK, "; ".join(findings) or None, counts)


def check(item: Item, base_dir: Path) -> str | None:
    """What ``schedule check`` can tell of an item's own settings on this host
    (the room that runs it validates them; None: fine). Reads no secret."""
    unknown = item.unknown_kind()
    if unknown is not None:
        return "not run here: " + unknown
    try:
        if item.kind == "trials" and item.trials is not None:
            from kickass_wan.trials.service import RoundSettings

            RoundSettings.from_mapping(item.trials, where="trials")
        elif item.kind == "atlas" and item.campaign is not None:
            from kickass_atlas.campaign import Campaign

            Campaign.load(Path(item.campaign) if Path(item.campaign).is_absolute()
                          else base_dir / item.campaign).plan()  # fmt: skip
    except ImportError as exc:
        return f"not checked here ({exc.name} is not installed on this host)"
    except KickassError as exc:
        return "ERROR " + exc.message
    return None


# The built-in kinds; a study source's kind runs its source's ``item_runner``.
KIND_FUNCTIONS: dict[str, Callable[[Item, Context], Result]] = {
    "trials": run_trials,
    "refresh": run_refresh,
    "export": run_export,
    "housekeeping": run_housekeeping,
}


def kind_function(kind: str) -> Callable[[Item, Context], Result]:
    """What runs an item of ``kind``; a kind no package here brings is a KickassError."""
    if kind in KIND_FUNCTIONS:
        return KIND_FUNCTIONS[kind]
    source = sources.by_kind(kind)
    if source is None:
        raise KickassError(
            f"no kind {kind!r} on this host",
            hint="a study source's kind is known where its package is installed",
        )
    return source.runner()


# The database down or full (a restart, too many clients) while an item of a
# database kind works: its work is safe to redo, so it is tried again after
# these pauses before the run is called failed.
DATABASE_RETRY_S = (2.0, 4.0, 8.0)


def execute(item: Item, ctx: Context) -> Result:
    """The item's work; a domain failure is a ``failed`` result with its message."""
    pauses = list(DATABASE_RETRY_S) if item.kind in database_kinds() else []
    while True:
        try:
            return kind_function(item.kind)(item, ctx)
        except KickassError as exc:
            unavailable = type(exc).__name__ == "DatabaseUnavailable"
            if unavailable and pauses and not ctx.stop.is_set():
                pause = pauses.pop(0)
                ctx.progress("retry", {"reason": exc.message, "in_s": pause})
                if not ctx.stop.wait(pause):
                    continue
            reason = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
            return Result(FAILED, reason)
