"""Experiment (d): the paper's wide-area evaluation (§IV-B) in miniature.

The paper put Kick-Ass receivers at ten places on the Internet, some in the
senders' city, others on the same continent and on others, and ran two
minutes of Kick-Ass flows then two of TCP flows to each in turn, 1..2000
packets, with the Kick-Ass router's access link at 10 and at 100 Mbit/s:
Kick-Ass was 1.2-4x faster than TCP; at 100 Mbit/s the bottleneck of the
deeper paths was "a non-Kick-Ass link further away from the sender" and a
same-continent flow spent 50% of its time in TCP mode in the median case.

Here the ten places are emulated paths behind one ka-router (the access
link): each receiver r<i> sits behind its own ka-linkem (in "emu", between
a<i> and b<i>), with the path's round trip and, on the deeper paths, a
legacy drop-tail bottleneck (one BDP of queue) that ka-router does not see::

    s1 ── ka-router ── wan0 ═ far (bridge) ═╦═ ka-linkem 4 ms ══ r1
          (the access link)                 ╠═ ...
                                            ╚═ ka-linkem 250 ms, 40 Mbit/s ══ r10

One round is ``kickass trials run`` to the ten agents (``trials.run_trial``:
the paired design, Kick-Ass and CUBIC periods replaying the same flows, the
light workload of §IV-A), one trial per path. Per path: the matched-flow
speedup with its interval over period pairs and completion per arm (the
rollups'), beside it the share of flows finished sooner with failures kept,
and the time in Kick-Ass mode as Σ ka_mode_ms / Σ FCT over the Kick-Ass
flows that completed (a flow that did not finish has no lifetime to
count). The largest goodput each arm reached on a path says whether the
senders could fill the access link at all (on two cores, 100 Mbit/s may be
CPU-bound), and the machine's CPU use over the round is kept beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kickass_analysis.rollups import ALL_SIZES

from .edge import ka_linkem, ka_router
from .topology import Bridge, End, Host, Link, Route, Topology
from .trials import TrialSpec, rate_bps, run_trial
from .wan import LAN_NET, WAN_NET, TestbedConfig, receiver_address, sender_address

KIND = "wide-area"
KICKASS_ARM, TCP_ARM = "kickass", "tcp:cubic"


@dataclass(frozen=True)
class PathSpec:
    """One receiver's path beyond our edge."""

    name: str
    region: str  # the paper's: same city, same continent, other continent
    rtt_ms: float
    # A legacy drop-tail link beyond ka-router (tc's spelling), or none.
    bottleneck: str | None = None


# Round trips from a metro path to an intercontinental one; the legacy links
# lie between the two access rates, so at 10 Mbit/s ka-router's link is every
# path's bottleneck and at 100 Mbit/s the deeper paths' is theirs. The
# 55 ms path is the paper's "same continent, approximately 2,000 miles".
PATHS: tuple[PathSpec, ...] = (
    PathSpec("city-1", "same city", 4.0),
    PathSpec("city-2", "same city", 8.0),
    PathSpec("city-3", "same city", 12.0),
    PathSpec("continent-1", "same continent", 30.0),
    PathSpec("continent-2", "same continent", 55.0, "50mbit"),
    PathSpec("continent-3", "same continent", 80.0),
    PathSpec("other-1", "other continent", 120.0),
    PathSpec("other-2", "other continent", 160.0, "30mbit"),
    PathSpec("other-3", "other continent", 200.0, "20mbit"),
    PathSpec("other-4", "other continent", 250.0, "40mbit"),
)


@dataclass
class WideAreaSpec:
    kind: str = KIND
    capacity_bps: float = 10e6
    paths: tuple[PathSpec, ...] = PATHS
    pairs: int = 2
    period_s: float = 8.0
    gap_s: float = 5.0
    # §IV-A's light load (the bench's light row) from one sender.
    mean_gap_s: float = 0.5
    mean_packets: float = 100.0
    max_packets: int = 2000
    seed: int = 24
    router_mode: str = "kickass"

    def __post_init__(self) -> None:
        if not self.paths or len({p.name for p in self.paths}) != len(self.paths):
            raise ValueError("need paths with distinct names")
        if not 1 <= len(self.paths) <= 20:
            raise ValueError("one to twenty paths")
        if self.pairs < 1 or self.period_s <= 0 or self.gap_s < 0:
            raise ValueError("need pairs >= 1, period_s > 0, gap_s >= 0")

    @property
    def rtt_ms(self) -> float:
        """The longest path's round trip (the run's ``rtt_ms``; each path has its own)."""
        return max(p.rtt_ms for p in self.paths)

    @property
    def duration_s(self) -> float:
        """The round's schedule: every path's pairs, one period per arm, gaps between."""
        return self.pairs * len(self.paths) * 2 * (self.period_s + self.gap_s)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["paths"] = [asdict(p) for p in self.paths]
        out["rtt_ms"] = self.rtt_ms
        out["duration_s"] = self.duration_s
        out["arms"] = [KICKASS_ARM, TCP_ARM]
        return out


