"""`kickass demo`: the fragment-viability study on a namespace internet.

Builds the study internet (internet.py, a topology spec), starts an
embedded PostgreSQL (unless KICKASS_DATABASE_URL is set), the measurement
server, and runs the probe client from every client namespace at once;
prints one results row per client and cleans everything up, also on Ctrl-C.

Every process it starts keeps its state in the demo's run directory (a
temporary directory: the server's journal, the clients' output, the
schedule and its log; act two's in the trial's own), never in the caller's
working directory, so demos started side by side from one directory share
nothing: the one thing written there is the report (``--report``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kickass_db as db
from kickass_core.errors import KickassError
from kickass_core.verdict import pool

from .internet import CLIENT_KINDS, ProbeInternet, probe_internet
from .netns import require_root
from .topology import cleanup_on_signals

if TYPE_CHECKING:
    from kickass_db.study_store import StudyStore
    from rich.table import Table

DEMO_PLAN = {"repetitions": 30, "step": 16, "window": 16}
EXPECTED = {
    "clean": "fragments-ok",
    "fragdrop": "fragment-intolerant",
    "lossy": "fragments-ok",
    "natted": "fragments-ok",
}


def plan_args(args: argparse.Namespace) -> list[str]:
    if args.quick:
        return ["--quick"]
    return [
        "--repetitions",
        str(args.repetitions),
        "--step",
        str(args.step),
        "--window",
        str(args.window),
    ]


@contextlib.contextmanager
def database(keep_dir: Path | None) -> Iterator[tuple[str, str]]:
    url = os.environ.get("KICKASS_DATABASE_URL")
    if url:
        yield url, "KICKASS_DATABASE_URL"
        return
    from .pg import embedded_postgres

    with embedded_postgres(keep_dir) as url:
        yield url, "embedded PostgreSQL" + (f" in {keep_dir}" if keep_dir else "")


def _progress(store: StudyStore, net: ProbeInternet) -> dict[str, tuple[int, int, str]]:
    """client kind -> (sent, total, state), in one query on the sessions table
    (its heartbeat counters), matched through the client's public address."""
    from sqlalchemy import text

    by_addr = {c.public_address: k for k, c in net.clients.items()}
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "select host(source_address), sent, (plan->>'total_probes')::int, state "
                "from sessions order by id"
            )
        ).all()
    return {by_addr[a]: (sent, total, state) for a, sent, total, state in rows if a in by_addr}


@dataclasses.dataclass
class ActOne:
    """What act one left: each client's JSON output, exit code and seconds."""

    results: dict[str, dict[str, Any]]
    codes: dict[str, int]
    took: dict[str, float]
    seconds: float


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    require_root()
    if not shutil.which("nft"):
        raise KickassError("nftables (`nft`) is missing", hint="apt-get install nftables")
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 110)
    # The results table is the demo's output: stdout, unless --json owns it.
    out_console = console if args.json else Console(width=None if sys.stdout.isatty() else 110)
    kinds = args.clients or list(CLIENT_KINDS)
    # Client outputs and server log; removed also when interrupted.
    with (
        cleanup_on_signals(),
        tempfile.TemporaryDirectory(prefix="kickass-demo-") as tmp,
        database(args.keep_db) as (url, where),
    ):
        out_dir = Path(tmp)
        console.print(f"[bold]database[/]: {where}")
        db.upgrade(url)
        from kickass_db.study_store import StudyStore

        store = StudyStore(url)
        with probe_internet(url, kinds=kinds, loss_percent=args.loss, log_dir=out_dir) as net:
            console.print(
                f"[bold]internet[/]: server {net.server_url}, clients: "
                + ", ".join(f"{k} ({c.address})" for k, c in net.clients.items())
            )
            console.print(f"[bold]plan[/]: {' '.join(plan_args(args))}")
            act_one = _first_act(args, kinds, store, net, out_dir, console)
        table, summary = _first_act_results(kinds, act_one, store)
        out_console.print(table)
        trial = None if args.no_trials else _second_act(args, url, console, out_console)
        scheduled = _third_act(url, out_dir, console, out_console)
        if args.json:
            print(
                json.dumps(
                    {
                        "version": 1,
                        "clients": summary,
                        "act_one_s": act_one.seconds,
                        "trial": trial,
                        "schedule": scheduled,
                    },  # fmt: skip
                    default=str,
                )
            )
        # The end: everything measured, as one HTML file (kickass report).
        from kickass_analysis.report import write_report

        report = write_report(url, args.report)
        print(f"report: {report.path}", file=sys.stderr if args.json else sys.stdout, flush=True)
    bad = [s for s in summary if s["verdict"] != s["expected"]]
    trial_bad = trial is not None and (trial["failed_flows"] or not trial["kickass_flows"])
    schedule_bad = scheduled["exit_code"] != 0 or scheduled.get("status_exit_code") != 0
    return 1 if bad or len(summary) != len(kinds) or trial_bad or schedule_bad else 0


