"""The paper's congestion experiments in namespaces (§III-D): long-lived
Kick-Ass flows with TCP cross traffic switched on and off.

* ``kickass-bottleneck`` (experiment (a), §III-D1, Fig. 5): Kick-Ass flows
  from s1 (one ``ka-send``: one endpoint) and kernel TCP flows (CUBIC) from s2
  share ka-router's link, the bottleneck.
* ``legacy-bottleneck`` (experiment (b), §III-D2, Fig. 7): ka-router and a
  legacy drop-tail bottleneck in the emulator, both at the capacity; the TCP
  flows come from x1, between the two, and never cross ka-router. Alone, the
  Kick-Ass flows fill the path at ka-router's rates; with the TCP flows, the
  congestion is at the legacy link, which ka-router does not see (it keeps
  advertising), and the endpoints must find it by their losses.

Scaled to two cores: 8 + 8 flows at 20 Mbit/s, 100 ms, one-BDP buffer: 10.4
packets per RTT per flow while TCP is on (the paper: 150 Mbit/s over 128
flows, 9.8). Every flow's rate and mode every 100 ms (``congestion_driver``),
the router's telemetry, and the figures the paper reads off its plots: in the
second half of each TCP epoch, Jain's index over every flow's throughput,
the Kick-Ass flows' mean over the TCP flows', the link's utilisation; and
how many RTTs after an epoch's start (end) the router entered (left) TCP mode.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError
from kickass_core.flow_record import DEFAULT_CONGESTION_CONTROL
from kickass_wan.tcpflow import MAX_FLOW_BYTES

from .binaries import rust_binary
from .trials import AGENT_CONTROL_PORT, start_agents
from .wan import Testbed, TestbedConfig, receiver_address, testbed

KINDS = ("kickass-bottleneck", "legacy-bottleneck")
# Both drivers start their flows this long after they are launched (time
# for Python to start and for the agent to hand out tokens).
START_AFTER_S = 3.0
# Payload bytes per wire byte of each protocol's full segments (what a rate
# of delivered bytes is of the link's rate).
WIRE_PER_PAYLOAD = {"kickass": 1520 / 1440, "tcp": 1500 / 1448}


@dataclass
class CongestionSpec:
    kind: str = "kickass-bottleneck"
    capacity_bps: float = 20e6
    rtt_ms: float = 100.0
    kickass_flows: int = 8
    tcp_flows: int = 8
    # TCP on between START and END (seconds from the flows' start).
    epochs: tuple[tuple[float, float], ...] = ((8.0, 20.0),)
    duration_s: float = 28.0
    interval_s: float = 0.1
    router_args: list[str] = field(default_factory=list)
    # "droptail": ka-router marks nothing, so the Kick-Ass flows run in TCP
    # mode throughout (the TCP-mode floor).
    router_mode: str = "kickass"
    tcp_cc: str = DEFAULT_CONGESTION_CONTROL
    # TCP mode's controller in ka-send (`--cc`).
    kickass_cc: str = DEFAULT_CONGESTION_CONTROL

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        if self.router_mode not in ("kickass", "droptail"):
            raise ValueError("router_mode is kickass or droptail")
        if not all(0 <= a < b <= self.duration_s for a, b in self.epochs):
            raise ValueError("every epoch lies inside the run")


@dataclass
class EpochFigures:
    start_s: float
    end_s: float
    jain: float | None
    kickass_over_tcp: float | None
    utilisation: float | None
    # RTTs (of the configured RTT) from the epoch's start to the router's
    # first TCP-mode sample, and from its end to the first Kick-Ass-mode one.
    tcp_mode_after_rtts: float | None
    kickass_mode_after_rtts: float | None


@dataclass
class CongestionOutcome:
    spec: dict[str, Any]
    epochs: list[EpochFigures]
    # Per flow: (t from the flows' start, rate bit/s, ka_mode) every interval.
    rates: dict[str, list[tuple[float, float, bool]]]
    protocols: dict[str, str]
    # Router samples: (t, marking_mode, advertised_rate_bps, queue_bytes).
    router: list[tuple[float, str, float, int]]
    router_run_name: str
    alone: dict[str, float | None]
    # Each driver's last line: per flow its end (error, retransmissions;
    # ka-send's records: RTOs, fast retransmits) and, for the TCP flows,
    # the kernel's loss-recovery counters of their namespace.
    drivers: list[dict[str, Any]] = field(default_factory=list)
    # Per flow: (t, window bytes, bytes in flight) every interval (TCP_INFO
    # for the kernel's flows, ka-send's progress for Kick-Ass flows).
    windows: dict[str, list[tuple[float, int | None, int | None]]] = field(default_factory=dict)
    # When the flows started (t = 0 of rates and router), ISO 8601 in UTC:
    # what the experiment's stored run and its router telemetry are aligned by.
    started_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (tuples as lists), as the experiment store takes it."""
        out: dict[str, Any] = json.loads(json.dumps(asdict(self), default=str))
        return out


