"""An interleaved Kick-Ass vs TCP trial through the emulated edge router.

The WAN testbed (``wan.py``: senders -> ka-router -> ka-linkem -> receivers)
with, on top: a `kickass-agent` in each receiver namespace, a `kickass
server` in the first sender's namespace (on its loopback, storing into the
given database) and `kickass trials run` in that sender, uploading there.
The demo's second act, the trial tests and the paper-testbed benchmark all
run trials this way, so what they measure is what operators run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kickass_db as db
from kickass_analysis.rollups import RollupStore
from kickass_core.errors import KickassError
from kickass_core.flow_record import DEFAULT_CONGESTION_CONTROL
from sqlalchemy import create_engine, text

from .binaries import rust_binary
from .topology import Process, Topology
from .wan import Testbed, TestbedConfig, receiver_address, sender_address, testbed

AGENT_CONTROL_PORT = 8700
SERVER_HTTP_PORT = 8080


@dataclass
class TrialSpec:
    pairs: int = 1
    period_s: float = 20.0
    mean_gap_s: float = 0.5
    mean_packets: float = 100.0
    max_packets: int = 2000
    seed: int = 1
    protocols: str = "kickass,tcp"
    cc: str = DEFAULT_CONGESTION_CONTROL
    handshake: str = "padded"
    # What the periods of a pair run (kickass_wan.trials.schedule.parse_arms), e.g.
    # "kickass,tcp:cubic,tcp:bbr" or an A/A "tcp:cubic,tcp:cubic"; None: protocols.
    arms: str | None = None
    gap_s: float = 5.0
    flow_timeout_s: float = 60.0
    max_concurrent: int = 256
    literal_range: bool = False
    extra_args: list[str] = field(default_factory=list)


@dataclass
class TrialOutcome:
    result: dict[str, Any]
    summary: list[dict[str, Any]]
    flows: list[dict[str, Any]]
    telemetry: list[dict[str, Any]]
    router_run_name: str
    # v_trial_speedups of these trials (the rollup refreshed after the run).
    speedups: list[dict[str, Any]] = field(default_factory=list)
    periods: list[dict[str, Any]] = field(default_factory=list)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def run_trial(
    database_url: str,
    testbed_config: TestbedConfig,
    spec: TrialSpec,
    *,
    during: Callable[[Testbed], None] | None = None,
    senders: Sequence[str] = ("s1",),
    timeout_s: float | None = None,
    keep_logs: bool = False,
    prepare: Callable[[Testbed], None] | None = None,
    after: Callable[[Testbed], None] | None = None,
    work_dir: Path | None = None,
    agent_secret: str | None = None,
    topology: Topology | None = None,
) -> TrialOutcome:
    """Build the testbed, run one trial per sender in ``senders`` at once, return what was stored.

    Hooks, each called with the ``Testbed``: ``prepare(tb)`` once the network
    is up, before any agent starts or any flow is sent (a middlebox, an MTU
    change); ``during(tb)`` once the trials have started (cross traffic,
    floods, restarts...); ``after(tb)`` once every sender's runner has ended,
    before anything is checked or read (e.g. `kickass trials upload` of what
    waited in a spool while the server was away). Records still spooled
    after it are an error.

    ``work_dir`` holds the runner token (``runner-token``), the agents' state
    (``agent-<host>``) and each sender's spool (``spool-<host>``); given, it
    is kept, else a temporary directory is used and removed.
    ``agent_secret``: the agents' secret (default a fresh one), for hooks
    that ask an agent for flow tokens themselves. ``topology``: the testbed's
    layout when not ``wan.wan_topology``'s (experiment (d)'s paths).
    """
    db.upgrade(database_url)
    secret = agent_secret or secrets.token_hex(32)
    token = _runner_token(database_url)
    # The server runs in the first sender, on its LAN address, so every
    # sender's runner reaches it across the LAN bridge (not through ka-router).
    server_http = f"{sender_address(int(senders[0].removeprefix('s')))}:{SERVER_HTTP_PORT}"
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="kickass-trial-")) if work_dir is None else work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        (work / "runner-token").write_text(token)
        with testbed(
            testbed_config, database_url=database_url, keep_logs=keep_logs, topology=topology
        ) as tb:
            if keep_logs:
                print(f"trial logs kept in {tb.log_dir} and {work}", file=sys.stderr)
            built = tb.built
            if prepare is not None:
                prepare(tb)
            agents = start_agents(tb, secret, work)
            _start_server(tb, senders[0], server_http, work, database_url)
            procs = []
            for n, host in enumerate(senders):
                argv = _runner_argv(spec, tb, agents, n, host, server_http, work)
                procs.append(
                    built[host].popen(
                        argv,
                        cwd=work,  # its run directory, as every process here has
                        env={**os.environ, "KICKASS_AGENT_SECRET": secret},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            if during is not None:
                during(tb)
            arms = len(spec.arms.split(",")) if spec.arms else len(spec.protocols.split(","))
            limit = timeout_s or (
                spec.pairs * arms * (spec.period_s + spec.gap_s) * testbed_config.receivers + 120
            )
            results = _runner_results(procs, limit)
            if after is not None:
                after(tb)
            _check_uploaded(senders, results, work)
            telemetry = tb.telemetry()
            prefix = tb.prefix
        trial_ids = [t for r in results for t in r["trials"].values()]
        summary, flows = _stored(database_url, trial_ids)
        merged = {"runs": results, "failed_flows": sum(r["failed_flows"] for r in results)}
        with RollupStore(database_url) as rollups:
            rollups.refresh_speedups()
            speedups = rollups.speedups(trial_ids)
        return TrialOutcome(
            merged, summary, flows, telemetry, prefix, speedups, _periods(database_url, trial_ids)
        )
    finally:
        if own_work and not keep_logs:
            shutil.rmtree(work, ignore_errors=True)


def _start_server(tb: Testbed, host: str, server_http: str, work: Path, database_url: str) -> None:
    """`kickass server` in ``host``, listening on ``server_http``, storing into the database."""
    tb.built.start(
        Process(
            name="server",
            host=host,
            argv=(
                _bin("kickass"),
                "server",
                "--listen",
                server_http,
                "--probe-bind",
                "127.0.0.1",
                "--probe-port",
                "9000",
                # Its own journal: the default (.kickass/journal in the
                # working directory) is shared by every server started
                # there, and replaying another's journal races with it.
                "--journal-dir",
                str(work / "journal"),
            ),  # fmt: skip
            env={"KICKASS_DATABASE_URL": database_url},
            ready_text="listening http",
        )
    )


def _runner_argv(
    spec: TrialSpec,
    tb: Testbed,
    agents: list[str],
    n: int,
    host: str,
    server_http: str,
    work: Path,
) -> list[str]:
    """`kickass trials run` of sender ``host`` (the ``n``-th), uploading to the server."""
    return [
        _bin("kickass"), "trials", "run",
        *[a for agent in agents for a in ("--agent", agent)],
        "--pairs", str(spec.pairs), "--period", str(spec.period_s),
        "--mean-gap", str(spec.mean_gap_s), "--mean-packets", str(spec.mean_packets),
        "--max-packets", str(spec.max_packets), "--seed", str(spec.seed),
        "--sender-index", str(n),
        "--protocols", spec.protocols, "--cc", spec.cc, "--handshake", spec.handshake,
        *(("--arms", spec.arms) if spec.arms else ()),
        "--gap", str(spec.gap_s), "--flow-timeout", str(spec.flow_timeout_s),
        "--max-concurrent", str(spec.max_concurrent),
        *(("--literal-range",) if spec.literal_range else ()),
        "--access-capacity", str(rate_bps(tb.config.capacity)),
        "--router-run-name", tb.prefix,
        "--ka-send", str(rust_binary("ka-send")),
        "--server", f"http://{server_http}",
        "--runner-token-file", str(work / "runner-token"),
        "--spool-dir", str(work / f"spool-{host}"),
        "--json", *spec.extra_args,
    ]  # fmt: skip


def _runner_results(procs: list[subprocess.Popen[str]], limit: float) -> list[dict[str, Any]]:
    """Each runner's --json result, once it ends; one that runs past ``limit``
    seconds is killed, and one that failed or printed nothing is an error."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise KickassError(f"the trial did not finish in {limit:.0f}s: {err[-500:]}") from None
        if p.returncode not in (0, 1) or not out.strip():
            raise KickassError(f"kickass trials run failed ({p.returncode}): {err[-800:]}")
        results.append(json.loads(out))
    return results


