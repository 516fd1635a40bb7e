"""Realistic fragment-viability data, written through the real StudyStore API
(the engine's study events, ``StudyStore.apply``).

``seed_study(store, n_clients=40, rng=7)`` plays a small study: every
client is created, proves its UDP address, gets per-probe outcomes and a
verdict from the real rule (``kickass_core.verdict.decide``) exactly as the
engine would write them. Client kinds, assigned by quota so the shares hold
for any ``n_clients`` (then shuffled by ``rng``):

- ``clean``: light random loss p; a split datagram is lost if either of its
  two fragments is, so its drop rate is 1 - (1 - p)^2;
- ``intolerant`` (~8.3%, the paper's share of 405 clients): something on the
  path drops every fragment, whole packets pass;
- ``lossy``: 3-15% random loss, a third of the losses acknowledged too late;
- ``nat-reassembly``: a middlebox reassembles splits and forwards them whole
  (the client's IP_RECVFRAGSIZE reports 0);
- ``tunnel-mtu``: a 1460-byte MTU on the path re-fragments whole packets and
  split fragments larger than that.

Only Linux clients report IP_RECVFRAGSIZE; the others leave
``observed_frag_size`` NULL, as the real client does. About 15% of clients
run a second session with the same install id. With ``live=True`` one
session is left probing and one expired without a handshake, so views that
must skip unfinished sessions have something to skip.

The StudyStore stamps ``created_at``/``started_at``/``finished_at`` with now();
``spread`` backdates sessions over that much past time with two UPDATEs per
session (the only writes here that are not the StudyStore's, and only of
times) so time-series panels get more than one bucket: its start before any
outcome is written (a session's outcomes and its counts belong to the day it
was created), its end once it has finished. A client's repeat session is
always later than its first, so its latest verdict is its last session's.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kickass_core.plan import Probe, ProbePlan, expected_max_fragment
from kickass_core.study_events import (
    ClockAnchor,
    Heartbeat,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_core.verdict import decide
from kickass_db import partitions
from kickass_db.study_store import StudyStore
from sqlalchemy import text

PAPER_INTOLERANT_SHARE = 0.083  # 8.3% of 405 clients (Kick-Ass paper)
TUNNEL_MTU = 1460
SERVER_VERSION = "0.1.0"
PLATFORMS = ("Linux-x86_64", "Linux-aarch64", "Darwin-arm64", "Windows-AMD64")

# Kind -> share of clients; intolerant first so rounding never starves it.
KIND_SHARES: dict[str, float] = {
    "intolerant": PAPER_INTOLERANT_SHARE,
    "lossy": 0.12,
    "nat-reassembly": 0.08,
    "tunnel-mtu": 0.06,
}
KINDS = ("clean", *KIND_SHARES)


def default_plan() -> ProbePlan:
    """A coarse plan (48 sizes x 5) that keeps a 40-client study to ~10k rows."""
    return ProbePlan.build(repetitions=5, step=64, window=8)


@dataclass(frozen=True)
class SeededSession:
    session_id: str
    install_id: str
    kind: str
    state: str
    verdict: str | None
    platform: str


def seed_study(
    store: StudyStore,
    n_clients: int = 40,
    rng: random.Random | int = 0,
    *,
    plan: ProbePlan | None = None,
    spread: timedelta | None = None,
    live: bool = False,
) -> list[str]:
    """Seed a study; returns the session ids created (see module docstring)."""
    return [
        s.session_id
        for s in seed_study_detailed(store, n_clients, rng, plan=plan, spread=spread, live=live)
    ]


def seed_study_detailed(
    store: StudyStore,
    n_clients: int = 40,
    rng: random.Random | int = 0,
    *,
    plan: ProbePlan | None = None,
    spread: timedelta | None = None,
    live: bool = False,
) -> list[SeededSession]:
    """As seed_study, with each session's client kind, state and verdict."""
    r = rng if isinstance(rng, random.Random) else random.Random(rng)
    plan = plan or default_plan()
    now = datetime.now(UTC)
    kinds = assign_kinds(n_clients, r)
    seeded: list[SeededSession] = []
    for i, kind in enumerate(kinds):
        client = _Client(
            install_id=f"seed-{i:04d}-{r.getrandbits(32):08x}",
            kind=kind,
            platform=r.choice(PLATFORMS),
            address=_address(r),
            base_rtt_ms=r.uniform(8.0, 180.0),
            loss=_loss_for(kind, r),
        )
        runs = 2 if r.random() < 0.15 else 1
        # Drawn whether or not it is used, so ``spread`` changes times, not data.
        t0 = now - (spread or timedelta(0)) * r.random()
        for _ in range(runs):
            seeded.append(_run_session(store, client, plan, r, t0, backdate=spread is not None))
            t0 += (now - t0) * r.random()  # a repeat run comes later than the first
    if live and kinds:
        first = _Client(
            install_id=f"seed-live-{r.getrandbits(32):08x}",
            kind="clean",
            platform="Linux-x86_64",
            address=_address(r),
            base_rtt_ms=30.0,
            loss=0.0,
        )
        seeded.append(_run_session(store, first, plan, r, now, backdate=False, stop_after=17))
        seeded.append(_expired_session(store, r, now))
    return seeded