def _first_act(
    args: argparse.Namespace,
    kinds: list[str],
    store: StudyStore,
    net: ProbeInternet,
    out_dir: Path,
    console: Any,
) -> ActOne:
    """Act one: the probe client from every client namespace at once, with
    their progress each second until all are done (or the demo's timeout)."""
    results: dict[str, dict[str, Any]] = {}
    codes: dict[str, int] = {}
    procs = {}
    outs = {}
    for kind in kinds:
        outs[kind] = open(out_dir / f"{kind}.json", "w+")  # noqa: SIM115
        procs[kind] = net.popen_client(
            kind,
            ["--json", *plan_args(args)],
            stdout=outs[kind],
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    t0 = time.monotonic()
    # Seconds each client ran: a slow act says which client it waited for.
    took: dict[str, float] = {}
    try:
        while any(p.poll() is None for p in procs.values()):
            time.sleep(1.0)
            for kind, p in procs.items():
                if kind not in took and p.poll() is not None:
                    took[kind] = round(time.monotonic() - t0, 1)
            rows = _progress(store, net)
            line = "  ".join(
                f"{k} {100 * s // max(t, 1)}%" + ("" if st == "probing" else f" {st}")
                for k, (s, t, st) in sorted(rows.items())
            )
            console.print(f"[dim]{time.monotonic() - t0:5.0f}s[/] {line}", highlight=False)
            if time.monotonic() - t0 > args.timeout:
                raise KickassError(f"the demo took longer than {args.timeout}s")
        act_one_s = round(time.monotonic() - t0, 1)
        for kind in procs:
            took.setdefault(kind, act_one_s)
        console.print(f"[bold]act one[/]: every client done in {act_one_s:.0f} s")
    finally:
        for kind, p in procs.items():
            if p.poll() is None:
                p.terminate()
            codes[kind] = p.wait(10)
            outs[kind].seek(0)
            text = outs[kind].read()
            outs[kind].close()
            with contextlib.suppress(json.JSONDecodeError):
                results[kind] = json.loads(text)
    return ActOne(results=results, codes=codes, took=took, seconds=act_one_s)


def _first_act_results(
    kinds: list[str], act_one: ActOne, store: StudyStore
) -> tuple[Table, list[dict[str, Any]]]:
    """Act one's results table (each client's verdict beside what the stored
    session says) and its rows for --json."""
    from rich.table import Table

    results, codes, took = act_one.results, act_one.codes, act_one.took
    table = Table(title="Fragment viability on the demo internet")
    for col in (
        "client",
        "verdict",
        "whole drop",
        "split drop",
        "split/whole",
        "splits as sent",
        "expected",
    ):
        table.add_column(col)
    summary = []
    for kind in kinds:
        r = results.get(kind)
        if not r:
            table.add_row(
                kind,
                f"[red]client failed (exit {codes.get(kind)})[/]",
                "",
                "",
                "",
                "",
                EXPECTED.get(kind, ""),
            )
            continue
        stored = store.session_results(r["session_id"]) or {}
        wd = pool(stored.get("whole", []))["drop_rate"]
        sd = pool(stored.get("split", []))["drop_rate"]
        ratio = f"{sd / wd:.2f}" if wd and sd is not None else "-"
        as_sent = sum(x.get("arrived_as_sent") or 0 for x in stored.get("split", []))
        acked = sum(x.get("acked") or 0 for x in stored.get("split", []))
        ok = r["verdict"] == EXPECTED.get(kind)
        table.add_row(
            kind,
            f"[{'green' if ok else 'red'}]{r['verdict']}[/]",
            _pct(wd),
            _pct(sd),
            ratio,
            f"{as_sent}/{acked}",
            EXPECTED.get(kind, ""),
        )
        summary.append(
            {
                "client": kind,
                "session_id": r["session_id"],
                "verdict": r["verdict"],
                "whole_drop_rate": wd,
                "split_drop_rate": sd,
                "expected": EXPECTED.get(kind),
                "state": r.get("state"),
                "end_reason": r.get("end_reason"),
                "exit_code": codes.get(kind),
                "seconds": took.get(kind),
            }
        )
    return table, summary


def _second_act(
    args: argparse.Namespace, url: str, console: Any, out_console: Any
) -> dict[str, Any]:
    """Act two: an interleaved Kick-Ass vs TCP trial through the emulated edge router."""
    from .trials import TrialSpec, render_speedups, render_summary, run_trial
    from .wan import TestbedConfig

    config = TestbedConfig(senders=1, receivers=1, capacity="10mbit", rtt_ms=100.0)
    spec = TrialSpec(pairs=1, period_s=args.trial_period, mean_gap_s=0.5, seed=1)
    console.print(
        f"[bold]trial[/]: sender -> ka-router (10 Mbit/s) -> ka-linkem (100 ms RTT) -> agent; "
        f"{spec.period_s:.0f} s of Kick-Ass flows and {spec.period_s:.0f} s of TCP (CUBIC) flows, "
        "the same flows in both, order drawn at random"
    )
    out = run_trial(url, config, spec)
    out_console.print(render_summary(out.summary, out.flows), highlight=False)
    out_console.print(
        "paired speedup (the same flow under each arm; geometric mean; its 95% interval "
        "is over period pairs, so one pair has none: scheduled rounds run several; "
        "completed: Kick-Ass / TCP):",
        highlight=False,
    )
    out_console.print(render_speedups(out.speedups), highlight=False)
    kickass = [f for f in out.flows if f["protocol"] == "kickass"]
    return {
        "failed_flows": out.result["failed_flows"],
        "kickass_flows": len(kickass),
        "tcp_flows": len(out.flows) - len(kickass),
        "summary": out.summary,
        "speedups": out.speedups,
    }


def _third_act(url: str, work: Path, console: Any, out_console: Any) -> dict[str, Any]:
    """Act three: scheduled work, unattended. The demo's schedule (the analysis
    rollups and the housekeeping report) runs as cron would run it, with
    `kickass schedule run`, then `kickass schedule status` says what it did."""
    due = datetime.now(UTC) - timedelta(minutes=1)
    cron = f"{due.minute} {due.hour} * * *"
    schedule = work / "schedule.toml"
    schedule.write_text(
        '[schedule]\nname = "demo"\n\n'
        f'[[item]]\nname = "rollups"\nkind = "refresh"\ncron = "{cron}"\n\n'
        f'[[item]]\nname = "housekeeping"\nkind = "housekeeping"\ncron = "{cron}"\n'
        f'journals = ["{work / "journal"}"]\n'
    )
    console.print(
        f"[bold]schedule[/]: {schedule.name} (rollups and housekeeping, due {due:%H:%M} UTC), "
        "run unattended: kickass schedule run"
    )
    env = {**os.environ, "KICKASS_DATABASE_URL": url, "KICKASS_HOST_ID": "demo-host"}
    kickass = str(Path(sys.executable).with_name("kickass"))
    log = work / "schedule.log"
    # In the demo's run directory, as every process it starts.
    run = subprocess.run(
        [kickass, "schedule", "run", str(schedule), "--log-file", str(log), "--json"],
        env=env, cwd=work, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    status = subprocess.run(
        [kickass, "schedule", "status", str(schedule)],
        env=env, cwd=work, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out_console.print(status.stdout.rstrip() or status.stderr.rstrip(), highlight=False)
    summary: dict[str, Any] = {"exit_code": run.returncode}
    with contextlib.suppress(json.JSONDecodeError, IndexError):
        summary.update(json.loads(run.stdout.splitlines()[-1]))
    # What `schedule status` says after the run, for scripts and the demo's test.
    status_json = subprocess.run(
        [kickass, "schedule", "status", str(schedule), "--json"],
        env=env, cwd=work, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    summary["status_exit_code"] = status_json.returncode
    with contextlib.suppress(json.JSONDecodeError):
        summary["status"] = json.loads(status_json.stdout)
    if run.returncode != 0:
        console.print(f"[red]schedule run failed (exit {run.returncode})[/]: {run.stderr.strip()}")
    return summary


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the fragment-viability study on a namespace internet (needs root)",
        description="Act one: build a small internet of network namespaces — the server, a "
        "router, and clients behind a clean path, a fragment-dropping middlebox, a lossy link "
        "and a NAT — start an embedded PostgreSQL unless KICKASS_DATABASE_URL is set, run the "
        "study from every client and print the results. Act two: an interleaved Kick-Ass vs "
        "TCP trial through the edge router ka-router and a 100 ms emulated WAN to a "
        "kickass-agent; prints FCT by protocol and flow size, the speedup and the time in "
        "Kick-Ass mode. Everything is removed afterwards, also on Ctrl-C.",
    )
    p.add_argument("--quick", action="store_true", help="use the server's quick plan")
    p.add_argument("--repetitions", type=int, default=DEMO_PLAN["repetitions"])
    p.add_argument("--step", type=int, default=DEMO_PLAN["step"])
    p.add_argument("--window", type=int, default=DEMO_PLAN["window"])
    p.add_argument("--loss", type=int, default=5, help="loss %% each way on the lossy path")
    p.add_argument("--clients", nargs="+", choices=CLIENT_KINDS, help="subset of clients")
    p.add_argument(
        "--keep-db",
        type=Path,
        default=None,
        help="keep the embedded database in this directory (default: temporary)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="also print a JSON summary on stdout")
    p.add_argument(
        "--report",
        type=Path,
        default=Path(".kickass/demo-report.html"),
        help="write the measurement report (kickass report) here at the end",
    )
    p.add_argument(
        "--no-trials", action="store_true", help="skip act two (the Kick-Ass vs TCP trial)"
    )
    p.add_argument(
        "--trial-period",
        type=float,
        default=20.0,
        help="seconds per trial period in act two (default 20)",
    )
    p.set_defaults(func=run)
