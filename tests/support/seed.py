"""Realistic fragment-viability data, written through the real StudyStore API.

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
``spread`` backdates sessions over that much past time with one UPDATE per
session (the only write here that is not the StudyStore's, and only of times) so
time-series panels get more than one bucket. A client's repeat session is
always later than its first, so its latest verdict is its last session's.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kickass_core.plan import Probe, ProbePlan, expected_max_fragment
from kickass_core.verdict import decide
from kickass_db.study_store import ProbeOutcome, StudyStore
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
    handshake_rtt = c.base_rtt_ms * r.uniform(1.0, 1.3)
    store.mark_probing(session_id, c.address, r.randrange(1024, 65536), handshake_rtt)
    n = plan.total_probes if stop_after is None else stop_after
    outcomes = [_outcome(c, plan, seq, r, t0) for seq in range(n)]
    for start in range(0, len(outcomes), 500):  # batches, as the engine's writer does
        store.record_outcomes(session_id, outcomes[start : start + 500])
    if stop_after is not None:
        store.heartbeat(session_id, n, sum(o.outcome == "acked" for o in outcomes))
        return SeededSession(session_id, c.install_id, c.kind, "probing", None, c.platform)
    counts = {
        phase: (
            sum(o.phase == phase for o in outcomes),
            sum(o.phase == phase and o.outcome == "acked" for o in outcomes),
        )
        for phase in ("whole", "split")
    }
    v = decide(*counts["whole"], *counts["split"])
    store.finish_session(session_id, "complete", v.verdict, v.reason)
    if backdate:
        end = max(o.acked_at or o.sent_at for o in outcomes)
        _backdate(store, session_id, t0, end)
    return SeededSession(session_id, c.install_id, c.kind, "complete", v.verdict, c.platform)


def _expired_session(store: StudyStore, r: random.Random, now: datetime) -> SeededSession:
    install_id = f"seed-expired-{r.getrandbits(32):08x}"
    c = _Client(install_id, "clean", "Windows-AMD64", _address(r), 50.0, 0.0)
    session_id = _create(store, c, default_plan(), r, now)
    store.finish_session(session_id, "expired", None, None, end_reason="handshake-timeout")
    return SeededSession(session_id, c.install_id, c.kind, "expired", None, c.platform)


def _outcome(c: _Client, plan: ProbePlan, seq: int, r: random.Random, t0: datetime) -> ProbeOutcome:
    probe = plan.probe(seq)
    # Paced at ~2 ms per probe: times only need to be plausible and ordered.
    sent_at = t0 + timedelta(milliseconds=50 + 2 * seq)
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
        return ProbeOutcome(seq, probe.phase, probe.ip_len, sent_at, "lost")
    rtt = c.base_rtt_ms * r.uniform(1.0, 1.25) + probe.ip_len * 0.0008
    return _acked(probe, sent_at, rtt, "acked", frag, c, r)


def _acked(
    probe: Probe,
    sent_at: datetime,
    rtt_ms: float,
    outcome: str,
    frag: int,
    c: _Client,
    r: random.Random,
) -> ProbeOutcome:
    return ProbeOutcome(
        seq=probe.seq,
        phase=probe.phase,
        ip_len=probe.ip_len,
        sent_at=sent_at,
        outcome=outcome,
        acked_at=sent_at + timedelta(milliseconds=rtt_ms),
        rtt_ms=round(rtt_ms, 3),
        ack_count=2 if r.random() < 0.002 else 1,
        received_len=probe.udp_payload_len,
        observed_frag_size=frag if c.platform.startswith("Linux") else None,
    )


_BACKDATE = text("""
UPDATE sessions
SET created_at = :created_at, started_at = :started_at, finished_at = :finished_at,
    expires_at = :expires_at, updated_at = :finished_at
WHERE session_id = :session_id
""")


def _backdate(store: StudyStore, session_id: str, t0: datetime, end: datetime) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            _BACKDATE,
            {
                "session_id": session_id,
                "created_at": t0,
                "started_at": t0 + timedelta(milliseconds=40),
                "finished_at": end + timedelta(milliseconds=100),
                "expires_at": t0 + timedelta(hours=3),
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