def _check_uploaded(senders: Sequence[str], results: list[dict[str, Any]], work: Path) -> None:
    """Every record of every sender stored: none refused, none left spooled."""
    for host, res in zip(senders, results, strict=True):
        # Counted again (one file per record, kickass_wan.trials.spool): ``after``
        # may have uploaded what the run left spooled.
        spooled = sum(1 for _ in (work / f"spool-{host}").glob("*.json"))
        if res.get("rejected") or spooled:
            raise KickassError(
                f"trial results not stored: {res.get('rejected')} refused, "
                f"{spooled} left spooled: {res.get('upload_errors')}"
            )


def start_agents(tb: Testbed, secret: str, work: Path) -> list[str]:
    """A `kickass-agent` (process ``agent-<host>``) in each receiver namespace,
    its used tokens kept in ``work/agent-<host>``; returns the runner's
    ``--agent NAME=URL`` values (agent ``far-<i>`` in ``r<i>``)."""
    agents = []
    for i in range(1, tb.config.receivers + 1):
        host = f"r{i}"
        tb.built.start(
            Process(
                name=f"agent-{host}",
                host=host,
                argv=(
                    _bin("kickass-agent"),
                    "--name",
                    f"far-{i}",
                    "--listen",
                    f"{receiver_address(i)}:{AGENT_CONTROL_PORT}",
                    "--tcp-port",
                    "8701",
                    "--kickass-port",
                    "8702",
                    "--kickass-receiver",
                    str(rust_binary("ka-agent-recv")),
                    "--state-dir",
                    str(work / f"agent-{host}"),
                ),
                env={"KICKASS_AGENT_SECRET": secret},
                ready_text="ready on",
            )
        )
        agents.append(f"far-{i}=http://{receiver_address(i)}:{AGENT_CONTROL_PORT}")
    return agents


