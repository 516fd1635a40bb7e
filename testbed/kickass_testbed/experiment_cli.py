"""`kickass experiment`: the paper's congestion experiments on the testbed,
stored and shown (issue 24 item 6).

    kickass experiment run a|b|floor [--duration S] [--epochs A-B,...] [--flows-kickass N]
                       [--flows-tcp N] [--capacity RATE] [--rtt-ms MS] [--database-url URL]
                       [--json] [--keep-logs]
    kickass experiment run d [--capacity RATE] [--pairs N] [--period S] --database-url URL
    kickass experiment list [--json]
    kickass experiment show ID [--json]
    kickass experiment store FILE [--json]

``run`` builds the testbed in namespaces (root), runs
``kickass_testbed.congestion.run_congestion`` (experiment (d):
``kickass_testbed.wide_area.run_wide_area``, a round of trials to ten
emulated paths, which needs the database its trials go to) and prints each
TCP epoch's (each path's) figures beside the paper's words
(``kickass_analysis.experiments_section``);
with a database (the flag, else ``KICKASS_DATABASE_URL``, else the config
file) the router's telemetry and the run are stored
(``kickass_db.experiment_store``). A run the database refuses is kept in a
JSON file for ``store``. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kickass_core import config, strictjson
from kickass_core.cli import group
from kickass_core.errors import KickassError

EXPERIMENTS_HELP = {
    "a": "TCP cross traffic at the Kick-Ass bottleneck (paper §III-D1, Fig. 5)",
    "b": "the bottleneck is a legacy drop-tail router behind ka-router (§III-D2, Fig. 7)",
    "floor": "ka-router in drop-tail mode (no rates): Kick-Ass flows in TCP mode against TCP "
    "(§II-C2, 'bounded below by TCP')",
    "d": "one round of Kick-Ass and CUBIC trials to ten emulated wide-area paths, 4-250 ms, the "
    "deeper ones behind a legacy drop-tail link (§IV-B in miniature)",
}
# The access link's default: (a), (b), floor at 20 Mbit/s; (d) the paper's 10 Mbit/s.
DEFAULT_CAPACITY = {"d": "10mbit"}
# What the defaults run: 28 s, TCP on from 8 to 20 s (CongestionSpec).
DEFAULT_DURATION_S = 28.0
MAX_FILE_BYTES = 64 * 1024 * 1024


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmds = group(
        sub,
        "experiment",
        help="run the paper's congestion experiments on the testbed; list and show stored runs",
        description="The paper's congestion experiments (§III-D) on the namespace testbed: "
        "long-lived Kick-Ass flows through ka-router while TCP flows are switched on and off. "
        "(a) the TCP flows share ka-router's link, the bottleneck (§III-D1, Fig. 5): the "
        "router should enter TCP mode when they start and leave it when they stop, and "
        "Kick-Ass and TCP share the link fairly; (b) the bottleneck is a legacy drop-tail "
        "link behind ka-router that only the TCP flows share with them (§III-D2, Fig. 7): "
        "the Kick-Ass endpoints must find it by their losses; floor: ka-router in drop-tail "
        "mode, so the Kick-Ass flows run in TCP mode throughout (§II-C2). Each run's figures "
        "(per TCP epoch: Jain's index, Kick-Ass/TCP, utilisation, switch times in RTTs) are "
        "printed beside the paper's words and, with a database, stored (v_experiment_runs, "
        "v_experiment_rates) for `kickass report`.",
    )
    run = cmds.add_parser(
        "run",
        help="run one experiment in namespaces (root) and store it",
        description="Build the testbed (senders, ka-router, the WAN emulator, a receiver; "
        "network namespaces: needs root), run EXPERIMENT, print its figures beside the "
        "paper's and store it when a database is configured. Defaults are the paper's "
        "setting scaled to two cores: 8 Kick-Ass and 8 TCP flows at 20 Mbit/s, 100 ms, a "
        "one-BDP buffer (10.4 packets per RTT per flow while TCP is on; the paper: 150 Mbit/s "
        "over 128 flows, 9.8), 28 s with TCP on from 8 to 20 s. Takes the duration plus about "
        "10 s. Example: sudo kickass experiment run a --database-url postgresql://...",
    )
    run.add_argument(
        "experiment",
        choices=sorted(EXPERIMENTS_HELP),
        help="; ".join(f"{k}: {v}" for k, v in EXPERIMENTS_HELP.items()),
    )
    run.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        metavar="S",
        help=f"seconds the Kick-Ass flows run (default {DEFAULT_DURATION_S:g})",
    )
    run.add_argument(
        "--epochs",
        metavar="A-B,...",
        help="when the TCP flows are on, seconds from the start, e.g. 8-20,36-48 "
        "(default: from 2/7 to 5/7 of the duration: 8-20 of 28)",
    )
    run.add_argument("--flows-kickass", type=int, default=8, metavar="N", help="(default 8)")
    run.add_argument("--flows-tcp", type=int, default=8, metavar="N", help="per epoch (default 8)")
    run.add_argument(
        "--capacity",
        default=None,
        metavar="RATE",
        help="the bottleneck's rate (d: the access link's): 20mbit, 1gbit or bit/s "
        "(default 20mbit; d: 10mbit, the paper's other is 100mbit)",
    )
    run.add_argument(
        "--pairs",
        type=int,
        default=2,
        metavar="N",
        help="d: pairs of periods (Kick-Ass, CUBIC) per path (default 2; an interval needs 2)",
    )
    run.add_argument(
        "--period",
        type=float,
        default=8.0,
        metavar="S",
        help="d: seconds per period (default 8; the round takes pairs x 10 paths x 2 x "
        "(period + 5 s))",
    )
    run.add_argument(
        "--rtt-ms", type=float, default=100.0, metavar="MS", help="round-trip time (default 100)"
    )
    run.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the router's, emulator's and drivers' logs (where: printed at the end)",
    )
    _database(run, "store the run and its router telemetry here (default: none configured: "
              "printed only)")  # fmt: skip
    run.add_argument(
        "--json",
        action="store_true",
        help="print the run id, the figures and the whole outcome as one JSON object",
    )
    run.set_defaults(func=cmd_run)

    lst = cmds.add_parser(
        "list", help="the stored runs", description="The stored runs, oldest first."
    )
    _database(lst, "the database to read")
    lst.add_argument("--json", action="store_true", help="one JSON list")
    lst.set_defaults(func=cmd_list)

    show = cmds.add_parser(
        "show",
        help="one stored run's figures beside the paper's",
        description="One stored run: per TCP epoch Jain's index, Kick-Ass/TCP, utilisation, "
        "the router's and the Kick-Ass flows' switch times in RTTs, and the paper's words "
        "beside ours; --json adds every flow's rate and mode over time.",
    )
    show.add_argument("run_id", type=int, metavar="ID")
    _database(show, "the database to read")
    show.add_argument("--json", action="store_true", help="the run, its figures and its rates")
    show.set_defaults(func=cmd_show)

    store = cmds.add_parser(
        "store",
        help="store a run's outcome from a JSON file (what `run --json` prints)",
        description="Store the outcome in FILE: the `outcome` of `run --json`, or the file "
        "`run` leaves when the database refused it. Storing the same outcome twice "
        "gives the same run.",
    )
    store.add_argument("file", metavar="FILE")
    _database(store, "the database to store into")
    store.add_argument("--json", action="store_true", help='print {"run_id": N}')
    store.set_defaults(func=cmd_store)


def _database(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--database-url",
        "--db",
        dest="database_url",
        metavar="URL",
        help=f"{what}; env KICKASS_DATABASE_URL, else database_url in the $KICKASS_CONFIG file",
    )


def parse_epochs(value: str, duration_s: float) -> tuple[tuple[float, float], ...]:
    """``8-20,36-48`` as ((8.0, 20.0), (36.0, 48.0)); KickassError when malformed."""
    hint = f"--epochs A-B,... with 0 <= A < B <= --duration ({duration_s:g}), e.g. 8-20,36-48"
    out = []
    for part in value.split(","):
        try:
            a, b = (float(x) for x in part.strip().split("-"))
        except ValueError:
            raise KickassError(f"bad epoch {part.strip()!r}", hint=hint) from None
        if not 0 <= a < b <= duration_s:
            raise KickassError(f"epoch {part.strip()} is not inside the run", hint=hint)
        out.append((a, b))
    if any(b1 > a2 for (_, b1), (a2, _) in zip(sorted(out), sorted(out)[1:], strict=False)):
        raise KickassError("epochs overlap", hint=hint)
    return tuple(sorted(out))


def build_spec(args: argparse.Namespace) -> Any:
    """The CongestionSpec of ``run``'s arguments, every value checked."""
    from kickass_db.experiment_store import EXPERIMENTS

    from .congestion import CongestionSpec
    from .trials import rate_bps

    if not 1 <= args.duration <= 3600:
        raise KickassError(
            "--duration must lie within 1 and 3600 seconds",
            hint="the defaults' 28 s give one 12 s TCP epoch; the paper's Fig. 5 ran 200 s",
        )
    for flag, n in (("--flows-kickass", args.flows_kickass), ("--flows-tcp", args.flows_tcp)):
        if not 1 <= n <= 256:
            raise KickassError(
                f"{flag} must lie within 1 and 256",
                hint="two cores carry 8 + 8 flows (the default); the paper ran 64 + 64",
            )
    capacity_text = args.capacity or DEFAULT_CAPACITY.get(args.experiment, "20mbit")
    try:
        capacity = rate_bps(capacity_text)
    except ValueError:
        capacity = -1.0
    if not 1e5 <= capacity <= 1e10:
        raise KickassError(
            f"bad --capacity {args.capacity!r}", hint="a rate from 100kbit to 10gbit: 20mbit, 1gbit"
        )
    if args.experiment == "d":
        return _wide_area_spec(args, capacity)
    if not 1 <= args.rtt_ms <= 2000:
        raise KickassError(
            "--rtt-ms must lie within 1 and 2000", hint="the paper's experiments: 100 ms"
        )
    d = args.duration
    epochs = (
        parse_epochs(args.epochs, d)
        if args.epochs
        else ((round(d * 2 / 7, 1), round(d * 5 / 7, 1)),)
    )
    kind, mode = EXPERIMENTS[args.experiment]
    try:
        return CongestionSpec(
            kind=kind,
            capacity_bps=capacity,
            rtt_ms=args.rtt_ms,
            kickass_flows=args.flows_kickass,
            tcp_flows=args.flows_tcp,
            epochs=epochs,
            duration_s=d,
            router_mode=mode,
        )
    except ValueError as exc:
        raise KickassError(
            f"cannot run this experiment: {exc}", hint="kickass experiment run --help"
        ) from None