def destination(i: int) -> str:
    """The agent of path ``i`` (1-based), as ``trials.start_agents`` names it."""
    return f"far-{i}"


def paths_topology(config: TestbedConfig, paths: Sequence[PathSpec]) -> Topology:
    """``wan.wan_topology``'s senders and ka-router, then one emulated path per
    receiver: beyond ka-router a bridge in "far" with a port per path, each
    into its own ka-linkem in "emu" (interfaces a<i> and b<i>) and on to r<i>,
    all one subnet (WAN_NET), so the trials' addresses and agents are those
    of the WAN testbed."""
    hosts = [Host("rtr", router=True), Host("emu"), Host("far")]
    bridges = [Bridge("rtr", "lan", (f"{LAN_NET}.1/24",)), Bridge("far", "sw")]
    links = [Link(End("rtr", "wan0", (f"{WAN_NET}.1/24",)), End("far", "up0", master="sw"))]
    routes: list[Route] = []
    processes = []
    for i in range(1, config.senders + 1):
        hosts.append(Host(f"s{i}"))
        links.append(
            Link(
                End(f"s{i}", "eth0", (f"{sender_address(i)}/24",)),
                End("rtr", f"s{i}", master="lan"),
            )
        )
        routes.append(Route(f"s{i}", "default", via=f"{LAN_NET}.1"))
    for i, p in enumerate(paths, 1):
        hosts.append(Host(f"r{i}"))
        links += [
            Link(End("far", f"p{i}", master="sw"), End("emu", f"a{i}", ipv6=False)),
            Link(
                End("emu", f"b{i}", ipv6=False),
                End(f"r{i}", "eth0", (f"{receiver_address(i)}/24",)),
            ),
        ]
        routes.append(Route(f"r{i}", "default", via=f"{WAN_NET}.1"))
        args = ["--delay", f"{p.rtt_ms / 2:g}ms"]
        if p.bottleneck:
            # One BDP at the legacy rate, in bytes, as the congestion experiments' queue.
            bdp = max(30 * 1500, int(rate_bps(p.bottleneck) / 8 * p.rtt_ms / 1000))
            args += ["--rate", p.bottleneck, "--queue", f"{bdp}b"]
        processes.append(
            ka_linkem(*args, a=f"a{i}", b=f"b{i}", host="emu", name=f"ka-linkem-{i}",
                      stdout="log", stderr="log")
        )  # fmt: skip
    router_args = ["--capacity", config.capacity, "--mode", config.mode, *config.router_args]
    processes.append(ka_router(*router_args, lan="lan", wan="wan0", stderr="log", settle=0.3))
    return Topology(
        name="kd",
        hosts=tuple(hosts),
        bridges=tuple(bridges),
        links=tuple(links),
        routes=tuple(routes),
        processes=tuple(processes),
    )


@dataclass
class WideAreaOutcome:
    """What a round gave, in the experiment store's shape (``to_json``)."""

    spec: dict[str, Any]
    started_at: str
    router_run_name: str
    paths: list[dict[str, Any]]
    summary: dict[str, Any]
    trials: dict[str, str] = field(default_factory=dict)  # destination -> trial id

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "started_at": self.started_at,
            "router_run_name": self.router_run_name,
            "paths": self.paths,
            "summary": self.summary,
            "trials": self.trials,
            # No epochs, no rates: a round of trials, stored as trials.
            "epochs": [],
            "alone": {},
            "drivers": [],
            "rates": {},
            "protocols": {},
        }


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def run_wide_area(
    spec: WideAreaSpec, database_url: str, *, keep_logs: bool = False
) -> WideAreaOutcome:
    """One round to every path; the trials stored in ``database_url``."""
    config = TestbedConfig(
        senders=1,
        receivers=len(spec.paths),
        capacity=f"{spec.capacity_bps / 1e6:g}mbit",
        rtt_ms=spec.rtt_ms,
        mode=spec.router_mode,
    )
    trial = TrialSpec(
        pairs=spec.pairs, period_s=spec.period_s, gap_s=spec.gap_s, mean_gap_s=spec.mean_gap_s,
        mean_packets=spec.mean_packets, max_packets=spec.max_packets, seed=spec.seed,
        arms=f"{KICKASS_ARM},{TCP_ARM}",
    )  # fmt: skip
    busy0, total0 = _cpu_ticks()
    t0 = time.monotonic()
    out = run_trial(
        database_url, config, trial, topology=paths_topology(config, spec.paths),
        keep_logs=keep_logs,
    )  # fmt: skip
    busy1, total1 = _cpu_ticks()
    trial_ids: dict[str, str] = {}
    for r in out.result["runs"]:
        trial_ids.update(r["trials"])
    paths = [
        path_figures(p, destination(i), trial_ids.get(destination(i)), out.flows, out.speedups)
        for i, p in enumerate(spec.paths, 1)
    ]
    starts = [p["period_started_at"] for p in out.periods if p.get("period_started_at")]
    started = min(starts).isoformat() if starts else None
    cpu = (busy1 - busy0) / (total1 - total0) if total1 > total0 else None
    return WideAreaOutcome(
        spec.to_json(),
        started or "",
        out.router_run_name,
        paths,
        summary(paths, cpu, time.monotonic() - t0, out.result.get("failed_flows", 0)),
        trial_ids,
    )