def assign_kinds(n_clients: int, rng: random.Random) -> list[str]:
    """Kinds by quota (largest shares rounded, rest clean), shuffled."""
    kinds: list[str] = []
    for kind, share in KIND_SHARES.items():
        kinds += [kind] * min(round(share * n_clients), n_clients - len(kinds))
    kinds += ["clean"] * (n_clients - len(kinds))
    rng.shuffle(kinds)
    return kinds


# -- internals ---------------------------------------------------------------


@dataclass(frozen=True)
class _Client:
    install_id: str
    kind: str
    platform: str
    address: str
    base_rtt_ms: float
    loss: float


def _loss_for(kind: str, r: random.Random) -> float:
    if kind == "lossy":
        return r.uniform(0.03, 0.15)
    return r.uniform(0.0, 0.012)


def _address(r: random.Random) -> str:
    # Documentation prefixes (RFC 5737): realistic-looking, never anyone's.
    prefix = r.choice(("192.0.2", "198.51.100", "203.0.113"))
    return f"{prefix}.{r.randrange(1, 255)}"


def _session_id(r: random.Random) -> str:
    return f"{r.getrandbits(64):016x}"


def _create(store: StudyStore, c: _Client, plan: ProbePlan, r: random.Random, t0: datetime) -> str:
    session_id = _session_id(r)
    store.create_session(
        session_id=session_id,
        cookie_hash=hashlib.sha256(r.randbytes(16)).digest(),
        plan=plan.to_json(),
        source_address=c.address,
        expires_at=t0 + timedelta(hours=3),
        server_version=SERVER_VERSION,
        client_version="0.1.0",
        platform=c.platform,
        install_id=c.install_id,
    )
    return session_id


def _run_session(
    store: StudyStore,
    c: _Client,
    plan: ProbePlan,
    r: random.Random,
    t0: datetime,
    *,
    backdate: bool,
    stop_after: int | None = None,
) -> SeededSession:
    session_id = _create(store, c, plan, r, t0)
    if backdate:
        _backdate_start(store, session_id, t0)
    handshake_rtt = c.base_rtt_ms * r.uniform(1.0, 1.3)
    store.apply(RunProbing(session_id, c.address, r.randrange(1024, 65536), handshake_rtt))
    n = plan.total_probes if stop_after is None else stop_after
    outcomes = [_outcome(c, plan, seq, r) for seq in range(n)]
    anchor = ClockAnchor(t0.timestamp(), 0.0)  # the outcomes' clock reads 0 at t0
    for start in range(0, len(outcomes), 500):  # batches, as the engine's writer does
        store.apply(OutcomeBatch(session_id, tuple(outcomes[start : start + 500]), anchor))
    if stop_after is not None:
        store.apply(Heartbeat(session_id, n, sum(o.outcome == "acked" for o in outcomes)))
        return SeededSession(session_id, c.install_id, c.kind, "probing", None, c.platform)
    # As the engine decides: a late acknowledgement counts as delivered.
    counts = {
        phase: (
            sum(o.phase == phase for o in outcomes),
            sum(o.phase == phase and o.outcome in ("acked", "late") for o in outcomes),
        )
        for phase in ("whole", "split")
    }
    late = sum(o.outcome == "late" for o in outcomes)
    v = decide(*counts["whole"], *counts["split"], late=late)
    store.apply(RunFinished(session_id, "complete", v.verdict, v.reason, None))
    if backdate:
        end = t0 + timedelta(seconds=max(o.acked_at or o.sent_at for o in outcomes))
        _backdate(store, session_id, t0, end)
    return SeededSession(session_id, c.install_id, c.kind, "complete", v.verdict, c.platform)