def jain(xs: list[float]) -> float | None:
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def _rates(
    progress: list[dict[str, Any]], t0: float, interval: float
) -> dict[str, list[tuple[float, float, bool]]]:
    """Per flow, the rate between consecutive progress samples (payload bits/s)."""
    by_flow: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in progress:
        by_flow[p["flow"]].append(p)
    out: dict[str, list[tuple[float, float, bool]]] = {}
    for flow, ps in by_flow.items():
        ps.sort(key=lambda p: p["t"])
        series = []
        for a, b in zip(ps, ps[1:], strict=False):
            dt = b["t"] - a["t"]
            if dt <= 0:
                continue
            rate = max(0, b["acked_bytes"] - a["acked_bytes"]) * 8.0 / dt
            series.append((round(b["t"] - t0, 4), rate, bool(b["ka_mode"])))
        out[flow] = series
    return out


def _mean_rate(series: list[tuple[float, float, bool]], lo: float, hi: float) -> float:
    """Mean rate over [lo, hi): a flow absent there counts 0."""
    xs = [r for t, r, _ in series if lo <= t < hi]
    return statistics.fmean(xs) if xs else 0.0


def figures(
    spec: CongestionSpec,
    rates: dict[str, list[tuple[float, float, bool]]],
    protocols: dict[str, str],
    router: list[tuple[float, str, float, int]],
) -> tuple[list[EpochFigures], dict[str, float | None]]:
    rtt = spec.rtt_ms / 1000
    out = []
    for a, b in spec.epochs:
        half = (a + b) / 2
        per_flow = {f: _mean_rate(s, half, b) for f, s in rates.items()}
        # The TCP flows of this epoch (a driver labels later epochs' flows apart).
        live = {f: r for f, r in per_flow.items() if protocols[f] == "kickass" or r > 0}
        ka = [r for f, r in live.items() if protocols[f] == "kickass"]
        tcp = [r for f, r in live.items() if protocols[f] == "tcp"]
        wire = sum(r * WIRE_PER_PAYLOAD[protocols[f]] for f, r in live.items())
        # Only a TCP mode the epoch caused, and only its end.
        on = next((t for t, mode, *_ in router if a <= t < b and mode == "tcp"), None)
        off = (
            None
            if on is None
            else next((t for t, mode, *_ in router if t >= b and mode == "kickass"), None)
        )
        out.append(
            EpochFigures(
                a,
                b,
                jain(list(live.values())),
                statistics.fmean(ka) / statistics.fmean(tcp) if ka and tcp and any(tcp) else None,
                wire / spec.capacity_bps if live else None,
                None if on is None else round((on - a) / rtt, 2),
                None if off is None else round((off - b) / rtt, 2),
            )
        )
    # Kick-Ass alone: before the first epoch (its second half).
    first = spec.epochs[0][0] if spec.epochs else spec.duration_s
    ka_alone = [
        _mean_rate(s, first / 2, first) for f, s in rates.items() if protocols[f] == "kickass"
    ]
    alone = {
        "jain": jain(ka_alone),
        "utilisation": sum(ka_alone) * WIRE_PER_PAYLOAD["kickass"] / spec.capacity_bps
        if ka_alone
        else None,
    }
    return out, alone


def run_congestion(
    spec: CongestionSpec,
    *,
    database_url: str | None = None,
    keep_logs: bool = False,
) -> CongestionOutcome:
    """Build the testbed, run the experiment, return its figures (router
    telemetry stored when ``database_url`` is given)."""
    secret = secrets.token_hex(32)
    work = Path(tempfile.mkdtemp(prefix="kickass-congestion-"))
    with testbed(_testbed_config(spec), database_url=database_url, keep_logs=keep_logs) as tb:
        start_agents(tb, secret, work)
        # One start for both sides, after both have their tokens.
        t0 = time.time() + START_AFTER_S
        progress, done = _run_drivers(tb, spec, secret, t0)
        telemetry = tb.telemetry()
        run_name = tb.prefix
    if not keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    router = []
    for s in telemetry:
        if s.get("type") != "sample" or "ts" not in s:
            continue
        router.append(
            (
                round(s["ts"] - t0, 4),
                s["marking_mode"],
                s["advertised_rate_bps"],
                s["queue_bytes"],
            )
        )
    rates = _rates(progress, t0, spec.interval_s)
    protocols = {p["flow"]: p["protocol"] for p in progress}
    epochs, alone = figures(spec, rates, protocols, router)
    windows: dict[str, list[tuple[float, int | None, int | None]]] = defaultdict(list)
    for rec in sorted(progress, key=lambda r: r["t"]):
        windows[rec["flow"]].append(
            (round(rec["t"] - t0, 4), rec.get("cwnd_bytes"), rec.get("flight_bytes"))
        )
    return CongestionOutcome(
        asdict(spec),
        epochs,
        rates,
        protocols,
        router,
        run_name,
        alone,
        drivers=done,
        windows=dict(windows),
        started_at=datetime.fromtimestamp(t0, UTC).isoformat(),
    )