def _goodput(flows: list[Mapping[str, Any]]) -> float | None:
    """The largest payload rate one of ``flows`` reached over its lifetime."""
    rates = [f["size_bytes"] * 8 / (f["fct_ms"] / 1000) for f in flows if f["fct_ms"]]
    return max(rates, default=None)


def path_figures(
    path: PathSpec,
    dest: str,
    trial_id: str | None,
    flows: Sequence[Mapping[str, Any]],
    speedups: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """One path's row: its setting, and per arm flows, completion and the
    largest goodput; the speedup and the share finished sooner (the
    rollups' row of its trial over all sizes); the time in Kick-Ass mode."""
    mine = [f for f in flows if f["destination"] == dest]
    by_arm = {arm: [f for f in mine if f["arm"] == arm] for arm in (KICKASS_ARM, TCP_ARM)}
    done_ka = [f for f in by_arm[KICKASS_ARM] if f["fct_ms"] is not None]
    lifetime = sum(f["fct_ms"] for f in done_ka)
    in_ka = sum(
        f["ka_mode_ms"] if f.get("ka_mode_ms") is not None
        else f["fct_ms"] * (f["ka_mode_fraction"] or 0.0)
        for f in done_ka
    )  # fmt: skip
    row = next(
        (
            s
            for s in speedups
            if s.get("key") == trial_id
            and (s["arm"], s["baseline_arm"], s["size_bucket"]) == (KICKASS_ARM, TCP_ARM, ALL_SIZES)
        ),
        {},
    )
    min_rtts = [f["min_rtt_ms"] for f in by_arm[KICKASS_ARM] if f.get("min_rtt_ms")]
    return {
        "path": path.name,
        "region": path.region,
        "rtt_ms": path.rtt_ms,
        "bottleneck_bps": rate_bps(path.bottleneck) if path.bottleneck else None,
        "destination": dest,
        "trial_id": trial_id,
        "flows": {arm: len(fs) for arm, fs in by_arm.items()},
        "completed": {arm: sum(f["fct_ms"] is not None for f in fs) for arm, fs in by_arm.items()},
        "goodput_max_bps": {arm: _goodput(fs) for arm, fs in by_arm.items()},
        "min_rtt_ms_median": statistics.median(min_rtts) if min_rtts else None,
        "matched": row.get("matched"),
        "speedup": row.get("speedup"),
        "speedup_low": row.get("speedup_low"),
        "speedup_high": row.get("speedup_high"),
        "sooner": row.get("sooner"),
        "sooner_low": row.get("sooner_low"),
        "sooner_high": row.get("sooner_high"),
        "ka_mode_share": in_ka / lifetime if lifetime > 0 else None,
    }


def summary(
    paths: Sequence[Mapping[str, Any]], cpu_busy: float | None, seconds: float, failed: int
) -> dict[str, Any]:
    """Across the paths: the speedups' range and median, the median time in
    Kick-Ass mode (the paper's "in the median case"), the machine's CPU."""
    speedups = [p["speedup"] for p in paths if p.get("speedup") is not None]
    shares = [p["ka_mode_share"] for p in paths if p.get("ka_mode_share") is not None]
    return {
        "paths": len(paths),
        "speedup_min": min(speedups, default=None),
        "speedup_median": statistics.median(speedups) if speedups else None,
        "speedup_max": max(speedups, default=None),
        "ka_mode_share_median": statistics.median(shares) if shares else None,
        "failed_flows": failed,
        "cpu_busy": cpu_busy,
        "seconds": round(seconds, 1),
    }