def _expired_session(store: StudyStore, r: random.Random, now: datetime) -> SeededSession:
    install_id = f"seed-expired-{r.getrandbits(32):08x}"
    c = _Client(install_id, "clean", "Windows-AMD64", _address(r), 50.0, 0.0)
    session_id = _create(store, c, default_plan(), r, now)
    store.apply(RunFinished(session_id, "expired", None, None, "handshake-timeout"))
    return SeededSession(session_id, c.install_id, c.kind, "expired", None, c.platform)


def _outcome(c: _Client, plan: ProbePlan, seq: int, r: random.Random) -> OutcomeEntry:
    probe = plan.probe(seq)
    # Paced at ~2 ms per probe (seconds after the session's t0): times only
    # need to be plausible and ordered.
    sent_at = (50 + 2 * seq) / 1000
    if probe.phase == "whole":
        delivered = r.random() >= c.loss
        frag = TUNNEL_MTU if c.kind == "tunnel-mtu" and probe.ip_len > TUNNEL_MTU else 0
    else:
        delivered = c.kind != "intolerant" and r.random() >= 1 - (1 - c.loss) ** 2
        frag = expected_max_fragment(probe.ip_len)
        if c.kind == "nat-reassembly":
            frag = 0
        elif c.kind == "tunnel-mtu":
            frag = min(frag, TUNNEL_MTU)
    if not delivered:
        # A third of a lossy path's losses are only late (queueing, not drops).
        if c.kind == "lossy" and r.random() < 1 / 3:
            rtt = c.base_rtt_ms * r.uniform(4.0, 8.0) + 3000.0
            return _acked(probe, sent_at, rtt, "late", frag, c, r)
        return OutcomeEntry(seq, probe.phase, probe.ip_len, "lost", sent_at, None, 0, None, None)
    rtt = c.base_rtt_ms * r.uniform(1.0, 1.25) + probe.ip_len * 0.0008
    return _acked(probe, sent_at, rtt, "acked", frag, c, r)


def _acked(
    probe: Probe,
    sent_at: float,
    rtt_ms: float,
    outcome: str,
    frag: int,
    c: _Client,
    r: random.Random,
) -> OutcomeEntry:
    return OutcomeEntry(
        seq=probe.seq,
        phase=probe.phase,
        ip_len=probe.ip_len,
        outcome=outcome,
        sent_at=sent_at,
        acked_at=sent_at + round(rtt_ms, 3) / 1000,  # the stored RTT: acked_at - sent_at
        ack_count=2 if r.random() < 0.002 else 1,
        received_len=probe.udp_payload_len,
        observed_frag_size=frag if c.platform.startswith("Linux") else None,
    )


_BACKDATE_START = text("""
UPDATE sessions SET created_at = :created_at, expires_at = :expires_at
WHERE session_id = :session_id
""")
_BACKDATE = text("""
UPDATE sessions
SET started_at = :started_at, finished_at = :finished_at, updated_at = :finished_at
WHERE session_id = :session_id
""")