def _wide_area_spec(args: argparse.Namespace, capacity: float) -> Any:
    """Experiment (d)'s WideAreaSpec from ``run``'s arguments."""
    from .wide_area import WideAreaSpec

    if not 1 <= args.pairs <= 50:
        raise KickassError("--pairs must lie within 1 and 50", hint="an interval needs 2")
    if not 1 <= args.period <= 600:
        raise KickassError(
            "--period must lie within 1 and 600 seconds", hint="the paper's periods: 120 s"
        )
    return WideAreaSpec(capacity_bps=capacity, pairs=args.pairs, period_s=args.period)


class _Ticker:
    """Elapsed time on stderr while the experiment runs (on a terminal only)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Ticker:
        if sys.stderr.isatty():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
            sys.stderr.write("\n")

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(1.0):
            sys.stderr.write(
                f"\r  running: {time.monotonic() - started:.0f} s of about {self.total_s:.0f} s"
            )
            sys.stderr.flush()


def _save(outcome: dict[str, Any], name: str) -> Path:
    """The outcome in a file in the working directory, for `experiment store`."""
    path = Path(f"kickass-experiment-{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}.json").resolve()
    path.write_text(json.dumps(outcome) + "\n")
    return path


def _store_or_keep(store: Any, outcome: dict[str, Any], name: str) -> int:
    """Store the outcome; refused, keep it in a file (``_save``) and say so in
    the error's hint, so a run of minutes is never lost to a refusal."""
    try:
        run_id: int = store.store(outcome)
    except KickassError as exc:
        path = _save(outcome, name)
        raise KickassError(
            exc.message,
            hint=f"{exc.hint + '; ' if exc.hint else ''}the outcome is kept in {path}: "
            f"kickass experiment store {path}",
        ) from exc
    return run_id