def rate_bps(rate: str) -> float:
    """A testbed rate such as '10mbit' in bit/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, mult in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * mult
    return float(rate)


def _runner_token(database_url: str) -> str:
    from kickass_db.trial_store import TrialStore

    store = TrialStore(database_url)
    try:
        return store.add_runner(f"testbed-{secrets.token_hex(3)}")
    finally:
        store.close()


def _stored(
    database_url: str, trial_ids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            flows = [
                dict(r)
                for r in conn.execute(
                    text(
                        "SELECT * FROM v_flow_results WHERE trial_id = ANY(:t) ORDER BY started_at"
                    ),
                    {"t": trial_ids},
                ).mappings()
            ]
            summary = [
                dict(r)
                for r in conn.execute(
                    text(
                        "SELECT * FROM v_flow_summary WHERE destination IN "
                        "(SELECT destination FROM trials WHERE trial_id = ANY(:t)) "
                        "ORDER BY destination, size_bucket, protocol"
                    ),
                    {"t": trial_ids},
                ).mappings()
            ]
        return summary, flows
    finally:
        engine.dispose()


def _periods(database_url: str, trial_ids: list[str]) -> list[dict[str, Any]]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            return [
                dict(r)
                for r in conn.execute(
                    text(
                        "SELECT * FROM v_trial_periods WHERE trial_id = ANY(:t) "
                        "ORDER BY trial_id, period_index"
                    ),
                    {"t": trial_ids},
                ).mappings()
            ]
    finally:
        engine.dispose()


def render_speedups(speedups: list[dict[str, Any]]) -> str:
    """The paired speedup per size bucket with its 95% interval and both arms'
    completion rates (one trial's rows of v_trial_speedups)."""
    order = {"1-10": 0, "11-100": 1, "101-1000": 2, "1001+": 3, "all": 4}
    lines = [
        f"{'flow size (packets)':<20} {'arm vs baseline':<24} {'matched':>8} {'speedup':>8} "
        f"{'95% interval':>15} {'completed':>17}"
    ]
    for r in sorted(
        speedups, key=lambda r: (r["arm"], r["baseline_arm"], order.get(r["size_bucket"], 9))
    ):
        if r["speedup"] is None:
            est, ci = "-", ""
        else:
            est = f"{r['speedup']:.2f}x"
            ci = (
                f"[{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]"
                if r["speedup_low"] is not None
                else "(one pair)"  # below two period pairs there is no interval
            )
        done = (
            f"{(r['completion_arm'] or 0):.0%} / {(r['completion_baseline'] or 0):.0%}"
            if r["pairs"]
            else ""
        )
        lines.append(
            f"{r['size_bucket']:<20} {r['arm'] + ' vs ' + r['baseline_arm']:<24} "
            f"{r['matched']:>4}/{r['pairs']:<3} {est:>8} {ci:>15} {done:>17}"
        )
    return "\n".join(lines)


def render_summary(summary: list[dict[str, Any]], flows: list[dict[str, Any]]) -> str:
    """FCT by protocol and size bucket, the speedup and the time in Kick-Ass mode."""
    order = {"1-10": 0, "11-100": 1, "101-1000": 2, "1001+": 3}
    lines = [
        f"{'flow size (packets)':<20} {'protocol':<8} {'flows':>5} {'mean FCT':>10} "
        f"{'p95 FCT':>10} {'speedup':>8} {'ka_mode':>8}"
    ]
    for row in sorted(summary, key=lambda r: (order.get(r["size_bucket"], 9), r["protocol"])):

        def ms(v: Any) -> str:
            return "-" if v is None else f"{v:.0f} ms"

        speed = "" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        ka = "" if row["ka_mode_fraction_mean"] is None else f"{row['ka_mode_fraction_mean']:.0%}"
        lines.append(
            f"{row['size_bucket']:<20} {row['protocol']:<8} {row['flows']:>5} "
            f"{ms(row['fct_ms_mean']):>10} {ms(row['fct_ms_p95']):>10} {speed:>8} {ka:>8}"
        )
    by: dict[str, list[float]] = {}
    for f in flows:
        if f["fct_ms"] is not None:
            by.setdefault(f["protocol"], []).append(f["fct_ms"])
    if by.get("kickass") and by.get("tcp"):
        k = sum(by["kickass"]) / len(by["kickass"])
        t = sum(by["tcp"]) / len(by["tcp"])
        lines.append(
            f"all flows: Kick-Ass mean FCT {k:.0f} ms, TCP {t:.0f} ms: {t / k:.2f}x faster"
        )
    return "\n".join(lines)