def _testbed_config(spec: CongestionSpec) -> TestbedConfig:
    """The experiment's testbed: (b) adds the legacy bottleneck and its cross host."""
    legacy = spec.kind == "legacy-bottleneck"
    capacity = f"{spec.capacity_bps / 1e6:g}mbit"
    # One BDP, counted in bytes as ka-router's buffer is. Counted in packets,
    # a datagram ka-router cut takes two places: the Kick-Ass flows' losses
    # per datagram double and their TCP mode got 0.67 of the TCP flows' share.
    bdp_bytes = max(30 * 1500, int(spec.capacity_bps / 8 * spec.rtt_ms / 1000))
    return TestbedConfig(
        senders=1 if legacy else 2,
        receivers=1,
        capacity=capacity,
        rtt_ms=spec.rtt_ms,
        bottleneck=capacity if legacy else None,
        bottleneck_queue=f"{bdp_bytes}b",
        router_args=list(spec.router_args),
        mode=spec.router_mode,
        cross=1 if legacy else 0,
    )


def _run_drivers(
    tb: Testbed, spec: CongestionSpec, secret: str, t0: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both drivers (Kick-Ass from s1; TCP from s2, or x1 in (b)), starting
    their flows at ``t0``; returns their progress lines and their summaries."""
    legacy = spec.kind == "legacy-bottleneck"
    # More than a flow could send in the run at the whole capacity (within
    # the largest TCP flow the agent takes).
    size = min(int(spec.capacity_bps / 8 * spec.duration_s * 2), MAX_FLOW_BYTES)
    agent = f"http://{receiver_address(1)}:{AGENT_CONTROL_PORT}"
    py = sys.executable
    progress: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    lock = threading.Lock()
    env = {"KICKASS_AGENT_SECRET": secret}
    ka_cmd = [
        py, "-m", "kickass_testbed.congestion_driver", "kickass",
        "--agent", agent, "--flows", str(spec.kickass_flows), "--size", str(size),
        "--interval", str(spec.interval_s), "--stagger", "0.1",
        "--duration", str(spec.duration_s), "--ka-send", str(rust_binary("ka-send")),
        "--cc", spec.kickass_cc,
    ]  # fmt: skip
    tcp_cmd = [
        py, "-m", "kickass_testbed.congestion_driver", "tcp",
        "--agent", agent, "--flows", str(spec.tcp_flows), "--size", str(size),
        "--interval", str(spec.interval_s), "--cc", spec.tcp_cc,
        *[a for e in spec.epochs for a in ("--epoch", f"{e[0]:g}:{e[1]:g}")],
    ]  # fmt: skip
    full_env = {**os.environ, **env}
    ka_cmd += ["--at", f"{t0:.6f}"]
    tcp_cmd += ["--at", f"{t0:.6f}"]
    logs = [tb.log_dir / "driver-kickass.log", tb.log_dir / "driver-tcp.log"]
    procs = [
        tb.built[host].popen(
            cmd, env=full_env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True
        )
        for host, cmd, log in (
            ("s1", ka_cmd, logs[0]),
            ("x1" if legacy else "s2", tcp_cmd, logs[1]),
        )
    ]

    def pump(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for raw in p.stdout:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            with lock:
                (progress if obj.get("type") == "progress" else done).append(obj)

    pumps = [threading.Thread(target=pump, args=(p,), daemon=True) for p in procs]
    for th in pumps:
        th.start()
    for p, log in zip(procs, logs, strict=True):
        try:
            rc = p.wait(START_AFTER_S + spec.duration_s + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise KickassError("a congestion driver did not finish") from None
        if rc != 0:
            raise KickassError(f"{log.name} exited {rc}: {log.read_text()[-600:]}")
    for th in pumps:
        th.join(10)
    return progress, done