def cmd_run(args: argparse.Namespace) -> int:
    from kickass_analysis.experiments_section import Experiment
    from kickass_db.experiment_store import ExperimentStore

    from .congestion import run_congestion

    spec = build_spec(args)
    if os.geteuid() != 0:
        raise KickassError(
            "`kickass experiment run` builds network namespaces and needs root",
            hint="run it as root (sudo .venv/bin/kickass experiment run ...); "
            "list, show and store need no root",
        )
    url = config.resolve("database_url", args.database_url or None, file=config.load_file(None))
    store = None
    if url:
        store = ExperimentStore(url)
        store.ping()  # before minutes of running, not after
    if args.experiment == "d":
        if store is None or not url:
            raise KickassError(
                "experiment (d) is a round of trials and needs the database they are stored in",
                hint="pass --database-url (or set KICKASS_DATABASE_URL)",
            )
        return _run_wide_area(args, spec, store, url)
    print(
        f"experiment ({args.experiment}): {EXPERIMENTS_HELP[args.experiment]}; "
        f"{spec.kickass_flows} Kick-Ass + {spec.tcp_flows} TCP flows, "
        f"{spec.capacity_bps / 1e6:g} Mbit/s, {spec.rtt_ms:g} ms, {spec.duration_s:g} s, TCP on "
        + ", ".join(f"{a:g}-{b:g} s" for a, b in spec.epochs)
        + (f"; storing into {store!r}" if store else "; no database: printed only"),
        file=sys.stderr,
    )
    try:
        with _Ticker(spec.duration_s + 10):
            outcome = run_congestion(spec, database_url=url, keep_logs=args.keep_logs).to_json()
        run_id = None
        if store is not None:
            run_id = _store_or_keep(store, outcome, args.experiment)
    finally:
        if store is not None:
            store.close()
    summary = Experiment.from_outcome(outcome, run_id)
    if args.json:
        print(
            json.dumps(
                {"run_id": run_id, "summary": summary.to_json(), "outcome": outcome}, default=str
            )
        )
    else:
        print(summary.text())
    if args.keep_logs:
        logs = Path(tempfile.gettempdir()) / f"kickass-{outcome['router_run_name']}-*"
        print(f"logs kept in {logs}", file=sys.stderr)
    if run_id is not None:
        print(f"stored as run {run_id}: kickass experiment show {run_id}", file=sys.stderr)
    return 0