def _backdate_start(store: StudyStore, session_id: str, t0: datetime) -> None:
    """The session created at ``t0``, its day's partition made (as an operator
    filling in past days would: ``kickass db partitions add``)."""
    with store.engine.begin() as conn:
        partitions.ensure(conn, "probe_outcomes", partitions.day_of(t0))
        conn.execute(
            _BACKDATE_START,
            {"session_id": session_id, "created_at": t0, "expires_at": t0 + timedelta(hours=3)},
        )


def _backdate(store: StudyStore, session_id: str, t0: datetime, end: datetime) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            _BACKDATE,
            {
                "session_id": session_id,
                "started_at": t0 + timedelta(milliseconds=40),
                "finished_at": end + timedelta(milliseconds=100),
            },
        )


def seed_trials(database_url: str, rng: int = 5, flows_per_period: int = 40) -> list[str]:
    """Interleaved trials towards two destinations, as `kickass trials run` uploads them.

    Kick-Ass flows finish in about size/rate + 2 RTT and spend most of their
    time in Kick-Ass mode; TCP flows pay slow start. Returns the trial ids.
    """
    from kickass_core.flow_record import flow_id
    from kickass_db.trial_store import TrialStore

    r = random.Random(rng)
    store = TrialStore(database_url)
    runner = store.authenticate(store.add_runner(f"seed-{r.randrange(10**6)}"))
    now = datetime.now(UTC)
    ids = []
    try:
        for dest in ("far-1", "far-2"):
            tid = f"{r.getrandbits(128):032x}"
            ids.append(tid)
            t0 = now - timedelta(days=r.uniform(1, 10))
            store.put_trial(
                runner,
                {
                    "trial_id": tid, "destination": dest, "access_capacity_bps": 10e6,
                    "parameters": {"seed": rng}, "versions": {}, "started_at": t0.isoformat(),
                    "periods": [
                        {"index": i, "pair": i // 2, "protocol": p, "start_s": 120 * i,
                         "duration_s": 120}
                        for i, p in enumerate(("kickass", "tcp", "tcp", "kickass"))
                    ],
                },
            )  # fmt: skip
            flows = []
            for period, proto in enumerate(("kickass", "tcp", "tcp", "kickass")):
                for k in range(flows_per_period):
                    size = min(2000, max(1, int(45 / (1 - r.random()) ** (1 / 1.8))))
                    rtt = 100.0
                    if proto == "kickass":
                        fct = size * 1.2 + 2 * rtt + r.uniform(0, 20)
                        frac = min(1.0, r.uniform(0.9, 1.05))
                    else:
                        fct = size * 1.2 + rtt * (2 + math.log2(max(size, 1))) + r.uniform(0, 40)
                        frac = None
                    i = period * 1000 + k
                    flows.append(
                        {
                            "flow_id": flow_id(tid, 0, i), "period_index": period,
                            "protocol": proto,
                            "congestion_control": None if proto == "kickass" else "cubic",
                            "size_bytes": size * 1440, "size_packets": size,
                            "started_at": (t0 + timedelta(seconds=period * 120 + k)).isoformat(),
                            "completed": True, "fct_ms": fct, "ka_mode_fraction": frac,
                            "mode_switches": 0 if frac == 1.0 else (1 if frac else None),
                        }
                    )  # fmt: skip
            store.put_flows(runner, tid, flows)
    finally:
        store.close()
    return ids


# -- the paired trials, the router, RIPE Atlas and the schedule (issue 20) ----


