"""A congestion experiment's outcome without namespaces, for the store, the
command and the report (issue 24 item 6).

``synthetic_outcome`` plays experiment (a) (§III-D1, Fig. 5), (b) (§III-D2,
Fig. 7) or the TCP-mode floor at the testbed's scale (8 Kick-Ass and 8 TCP
flows, 20 Mbit/s, 100 ms, TCP on from 8 to 20 s of 28) as the drivers
report it: each flow's payload rate and mode every 100 ms, and the router's
samples every 50 ms. The figures are computed by the real code
(``kickass_testbed.congestion.figures``), so what is stored and shown is what
a real run would store and show from such rates.

* (a): Kick-Ass alone at its fair share; at 8 s the TCP flows start, the
  router enters TCP mode 1.5 RTT later (its queue past half the buffer), the
  Kick-Ass flows follow one RTT after; everyone gets about capacity / 16;
  at 20 s the TCP flows stop, the router is back in Kick-Ass mode 3.5 RTT
  later and the flows one RTT after that.
* (b): the same flows, but the router never leaves Kick-Ass mode (the
  congestion is at the legacy link behind it): the Kick-Ass flows find it
  by their losses, 2 RTT into the epoch, and are back 2 RTT after it.
* floor: ka-router in drop-tail mode: the Kick-Ass flows run in TCP mode
  throughout and its samples say ``droptail``.

``seed_router_telemetry`` stores the router's samples as `kickass telemetry
ingest` stores ka-router's lines, aligned with the flows' clock by their
wall-clock ``ts``.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kickass_testbed.congestion import (
    WIRE_PER_PAYLOAD,
    CongestionOutcome,
    CongestionSpec,
    figures,
)

SPEC = CongestionSpec()
# The router's switches, seconds from the epoch's start and end (a).
ROUTER_ENTERS_S, ROUTER_LEAVES_S = 0.15, 0.35
# (b): the endpoints' own, by their losses.
FLOWS_ENTER_S, FLOWS_LEAVE_S = 0.2, 0.2


def _kind(experiment: str) -> tuple[str, str]:
    return {
        "a": ("kickass-bottleneck", "kickass"),
        "b": ("legacy-bottleneck", "kickass"),
        "floor": ("kickass-bottleneck", "droptail"),
    }[experiment]


def router_mode_at(experiment: str, t: float, spec: CongestionSpec = SPEC) -> str:
    if experiment == "floor":
        return "droptail"
    if experiment == "b":
        return "kickass"
    for a, b in spec.epochs:
        if a + ROUTER_ENTERS_S <= t < b + ROUTER_LEAVES_S:
            return "tcp"
    return "kickass"


def _flows_in_tcp_mode(experiment: str, t: float, spec: CongestionSpec) -> bool:
    if experiment == "floor":
        return True
    enter, leave = (
        (ROUTER_ENTERS_S + 0.1, ROUTER_LEAVES_S + 0.1)
        if experiment == "a"
        else (FLOWS_ENTER_S, FLOWS_LEAVE_S)
    )
    return any(a + enter <= t < b + leave for a, b in spec.epochs)


def synthetic_outcome(
    experiment: str = "a",
    *,
    started_at: datetime | None = None,
    seed: int = 3,
    router_run_name: str | None = "exp-router",
) -> dict[str, Any]:
    """An outcome's JSON (``CongestionOutcome.to_json()``) as ``run_congestion``
    returns it, figures computed by ``congestion.figures``."""
    kind, mode = _kind(experiment)
    spec = replace(SPEC, kind=kind, router_mode=mode)
    r = random.Random(seed)
    cap = spec.capacity_bps
    steps = int(round(spec.duration_s / spec.interval_s))
    ka_flows = [f"ka-{i}" for i in range(spec.kickass_flows)]
    tcp_flows = [f"tcp-{i}" for i in range(spec.tcp_flows)]
    protocols = {**dict.fromkeys(ka_flows, "kickass"), **dict.fromkeys(tcp_flows, "tcp")}
    rates: dict[str, list[tuple[float, float, bool]]] = {f: [] for f in protocols}
    # While TCP is on, some flows get more than others (Jain about 0.98).
    bias = {f: r.uniform(0.8, 1.2) for f in protocols}
    for k in range(1, steps + 1):
        t = round(k * spec.interval_s, 4)
        tcp_on = any(a <= t < b for a, b in spec.epochs)
        share = cap / (len(protocols) if tcp_on else len(ka_flows))
        in_tcp_mode = _flows_in_tcp_mode(experiment, t, spec)
        for f, proto in protocols.items():
            if proto == "tcp" and not tcp_on:
                continue
            rate = (
                share / WIRE_PER_PAYLOAD[proto] * r.uniform(0.9, 1.0) * (bias[f] if tcp_on else 1)
            )
            rates[f].append((t, rate, proto == "kickass" and not in_tcp_mode))
    router = []
    for k in range(int(spec.duration_s / 0.05) + 1):
        t = round(k * 0.05, 4)
        m = router_mode_at(experiment, t, spec)
        queue = int(cap / 8 * 0.1 * (0.7 if m == "tcp" else 0.05))
        router.append((t, m, 0.95 * cap if m == "kickass" else 0.0, queue))
    epochs, alone = figures(spec, rates, protocols, router)
    drivers = [
        {"type": "done", "protocol": "kickass",
         "flows": {f: {"error": None, "mode_switches": 2, "retransmissions": 4} for f in ka_flows}},
        {"type": "done", "protocol": "tcp",
         "flows": {f: {"error": None, "completed": False, "retransmissions": 11}
                   for f in tcp_flows},
         "netstat": {"TCPTimeouts": 0, "TCPSackRecovery": 40}},
    ]  # fmt: skip
    started = started_at or datetime.now(UTC) - timedelta(hours=1)
    outcome = CongestionOutcome(
        spec=asdict(spec),
        epochs=epochs,
        rates=rates,
        protocols=protocols,
        router=router,
        router_run_name=router_run_name,  # type: ignore[arg-type]  # None: a run without a router, which the store takes
        alone=alone,
        drivers=drivers,
        windows={},
        started_at=started.isoformat(),
    )
    # As the command has it: through JSON (tuples are lists).
    return json.loads(json.dumps(outcome.to_json()))


def seed_router_telemetry(database_url: str, outcome: dict[str, Any]) -> None:
    """The outcome's router samples through the real ingest, under its
    ``router_run_name``: the router started 5 s before the flows."""
    from kickass_db.telemetry import TelemetryIngest

    t0 = datetime.fromisoformat(outcome["started_at"]).timestamp()
    spec = outcome["spec"]
    kind = "droptail" if spec["router_mode"] == "droptail" else "kickass"
    lines = [
        json.dumps({"type": "metadata", "started_unix": t0 - 5.0, "program_version": "seed",
                    "options": {"router": {"kind": kind, "capacity_bps": spec["capacity_bps"]}}})
    ]  # fmt: skip
    for t, mode, rate, queue in outcome["router"]:
        lines.append(
            json.dumps({"type": "sample", "t": round(t + 5.0, 4), "ts": t0 + t,
                        "advertised_rate_bps": rate, "input_rate_bps": 0.9 * spec["capacity_bps"],
                        "queue_bytes": queue, "marking_mode": mode, "drops": 0,
                        "fragmented": 0})
        )  # fmt: skip
    lines.append(
        json.dumps({"type": "exit", "ts": t0 + spec["duration_s"] + 1, "reason": "signal"})
    )
    ingest = TelemetryIngest(database_url, outcome["router_run_name"])
    try:
        ingest.feed(line + "\n" for line in lines)
    finally:
        ingest.close()


def router_tcp_intervals(outcome: dict[str, Any]) -> int:
    """How many separate intervals the outcome's router spent in TCP mode."""
    n, prev = 0, None
    for _, mode, *_ in outcome["router"]:
        n += mode == "tcp" and prev != "tcp"
        prev = mode
    return n