def _run_wide_area(args: argparse.Namespace, spec: Any, store: Any, url: str) -> int:
    """``run d``: the round, stored as trials and as a run, shown per path."""
    from kickass_analysis.experiments_section import Experiment

    from .wide_area import run_wide_area

    print(
        f"experiment (d): {EXPERIMENTS_HELP['d']}; {spec.capacity_bps / 1e6:g} Mbit/s access, "
        f"{spec.pairs} pairs of {spec.period_s:g} s periods per path; storing into {store!r}",
        file=sys.stderr,
    )
    try:
        with _Ticker(spec.duration_s + 30):
            outcome = run_wide_area(spec, url, keep_logs=args.keep_logs).to_json()
        run_id = _store_or_keep(store, outcome, "d")
    finally:
        store.close()
    summary = Experiment.from_outcome(outcome, run_id)
    if args.json:
        print(json.dumps({"run_id": run_id, "summary": summary.to_json(), "outcome": outcome}))
    else:
        print(summary.text())
    print(f"stored as run {run_id}: kickass experiment show {run_id}", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from kickass_db.experiment_store import ExperimentStore

    with ExperimentStore(args.database_url) as store:
        runs = store.runs()
        where = repr(store)
    if args.json:
        print(json.dumps([r.to_json() for r in runs]))
        return 0
    if not runs:
        print(f"no experiment runs stored in {where}", file=sys.stderr)
        return 0
    head = ["id", "experiment", "kind", "router", "flows started (UTC)", "link", "flows",
            "TCP on", "Jain's index", "Kick-Ass/TCP"]  # fmt: skip
    rows = [head]
    for r in runs:
        epochs = r.figures.get("epochs") or []
        if r.figures.get("paths"):
            rows.append(_wide_area_line(r))
            continue
        rows.append(
            [str(r.run_id), r.experiment, r.kind, r.router_mode,
             f"{r.started_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}",
             f"{r.capacity_bps / 1e6:g} Mbit/s {r.rtt_ms:g} ms",
             f"{r.flows.get('kickass', 0)}+{r.flows.get('tcp', 0)}",
             ",".join(f"{e['start_s']:g}-{e['end_s']:g}" for e in epochs) or "-",
             ",".join("-" if e.get("jain") is None else f"{e['jain']:.3f}" for e in epochs)
             or "-",
             ",".join("-" if e.get("kickass_over_tcp") is None
                      else f"{e['kickass_over_tcp']:.2f}" for e in epochs) or "-"]
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _wide_area_line(r: Any) -> list[str]:
    """A wide-area run in ``list``: its paths' RTTs, flows per arm, speedups."""
    paths = r.figures["paths"]
    rtts = [float(p["rtt_ms"]) for p in paths]
    flows: dict[str, int] = {}
    for p in paths:
        for arm, n in (p.get("flows") or {}).items():
            flows[arm] = flows.get(arm, 0) + int(n)
    speedups = [p["speedup"] for p in paths if p.get("speedup") is not None]
    return [
        str(r.run_id), r.experiment, r.kind, r.router_mode,
        f"{r.started_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}",
        f"{r.capacity_bps / 1e6:g} Mbit/s {min(rtts):g}-{max(rtts):g} ms",
        "+".join(str(n) for n in flows.values()) or "-", "-", "-",
        f"{min(speedups):.2f}-{max(speedups):.2f} per path" if speedups else "-",
    ]  # fmt: skip


def cmd_show(args: argparse.Namespace) -> int:
    from kickass_analysis.experiments_section import Experiment
    from kickass_db.experiment_store import ExperimentStore

    with ExperimentStore(args.database_url) as store:
        run = store.get(args.run_id)
        rates = store.rates(run.run_id)
        router = store.router_modes(run)
    x = Experiment.from_stored(run, rates, router)
    if args.json:
        shading = x.shading()
        print(
            json.dumps(
                {
                    "run": run.to_json(),
                    "summary": x.to_json(),
                    "tcp_mode_intervals": {
                        "source": shading.series,
                        "intervals": [list(i) for i in shading.intervals],
                    },
                    "rates": [s.to_json() for s in rates],
                }
            )
        )
    else:
        print(x.text())
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from kickass_db.experiment_store import ExperimentStore

    path = Path(args.file)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KickassError(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise KickassError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = strictjson.loads(raw)
    except ValueError as exc:
        raise KickassError(f"{path} is not JSON: {exc}") from None
    # `run --json` prints the outcome inside; the kept file is the outcome.
    outcome = doc.get("outcome", doc) if isinstance(doc, dict) else doc
    with ExperimentStore(args.database_url) as store:
        run_id = store.store(outcome)
    print(json.dumps({"run_id": run_id}) if args.json else f"stored as run {run_id}")
    return 0