def seed_paired_trials(
    database_url: str,
    rng: int = 5,
    *,
    destinations: tuple[str, ...] = ("far-1", "far-2"),
    pairs: int = 2,
    flows_per_period: int = 30,
    router_run_name: str | None = "edge-10mbit",
    fallbacks: int = 0,
) -> list[str]:
    """Paired trials as `kickass trials run` uploads them (issue 18's design).

    Per destination one trial of ``pairs`` pairs; the two periods of a pair
    (arms ``kickass`` and ``tcp:cubic``, order drawn per pair) replay the same
    flows: the same sizes and start offsets under each arm. Kick-Ass flows
    finish in about size x 1.2 ms + 2 RTT and spend most of their time in
    Kick-Ass mode; TCP flows pay slow start (log2(size) RTTs). One Kick-Ass flow
    and two TCP flows of each trial do not complete. Periods start up to half
    a second late (``actual_start_s``). The first ``fallbacks`` Kick-Ass flows
    of each trial's pair 0 fell back to TCP from the start (negotiated
    ``tcp``: a TCP-like FCT, no time in Kick-Ass mode). Returns the trial ids.
    """
    from kickass_core.flow_record import flow_id
    from kickass_db.trial_store import TrialStore

    r = random.Random(rng)
    store = TrialStore(database_url)
    runner = store.authenticate(store.add_runner(f"seed-paired-{r.randrange(10**6)}"))
    now = datetime.now(UTC)
    arms = {"kickass": "kickass", "tcp:cubic": "tcp"}
    period_s, gap_s, rtt = 120.0, 10.0, 100.0
    ids = []
    try:
        for dest in destinations:
            tid = f"{r.getrandbits(128):032x}"
            ids.append(tid)
            t0 = now - timedelta(days=r.uniform(1, 10))
            periods: list[dict[str, Any]] = []
            for pair in range(pairs):
                order = list(arms)
                r.shuffle(order)
                for arm in order:
                    i = len(periods)
                    start = i * (period_s + gap_s)
                    periods.append(
                        {"index": i, "pair": pair, "protocol": arms[arm], "arm": arm,
                         "congestion_control": "cubic" if arms[arm] == "tcp" else None,
                         "handshake": "padded" if arms[arm] == "kickass" else None,
                         "start_s": start, "duration_s": period_s,
                         "actual_start_s": start + r.uniform(0.0, 0.5)}
                    )  # fmt: skip
            store.put_trial(
                runner,
                {
                    "trial_id": tid, "destination": dest, "access_capacity_bps": 10e6,
                    "router_run_name": router_run_name,
                    "parameters": {
                        "pairs": pairs, "period_s": period_s, "gap_s": gap_s, "paired": True,
                        "workload": {"mean_packets": 100.0, "shape": 1.8, "seed": rng},
                        "arms": [{"name": a, "protocol": p} for a, p in arms.items()],
                    },
                    "versions": {}, "started_at": t0.isoformat(), "periods": periods,
                },
            )  # fmt: skip
            # The pair's flows, drawn once: what both arms of the pair replay.
            workload = {
                pair: [
                    (min(2000, max(1, int(45 / (1 - r.random()) ** (1 / 1.8)))), k * 3.0)
                    for k in range(flows_per_period)
                ]
                for pair in range(pairs)
            }
            failed = {("kickass", 0, 3), ("tcp:cubic", 0, 5), ("tcp:cubic", pairs - 1, 7)}
            flows = []
            for p in periods:
                for k, (size, offset) in enumerate(workload[p["pair"]]):
                    fell_back = p["arm"] == "kickass" and p["pair"] == 0 and k < fallbacks
                    negotiated = "tcp" if fell_back else p["protocol"]
                    if p["arm"] == "kickass" and not fell_back:
                        fct = size * 1.2 + 2 * rtt + r.uniform(0, 20)
                        frac: float | None = min(1.0, r.uniform(0.9, 1.05))
                    elif fell_back:
                        fct = size * 1.2 + rtt * (2 + math.log2(size)) + r.uniform(0, 40)
                        frac = 0.0
                    else:
                        fct = size * 1.2 + rtt * (2 + math.log2(size)) + r.uniform(0, 40)
                        frac = None
                    done = (p["arm"], p["pair"], k) not in failed
                    started = t0 + timedelta(seconds=p["actual_start_s"] + offset)
                    flows.append(
                        {"flow_id": flow_id(tid, p["index"], k), "period_index": p["index"],
                         "pair": p["pair"], "arm": p["arm"], "protocol": p["protocol"],
                         "congestion_control": p["congestion_control"],
                         "handshake": p["handshake"], "negotiated_protocol": negotiated,
                         "size_bytes": size * 1440, "size_packets": size,
                         "started_at": started.isoformat(), "completed": done,
                         "fct_ms": fct if done else None,
                         "ka_mode_fraction": frac if done else None,
                         "mode_switches": None if frac is None else int(0 < frac < 1),
                         "queued_ms": 0.0, "error": None if done else "timeout"}
                    )  # fmt: skip
            store.put_flows(runner, tid, flows)
    finally:
        store.close()
    return ids


ROUTER_RUNS = (("edge-10mbit", 10e6), ("edge-100mbit", 100e6))


def seed_router(
    database_url: str,
    rng: int = 7,
    *,
    runs: tuple[tuple[str, float], ...] = ROUTER_RUNS,
    seconds: float = 60.0,
    interval_s: float = 0.01,
) -> list[int]:
    """Router runs as `kickass telemetry ingest` stores ka-router's NDJSON.

    Every run is fed line by line through the real ingest (metadata, one
    sample per 10 ms control interval, exit). The advertised rate follows an
    RCP-like approach to the capacity and its leading-fragment length is the
    paper's encoding of it (``kickass_core.rate``). The 10 Mbit/s run stays in
    Kick-Ass mode; faster ones spend about half their time in TCP mode
    (unresponsive traffic fills the queue past half the buffer: the paper's
    100 Mbit/s path), in bursts of a few seconds. Returns the run ids.
    """
    import json

    from kickass_core.rate import leading_fragment_len
    from kickass_db.telemetry import TelemetryIngest

    r = random.Random(rng)
    now = datetime.now(UTC).timestamp()
    ids = []
    for n, (name, capacity) in enumerate(runs):
        start = now - 86400 * (2 + n) - seconds
        buffer = capacity / 8 * 0.1  # one 100 ms BDP
        lines = [
            json.dumps({"type": "metadata", "started_unix": start, "program_version": "seed",
                        "options": {"router": {"kind": "kickass", "capacity_bps": capacity}}})
        ]  # fmt: skip
        rate, drops, fragmented, switches, mode = 0.05 * capacity, 0, 0, 0, "kickass"
        tcp_until = -1.0
        steps = int(seconds / interval_s)
        for i in range(steps):
            t = i * interval_s
            if capacity > 20e6 and t >= tcp_until + 2.0 and r.random() < 0.0025:
                tcp_until = t + r.uniform(2.0, 6.0)  # a burst of unresponsive traffic
            new_mode = "tcp" if t < tcp_until else "kickass"
            switches += new_mode != mode
            mode = new_mode
            load = capacity * (1.05 if mode == "tcp" else r.uniform(0.85, 1.0))
            queue = buffer * (r.uniform(0.55, 0.95) if mode == "tcp" else r.uniform(0.0, 0.1))
            rate = min(capacity, max(120e3, rate * (1 + 0.1 * (capacity - rate) / capacity)))
            length = leading_fragment_len(rate / 8 / 1000) if mode == "kickass" else None
            fragmented += int(load / 8 / 1500 * interval_s) if length else 0
            drops += int(r.random() < 0.01) if mode == "tcp" else 0
            lines.append(
                json.dumps({"type": "sample", "t": round(t, 3), "ts": start + t,
                            "advertised_rate_bps": rate, "leading_fragment_len": length,
                            "input_rate_bps": load, "output_rate_bps": min(load, capacity),
                            "queue_bytes": int(queue), "queue_packets": int(queue // 1500),
                            "marking_mode": mode, "rtt_ms": round(r.uniform(95.0, 110.0), 2),
                            "drops": drops, "fragmented": fragmented,
                            "mode_switches": switches})
            )  # fmt: skip
        counters = {"drops": drops, "fragmented": fragmented}
        lines.append(
            json.dumps({"type": "exit", "ts": start + seconds, "reason": "signal",
                        "counters": counters})
        )  # fmt: skip
        # Past days: their partitions made first, as for any old capture.
        with partitions.Partitions(database_url) as days:
            days.ensure_days(
                "router_telemetry",
                partitions.day_of(datetime.fromtimestamp(start, UTC)),
                partitions.day_of(datetime.fromtimestamp(start + seconds, UTC)),
            )
        ingest = TelemetryIngest(database_url, name)
        try:
            summary = ingest.feed(lines)
        finally:
            ingest.close()
        ids.append(int(summary["run_id"]))
    return ids


# Probe countries and networks (documentation ASNs, RFC 5398).
ATLAS_PROBES = (
    (6001, "NL", 64496), (6002, "NL", 64496), (6003, "NL", 64497), (6004, "DE", 64498),
    (6005, "DE", 64498), (6006, "DE", 64499), (6007, "US", 64500), (6008, "US", 64500),
    (6009, "US", 64501), (6010, "BR", 64502), (6011, "BR", 64502), (6012, "JP", 64503),
)  # fmt: skip
ATLAS_INTOLERANT = (6006, 6011)  # something on their paths drops every fragment


def seed_atlas(database_url: str, rng: int = 9, *, results_per_probe: int = 3) -> str:
    """A RIPE Atlas campaign as `kickass atlas create|fetch` stores it.

    Through the real AtlasStore: the campaign, its measurements (the split
    sweep in one, whole sizes one each), the probes' metadata (country, ASN),
    results with their per-packet outcomes (joined ``exact``; a split
    result's packets cycle through the sweep's leading-fragment lengths) and
    the verdicts by the volunteers' rule. Two of the twelve probes drop every
    fragment; one in twenty requests never reaches the responder. Returns the
    campaign's name.
    """
    from kickass_atlas.campaign import Campaign
    from kickass_atlas.store import AtlasStore, OutcomeRow, ResultRow

    r = random.Random(rng)
    campaign = Campaign.from_dict(
        {
            "name": "seed-atlas",
            "target": {"whole": "192.0.2.10", "split": "192.0.2.11"},
            "probes": {"ids": [p for p, _, _ in ATLAS_PROBES]},
            "whole": {"sizes": [576, 1000, 1480]},
            "split": {"leading": [68, 300, 604, 916, 1204, 1484]},
            "packets": 16,
            "interval": 3600,
            "packet_interval": 1000,
            "duration": 86400,
            "credit_budget": 1_000_000,
        }
    )
    now = datetime.now(UTC)
    with AtlasStore(database_url) as store:
        cid = store.upsert_campaign(campaign)
        store.upsert_probes(
            [{"id": p, "country_code": cc, "asn_v4": asn, "address_v4": f"198.51.100.{p - 6000}",
              "status": {"id": 1, "name": "Connected"}, "is_anchor": False}
             for p, cc, asn in ATLAS_PROBES]
        )  # fmt: skip
        for m, planned in enumerate(campaign.plan(all_sizes=True).measurements):
            msm_id = 5_000_000 + m
            store.record_measurement(cid, msm_id, planned, planned.definition("seed"), None)
            store.update_measurement(
                msm_id, status_id=2 if m else 4, status_name="Ongoing" if m else "Stopped",
                credits_per_result=planned.credits_per_result,
                start_time=now - timedelta(days=3),
            )  # fmt: skip
            results, outcomes = [], []
            for prb_id, _, _ in ATLAS_PROBES:
                for k in range(results_per_probe):
                    at = now - timedelta(days=2, hours=-8 * k, seconds=r.uniform(0, 600))
                    counts = {"sent": 0, "rcvd": 0}
                    for i in range(planned.packets):
                        if planned.phase == "split":
                            ip_len: int = campaign.splits[i % len(campaign.splits)]
                            lost = prb_id in ATLAS_INTOLERANT or r.random() < 0.03
                        else:
                            ip_len = planned.ip_len
                            lost = r.random() < 0.02
                        outcome = "unanswered" if r.random() < 0.05 else (
                            "lost" if lost else "acked")  # fmt: skip
                        rtt = round(r.uniform(10.0, 200.0), 3) if outcome == "acked" else None
                        counts["sent"] += 1
                        counts["rcvd"] += outcome == "acked"
                        outcomes.append(
                            OutcomeRow(msm_id, prb_id, at, i, cid, planned.phase, ip_len,
                                       outcome, rtt, int(outcome == "acked"),
                                       None if outcome == "unanswered" else i,
                                       at + timedelta(seconds=i) if rtt else None, None)
                        )  # fmt: skip
                    results.append(
                        ResultRow(msm_id, prb_id, at, cid, 5080, f"198.51.100.{prb_id - 6000}",
                                  planned.target, planned.size, counts["sent"], counts["rcvd"],
                                  0, "exact", {"prb_id": prb_id, "msm_id": msm_id, "seed": True})
                    )  # fmt: skip
            store.store_chunk(msm_id, results, outcomes, now - timedelta(hours=1))
        store.refresh_verdicts(cid)
    return campaign.name


# name, kind, period, outcomes of the last runs (newest last), hours ago of the newest
SCHEDULE = (
    ("refresh-hourly", "refresh", timedelta(hours=1), ["ok"] * 47 + ["running"], 0.0),
    ("atlas-nightly", "atlas", timedelta(days=1), ["ok"] * 6 + ["failed", "ok", "timeout"], 3.0),
    ("trials-6h", "trials", timedelta(hours=6), ["ok"] * 8 + ["failed"] * 4, 1.0),
    ("export-daily", "export", timedelta(days=1), ["ok"] * 5, 96.0),
)
FAILURE_REASONS = {
    "failed": "atlas: 429 Too Many Requests (rate limited); retried next run",
    "timeout": "still running after timeout_s=3600",
}


def seed_item_runs(database_url: str) -> list[str]:
    """Scheduled runs as `kickass schedule run` records them in ``item_runs``.

    Written with plain INSERTs (the table of migration 0011; the scheduler's
    store claims and finishes the same rows). ``trials-6h`` has failed its last
    four runs (no ok run for a day), ``export-daily`` last ran four days ago
    (overdue against its daily period), ``atlas-nightly`` has a failure and a
    timeout with a dead attempt in its history, ``refresh-hourly`` is running.
    Returns the item names.
    """
    import json

    import kickass_db as db

    now = datetime.now(UTC).replace(microsecond=0)
    rows = []
    for item, kind, period, outcomes, hours_ago in SCHEDULE:
        newest = now - timedelta(hours=hours_ago)
        for back, outcome in enumerate(reversed(outcomes)):
            due = newest - period * back
            finished = None if outcome == "running" else due + timedelta(seconds=30 + back)
            history = (
                [{"host": "sched-b", "claimed_at": due.isoformat(), "why": "heartbeat stale"}]
                if outcome == "timeout"
                else []
            )
            rows.append(
                {"item": item, "kind": kind, "due": due, "host": "sched-a",
                 "attempt": 1 + len(history), "claimed": due + timedelta(seconds=1),
                 "heartbeat": finished or now, "finished": finished, "outcome": outcome,
                 "reason": FAILURE_REASONS.get(outcome),
                 "counts": json.dumps({"results": 10 * back} if outcome == "ok" else {}),
                 "history": json.dumps(history)}
            )  # fmt: skip
    engine = db.make_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("""
                    INSERT INTO item_runs (item, kind, due_at, host, attempt, claimed_at,
                        heartbeat_at, finished_at, outcome, reason, counts, history)
                    VALUES (:item, :kind, :due, :host, :attempt, :claimed, :heartbeat,
                        :finished, :outcome, :reason, CAST(:counts AS jsonb),
                        CAST(:history AS jsonb))
                """),
                rows,
            )
    finally:
        engine.dispose()
    return [s[0] for s in SCHEDULE]
