"""`kickass trials run`: interleaved periods of Kick-Ass and TCP towards remote agents.

For each destination agent, the schedule (``schedule.interleaved``) holds
pairs of periods, one per arm (Kick-Ass; TCP with CUBIC, Reno or BBR), in an
order drawn per pair. Both periods of a pair replay the same flows
(``workload.pair_flows``: sizes and start offsets), so every flow is matched
with itself under the other arm. Each period starts at its scheduled time
(the drift is measured and stored); on-off senders start flows at the
workload's exponential gaps, open loop: a slow flow does not delay the next.

Both protocols are treated alike: at most ``max_concurrent`` flows in
progress at once (a flow due while that many run waits, and its wait is
stored as ``queued_ms``); each flow's clock starts when it is due, so its
completion time includes its wait; one timeout from the time it is due, cut
short at the end of its period plus ``gap_s``; a flow that does not complete
is stored as such (censored), never dropped. Kick-Ass flows run in one
``ka-send`` process per period; TCP flows are kernel TCP sockets
(``tcpflow``). The TCP metrics cache is disabled for the trial where the
runner may (``environment.MetricsCache``), and the environment of both ends
is stored with the trial.

Every flow's record is spooled to disk as soon as it finishes and uploaded to
the server (signed requests); what the server cannot take now stays spooled
for `kickass trials upload`.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kickass_core import flow_record, signing
from kickass_core.errors import KickassError

from .. import __version__, environment
from ..tcpflow import TIMED_OUT, send_flow
from .schedule import KICKASS, TCP, Arm, Period, default_arms, interleaved
from .spool import Spool
from .uploader import Uploader
from .workload import Flow, Workload, pair_flows, tcp_share_indices

log = logging.getLogger("kickass.trials")

# First wait before asking an unreachable agent for tokens again (doubling).
TOKEN_RETRY_FIRST_S = 0.5
# A period that starts later than this after its scheduled time is reported.
LATE_START_S = 1.0
# The quiet before a period: the previous period's flows are cut this long
# before it starts (at most half the gap).
QUIET_S = 1.0
# Why a flow still running at its period's deadline failed, for both protocols.
CUT_AT_DEADLINE = "not completed by the end of its period (cut at the deadline)"
# Why a flow did not complete when the trial was stopped (Ctrl-C, a scheduled
# round's timeout): cut while running, or never started.
CUT_BY_STOP = "interrupted: the trial was stopped while it ran"
NOT_RUN_STOPPED = "not run: the trial was stopped before it was due"
# An upload between periods needs this much time left before the next start,
# beyond twice what the last upload took, and is cut this long before it.
UPLOAD_MARGIN_S = 0.5
# A period's flow tokens are fetched this long before it starts, during the
# period before it: time for a slow answer and a retry over a loaded path,
# while an agent that goes away shortly before a period still costs only
# that period (tokens live for the agent's lifetime, 600 s by default).
TOKENS_AHEAD_S = 5.0

# A period's flow tokens and the agent's port per kind of flow (kickass, tcp),
# or why it has none.
Tokens = dict[str, tuple[list[bytes], int]] | str
# A closed loop's flow whose turn came after its period ended: not run, and
# not a flow of the period (nothing is recorded for it).
SKIPPED = "skipped"


@dataclass(frozen=True)
class AgentRef:
    name: str
    control_url: str
    secret: str

    @property
    def host(self) -> str:
        host = urllib.parse.urlsplit(self.control_url).hostname
        if not host:
            raise KickassError(f"agent {self.name}: no host in {self.control_url!r}")
        return host


class AgentClient:
    def __init__(self, agent: AgentRef, timeout_s: float = 10.0) -> None:
        self.agent = agent
        self.key = signing.key_from_secret(agent.secret)
        self.timeout_s = timeout_s

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        # Signed with a key derived from the agent secret, which never travels.
        url = self.agent.control_url.rstrip("/") + path
        method = "GET" if body is None else "POST"
        try:
            status, reply = signing.signed_json(
                self.key, signing.AGENT_KEY_ID, method, url, body, timeout_s=self.timeout_s
            )
        except (OSError, ValueError) as exc:
            raise KickassError(
                f"agent {self.agent.name} unreachable at {self.agent.control_url}: {exc}",
                hint="is kickass-agent running there, and the control port open?",
            ) from None
        if status >= 400:
            hint = "check the agent secret and both clocks" if status == 401 else None
            message = str(reply.get("message") or reply.get("error") or "")[:200]
            raise KickassError(
                f"agent {self.agent.name}: HTTP {status} on {path}: {message}", hint
            ) from None
        return reply

    def health(self) -> dict[str, Any]:
        return self._call("/v1/health")

    def environment(self) -> dict[str, Any]:
        """The agent's own environment record, and the clock offset between
        us (its clock minus ours, with the round trip's half as the bound)."""
        before = time.time()
        env = self._call("/v1/environment")
        after = time.time()
        agent_time = env.get("recorded_at")
        if isinstance(agent_time, int | float):
            env["clock_offset_s"] = round(agent_time - (before + after) / 2, 6)
            env["clock_offset_bound_s"] = round((after - before) / 2, 6)
        return env

    def tokens(self, kind: str, count: int) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        port = 0
        while len(out) < count:
            reply = self._call("/v1/tokens", {"kind": kind, "count": min(200, count - len(out))})
            out += [bytes.fromhex(t) for t in reply["tokens"]]
            port = int(reply["port"])
        return out, port


@dataclass
class TrialConfig:
    agents: list[AgentRef]
    pairs: int = 3
    period_s: float = 120.0
    # Between periods: the time the flows of one have to end before the next.
    gap_s: float = 10.0
    workload: Workload = field(default_factory=Workload)
    congestion_control: str = flow_record.DEFAULT_CONGESTION_CONTROL
    handshake: str = "padded"
    access_capacity_bps: float | None = None
    router_run_name: str | None = None
    ka_send: str | None = None
    source: str | None = None
    protocols: tuple[str, ...] = ("kickass", "tcp")
    # What the periods of a pair run (None: Kick-Ass and TCP, from protocols,
    # congestion_control and handshake).
    arms: tuple[Arm, ...] | None = None
    # Several runners sharing a seed keep the same period order (aligned
    # periods across senders) but draw their own flows.
    sender_index: int = 0
    # How long a period keeps asking an unreachable agent for flow tokens
    # before it is skipped (its flows recorded as not run).
    agent_retry_s: float = 30.0
    # Both protocols: a flow fails this long after it was due, and at most
    # this many are in progress at once.
    flow_timeout_s: float = 60.0
    max_concurrent: int = 256
    # The TCP metrics cache: "disable" for the trial, or "leave" it.
    tcp_metrics: str = "disable"
    # A scheduled round says which item and due time it ran for, with the
    # seed and the agents' order drawn for it (kickass_operations).
    scheduled: dict[str, Any] | None = None

    def the_arms(self) -> tuple[Arm, ...]:
        if self.arms is not None:
            return self.arms
        return default_arms(self.protocols, self.congestion_control, self.handshake)

    def parameters(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "period_s": self.period_s,
            "gap_s": self.gap_s,
            "workload": self.workload.to_json(),
            "congestion_control": self.congestion_control,
            "handshake": self.handshake,
            "protocols": list(self.protocols),
            "arms": [a.to_json() for a in self.the_arms()],
            "sender_index": self.sender_index,
            "flow_timeout_s": self.flow_timeout_s,
            "max_concurrent": self.max_concurrent,
            "paired": True,
            **({"scheduled": self.scheduled} if self.scheduled else {}),
        }


def find_ka_send(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    here = Path(sys.executable).parent / "ka-send"
    return str(here) if here.exists() else shutil.which("ka-send")


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Slot:
    """One period as it happened: when it started, relative to the trial."""

    scheduled_s: float
    actual_s: float | None = None
    # When its last flow's record was spooled, and the deadline its flows were
    # cut at (ka-send's exit and the spooling come after the deadline).
    ended_s: float | None = None
    deadline_s: float | None = None
    # How long the upload in the gap before it took (None: there was none).
    upload_s: float | None = None
    # What its flows offered, bits per second of application bytes: the
    # flows that started, over the period's length (closed loops offer what
    # their protocol let them).
    offered_load_bps: float | None = None


class TrialRunner:
    def __init__(self, cfg: TrialConfig, spool: Spool, uploader: Uploader | None) -> None:
        self.cfg = cfg
        self.spool = spool
        self.uploader = uploader
        self.stop = threading.Event()
        # destination -> arm -> FCTs of completed flows
        self.summary: dict[str, dict[str, list[float]]] = {}
        self.failed = 0
        # Two periods' workers overlap (one ending as the next starts).
        self._tally = threading.Lock()
        self.skipped_periods: list[dict[str, Any]] = []
        self.late_periods: list[dict[str, Any]] = []
        self._started = ""
        self._slots: dict[int, _Slot] = {}
        self._environment: dict[str, Any] = {}
        self._upload_s = 0.0  # how long the last upload took
        self._t0 = 0.0  # the trial's clock (monotonic) at period offset 0

    # -- the whole trial --------------------------------------------------

    def run(self, progress: Any = None) -> dict[str, Any]:
        cfg = self.cfg
        clients = {a.name: AgentClient(a) for a in cfg.agents}
        versions: dict[str, Any] = {"kickass-wan": __version__}
        agents_env: dict[str, Any] = {}
        for name, client in clients.items():
            versions[f"agent:{name}"] = client.health().get("name", name)
            try:
                agents_env[name] = client.environment()
            except KickassError as exc:
                agents_env[name] = {"unavailable": exc.message}
        try:
            arms = cfg.the_arms()
            schedule = interleaved(
                [a.name for a in cfg.agents],
                pairs=cfg.pairs,
                period_s=cfg.period_s,
                gap_s=cfg.gap_s,
                seed=cfg.workload.seed,
                arms=arms,
            )
        except ValueError as exc:
            raise KickassError(f"bad trial schedule: {exc}") from None
        needs_ka = any(p.protocol == KICKASS for p in schedule)
        ka_send = find_ka_send(cfg.ka_send)
        if needs_ka and ka_send is None:
            raise KickassError(
                "ka-send (the Kick-Ass sender) not found",
                hint="run `make install` or pass --ka-send",
            )
        trial_ids = {a.name: secrets.token_hex(16) for a in cfg.agents}
        dest_index = {a.name: i for i, a in enumerate(cfg.agents)}
        with environment.MetricsCache(cfg.tcp_metrics) as metrics:
            self._environment = {
                "runner": environment.local([a.host for a in cfg.agents], ka_send),
                "agents": agents_env,
                "tcp_metrics_cache": metrics.record,
            }
            self._started = _now().isoformat()
            # Each destination's trial stores its own periods, numbered from 0.
            local: dict[int, int] = {}
            for agent in cfg.agents:
                mine = [p for p in schedule if p.destination == agent.name]
                local.update({p.index: i for i, p in enumerate(mine)})
            self._slots = {p.index: _Slot(p.start_s) for p in schedule}
            for agent in cfg.agents:
                self.spool.put(
                    "trial",
                    trial_ids[agent.name],
                    self._trial_record(agent, trial_ids, schedule, versions),
                )
            self._upload()

            self._run_schedule(schedule, clients, dest_index, local, trial_ids, ka_send, progress)
            for agent in cfg.agents:
                rec = self._trial_record(agent, trial_ids, schedule, versions)
                rec["finished_at"] = _now().isoformat()
                self.spool.put("trial", trial_ids[agent.name], rec)
            report = self._upload()
        return {
            "trials": trial_ids,
            "summary": self.summary,
            "failed_flows": self.failed,
            "skipped_periods": self.skipped_periods,
            "late_periods": self.late_periods,
            "period_starts": {
                str(i): {
                    "scheduled_s": s.scheduled_s,
                    "actual_s": s.actual_s,
                    "deadline_s": s.deadline_s,
                    "ended_s": s.ended_s,
                    "upload_s": s.upload_s,
                }
                for i, s in sorted(self._slots.items())
            },
            "tcp_metrics_cache": self._environment.get("tcp_metrics_cache"),
            "spooled": self.spool.count(),
            "rejected": self.spool.rejected(),
            "upload_errors": report.errors[-5:] if report else [],
        }

    def _run_schedule(
        self,
        schedule: list[Period],
        clients: dict[str, AgentClient],
        dest_index: dict[str, int],
        local: dict[int, int],
        trial_ids: dict[str, str],
        ka_send: str | None,
        progress: Any,
    ) -> None:
        """Every period at its scheduled time; returns when the last has ended
        (or the trial was stopped)."""
        cfg = self.cfg

        # Every period's flows, and the first period's tokens, before the
        # clock starts: the first period starts at 0 (drawing its flows after
        # the clock started, eight runners sharing two cores began it a
        # second late).
        planned = {
            p.index: pair_flows(
                cfg.workload, p.pair, p.duration_s, cfg.sender_index, dest_index[p.destination]
            )
            for p in schedule
        }
        kinds = {
            p.index: self._kinds(p, planned[p.index], dest_index[p.destination]) for p in schedule
        }
        # Each later period's tokens are fetched during the one before (ahead).
        first_tokens: Tokens = ""
        if schedule:
            first = schedule[0]
            first_tokens = self._tokens_or_why(
                clients[first.destination], first, kinds[first.index]
            )
        ahead: Future[Tokens] | None = None
        t0 = time.monotonic()
        self._t0 = t0
        # Flows still running this long before the next period are cut,
        # so what they left in the queues drains before it starts.
        quiet = min(QUIET_S, cfg.gap_s / 2)
        # A period runs on a worker of its own, so its start waits for
        # nothing but the clock: the last period's ending (ka-send's exit,
        # spooling its records) overlaps it, and its flow tokens were
        # fetched during the last one (TOKENS_AHEAD_S early).
        running: Future[None] | None = None
        with ThreadPoolExecutor(max_workers=3, thread_name_prefix="period") as pool:
            try:
                for i, period in enumerate(schedule):
                    if self.stop.is_set():
                        break
                    client = clients[period.destination]
                    flows = planned[period.index]
                    tokens = first_tokens if ahead is None else ahead.result()
                    begins = t0 + period.start_s
                    self._upload_before(period, begins, running)
                    # Keep the schedule: wait for the period's time.
                    wait = begins - time.monotonic()
                    if wait > 0 and self.stop.wait(wait):
                        break
                    begun = time.monotonic()
                    started = _now()
                    self._note_start(period, begun - t0)
                    if progress:
                        progress(period)
                    this = pool.submit(
                        self._run_period,
                        period,
                        local[period.index],
                        client,
                        trial_ids[period.destination],
                        ka_send,
                        flows,
                        kinds[period.index],
                        tokens,
                        begun=begun,
                        started=started,
                        deadline=begins + period.duration_s + cfg.gap_s - quiet,
                    )
                    if running is not None:
                        running.result()  # the last period's error, if any, ends the trial
                    running = this
                    if i + 1 < len(schedule):
                        nxt = schedule[i + 1]
                        ahead = pool.submit(
                            self._tokens_ahead,
                            clients[nxt.destination],
                            nxt,
                            kinds[nxt.index],
                            at=t0 + nxt.start_s - TOKENS_AHEAD_S,
                        )
                if running is not None:
                    running.result()
            except BaseException:
                # Ctrl-C or an error: the period's flows stop now, not at
                # its deadline (the pool's exit waits for its workers).
                self.stop.set()
                raise

    def _upload_before(self, period: Period, begins: float, running: Future[None] | None) -> None:
        """What the last periods measured goes to the server in the gap
        before ``period`` (which ``begins`` then), once the last period has
        ended and only while that cannot make this one start late (eight
        senders uploading at once on a loaded host took more than the gap's
        quiet second): otherwise it waits, spooled, for a longer gap or the
        end."""
        if running is not None:
            wait_for([running], timeout=max(0.0, begins - UPLOAD_MARGIN_S - time.monotonic()))
        left = begins - time.monotonic()
        if (running is None or running.done()) and left > UPLOAD_MARGIN_S + 2 * self._upload_s:
            # Cut at the margin: an upload that is slow this time
            # (eight senders at once) must not make it late either.
            self._upload(deadline=begins - UPLOAD_MARGIN_S)
            self._slots[period.index].upload_s = round(self._upload_s, 4)

    def _note_start(self, period: Period, actual: float) -> None:
        """When ``period`` began (seconds into the trial), and whether late."""
        self._slots[period.index].actual_s = round(actual, 4)
        if actual - period.start_s > LATE_START_S:
            self.late_periods.append(
                {
                    "period": period.index,
                    "late_s": round(actual - period.start_s, 3),
                }
            )

    def _trial_record(
        self,
        agent: AgentRef,
        trial_ids: dict[str, str],
        schedule: list[Period],
        versions: dict[str, Any],
    ) -> dict[str, Any]:
        cfg = self.cfg
        mine = [p for p in schedule if p.destination == agent.name]
        return {
            "trial_id": trial_ids[agent.name],
            "destination": agent.name,
            "access_capacity_bps": cfg.access_capacity_bps,
            "router_run_name": cfg.router_run_name,
            "parameters": cfg.parameters(),
            "versions": versions,
            "environment": {
                **{k: v for k, v in self._environment.items() if k != "agents"},
                "agent": self._environment.get("agents", {}).get(agent.name),
            },
            "started_at": self._started,
            "periods": [
                {
                    "index": i,
                    "pair": p.pair,
                    "protocol": p.protocol,
                    "arm": p.arm,
                    "congestion_control": p.congestion_control,
                    "handshake": p.handshake,
                    "handicap_ms": p.handicap_ms,
                    "start_s": p.start_s,
                    "duration_s": p.duration_s,
                    "actual_start_s": self._slots[p.index].actual_s,
                    **(
                        {"transport_cc": p.transport_cc}
                        if p.protocol == KICKASS and p.transport_cc
                        else {}
                    ),
                    **({"tcp_share": p.tcp_share} if p.tcp_share else {}),
                    **(
                        {"offered_load_bps": self._slots[p.index].offered_load_bps}
                        if self._slots[p.index].offered_load_bps is not None
                        else {}
                    ),
                }
                for i, p in enumerate(mine)
            ],
        }

    def _upload(self, deadline: float | None = None) -> Any:
        if self.uploader is None:
            return None
        began = time.monotonic()
        report = self.uploader.flush(deadline)
        self._upload_s = time.monotonic() - began
        for err in report.errors:
            log.warning("upload: %s (kept in the spool)", err)
        return report

    # -- one period -------------------------------------------------------

    def _kinds(self, period: Period, fl: list[Flow], destination_index: int) -> dict[int, str]:
        """Each flow's protocol: the period's, or, for a Kick-Ass arm that
        gives a share of its flows to TCP, TCP for that share (the same
        flows in every period of the pair)."""
        if period.protocol != KICKASS or not period.tcp_share:
            return {f.index: period.protocol for f in fl}
        tcp = tcp_share_indices(
            self.cfg.workload,
            period.pair,
            fl,
            period.tcp_share,
            self.cfg.sender_index,
            destination_index,
        )
        return {f.index: TCP if f.index in tcp else KICKASS for f in fl}

    def _tokens_ahead(
        self, client: AgentClient, period: Period, kinds: dict[int, str], *, at: float
    ) -> Tokens:
        """The period's tokens, asked for at monotonic time ``at`` (or now, if later)."""
        if self.stop.wait(max(0.0, at - time.monotonic())):
            return NOT_RUN_STOPPED
        return self._tokens_or_why(client, period, kinds)

    def _tokens_or_why(self, client: AgentClient, period: Period, kinds: dict[int, str]) -> Tokens:
        """The period's flow tokens per kind, or why there are none (the
        period is then skipped, its flows recorded as not run)."""
        out: dict[str, tuple[list[bytes], int]] = {}
        for kind in (KICKASS, TCP):
            count = sum(1 for k in kinds.values() if k == kind)
            if count == 0:
                continue
            try:
                out[kind] = self._tokens(client, kind, count)
            except KickassError as exc:
                return f"not run: no flow tokens from agent {client.agent.name}: {exc.message}"
        return out

    def _run_period(
        self,
        period: Period,
        local_index: int,
        client: AgentClient,
        trial_id: str,
        ka_send: str | None,
        fl: list[Flow],
        kinds: dict[int, str],
        tokens: Tokens,
        *,
        begun: float,
        started: datetime,
        deadline: float,
    ) -> None:
        """One period, from its start (``begun``, monotonic; ``started``, the
        same instant by the wall clock) to its deadline, its flows spooled."""
        # A period with nothing to run ends at once: the main loop keeps the
        # schedule, so the next one still starts at its time.
        if not fl:
            return
        if isinstance(tokens, str):
            # The trial goes on (the agent may be back for the next period);
            # every flow this period would have run is recorded as not run.
            log.warning("period %d skipped: %s", period.index + 1, tokens)
            with self._tally:
                self.skipped_periods.append(
                    {"period": period.index, "destination": period.destination, "error": tokens}
                )
            for f in fl:
                why = {"completed": False, "error": tokens}
                self._record(trial_id, local_index, period, f, kinds[f.index], why, started)
            return
        # Each kind of flow gets its tokens in the order of its flows.
        mine: dict[str, list[Flow]] = {KICKASS: [], TCP: []}
        for f in fl:
            mine[kinds[f.index]].append(f)
        results: dict[int, dict[str, Any] | str] = {}
        tcp_part: Future[dict[int, dict[str, Any] | str]] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tcp-part") as pool:
            if mine[TCP]:
                toks, port = tokens[TCP]
                tcp_part = pool.submit(
                    self._tcp_period,
                    mine[TCP],
                    toks,
                    (client.agent.host, port),
                    period,
                    begun,
                    deadline,
                )
            if mine[KICKASS]:
                toks, port = tokens[KICKASS]
                results.update(
                    self._kickass_period(
                        mine[KICKASS],
                        toks,
                        (client.agent.host, port),
                        ka_send,
                        trial_id,
                        period,
                        begun,
                        deadline,
                    )
                )
            if tcp_part is not None:
                results.update(tcp_part.result())
        offered = 0
        for f in fl:
            rec: dict[str, Any] | str = results.get(f.index) or {
                "completed": False,
                "error": NOT_RUN_STOPPED if self.stop.is_set() else "no result from the sender",
            }
            if rec == SKIPPED:
                continue
            assert isinstance(rec, dict)
            offered += f.size_bytes
            self._record(trial_id, local_index, period, f, kinds[f.index], rec, started)
        slot = self._slots[period.index]
        slot.deadline_s = round(deadline - self._t0, 4)
        slot.ended_s = round(time.monotonic() - self._t0, 4)
        slot.offered_load_bps = round(offered * 8.0 / period.duration_s, 3)

    def _tokens(self, client: AgentClient, kind: str, count: int) -> tuple[list[bytes], int]:
        """Flow tokens, retried with doubling waits for ``agent_retry_s``: an
        agent restarting (or a network blip) costs a few seconds, not the trial."""
        deadline = time.monotonic() + self.cfg.agent_retry_s
        wait = TOKEN_RETRY_FIRST_S
        while True:
            try:
                return client.tokens(kind, count)
            except KickassError as exc:
                left = deadline - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    raise
                log.warning("%s; retrying in %.1fs", exc.message, min(wait, left))
                if self.stop.wait(min(wait, left)):
                    raise
                wait *= 2

    def _tcp_period(
        self,
        fl: list[Flow],
        tokens: list[bytes],
        addr: tuple[str, int],
        period: Period,
        begun: float,
        deadline: float,
    ) -> dict[int, dict[str, Any] | str]:
        """Kernel TCP flows, each started when due (plus the arm's handicap)
        on one of ``max_concurrent`` workers; its clock runs from when it was
        due. A closed loop runs them one after another, each its off time
        after the previous one ended, and none after the period's end."""
        cfg = self.cfg
        handicap = period.handicap_ms / 1000.0
        cc = period.congestion_control or cfg.congestion_control

        def one(f: Flow, tok: bytes, due: float) -> dict[str, Any]:
            start = time.monotonic()
            queued = max(0.0, start - due)
            end_by = min(due + cfg.flow_timeout_s, deadline)
            if start >= end_by:
                return {"completed": False, "queued_ms": None,
                        "error": f"timeout: waited {queued:.1f} s for one of the "
                        f"{cfg.max_concurrent} concurrent flows and never started"}  # fmt: skip
            r = send_flow(addr, tok, f.size_bytes, cc, end_by - start, cfg.source).to_json()
            if (
                str(r.get("error") or "").startswith(TIMED_OUT)
                and end_by < due + cfg.flow_timeout_s
            ):
                r["error"] = CUT_AT_DEADLINE  # as a Kick-Ass flow still running then
            r["queued_ms"] = round(queued * 1000.0, 3)
            if r.get("fct_ms") is not None:
                # From when it was due: the arm's handicap and the wait included.
                r["fct_ms"] = r["fct_ms"] + (handicap + queued) * 1000.0
            return r

        results: dict[int, dict[str, Any] | str] = {}
        if cfg.workload.loop == "closed":
            ends = begun + period.duration_s
            last_end = begun
            for f, tok in zip(fl, tokens, strict=False):
                due = last_end + (f.off_s or 0.0)
                if due > ends:
                    results[f.index] = SKIPPED
                    continue
                if self.stop.wait(max(0.0, due + handicap - time.monotonic())):
                    break
                results[f.index] = one(f, tok, due + handicap)
                last_end = time.monotonic()
            return results
        futures: dict[int, Future[dict[str, Any]]] = {}
        with ThreadPoolExecutor(max_workers=min(cfg.max_concurrent, len(fl))) as pool:
            for f, tok in zip(fl, tokens, strict=False):
                due = begun + f.start_s
                delay = due + handicap - time.monotonic()
                if delay > 0 and self.stop.wait(delay):
                    break
                futures[f.index] = pool.submit(one, f, tok, due + handicap)
            for index, fut in futures.items():
                results[index] = fut.result()
        return results

    def _kickass_period(
        self,
        fl: list[Flow],
        tokens: list[bytes],
        addr: tuple[str, int],
        ka_send: str | None,
        trial_id: str,
        period: Period,
        begun: float,
        deadline: float,
    ) -> dict[int, dict[str, Any] | str]:
        """ka-send runs the period's schedule with the same cap and timeout as
        the TCP flows; it is stopped at the period's deadline. A closed loop
        is ka-send's too: each flow after the first starts its off time after
        the one before it ended, and none after the period's end."""
        assert ka_send is not None
        cfg = self.cfg
        handicap = period.handicap_ms / 1000.0
        cmd = [
            ka_send,
            "--agent", f"{addr[0]}:{addr[1]}",
            "--schedule", "-",
            "--handshake", period.handshake or cfg.handshake,
            "--cc", period.transport_cc or flow_record.DEFAULT_CONGESTION_CONTROL,
            "--timeout", f"{cfg.flow_timeout_s:g}",
            "--max-concurrent", str(cfg.max_concurrent),
        ]  # fmt: skip
        if cfg.source:
            cmd += ["--bind", cfg.source]
        spawned = time.monotonic()
        # ka-send counts start offsets from its own start: from this moment.
        lag = spawned - begun
        closed = cfg.workload.loop == "closed"
        lines = []
        for k, (f, tok) in enumerate(zip(fl, tokens, strict=False)):
            entry: dict[str, Any] = {
                "flow_id": f"{trial_id}-{f.index}",
                "start_s": max(0.0, f.start_s + handicap - lag),
                "size_bytes": f.size_bytes,
                "token_hex": tok.hex(),
            }
            if closed:
                entry["not_after_s"] = max(0.0, period.duration_s - lag)
                if k > 0:
                    entry["after"] = f"{trial_id}-{fl[k - 1].index}"
                    entry["start_s"] = f.off_s or 0.0
            lines.append(json.dumps(entry))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n".join(lines) + "\n")
        proc.stdin.close()
        results: dict[int, dict[str, Any] | str] = {}
        # At the deadline (or when the trial is stopped) ka-send is asked to
        # stop: flows still running end "interrupted", as TCP flows end at
        # their timeout.
        ended = threading.Event()

        def terminate_at_deadline() -> None:
            while not ended.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    proc.terminate()
                    return
                # The trial's stop and this period's end are two events:
                # look at both, at least every 0.1 s.
                ended.wait(min(left, 0.1))

        timer = threading.Thread(target=terminate_at_deadline, name="ka-send-deadline", daemon=True)
        timer.start()
        try:
            for line in proc.stdout:
                try:
                    out = json.loads(line)
                    index = int(str(out["flow_id"]).rsplit("-", 1)[1])
                except (ValueError, KeyError, IndexError):
                    log.warning("ka-send printed something unexpected: %.200s", line)
                    continue
                if out.get("skipped") is True:
                    results[index] = SKIPPED
                    continue
                rec = flow_record.from_transport(out.get("record") or {}, out.get("error"))
                queued_ns = out.get("queued_ns")
                # How late ka-send started for this flow's time (a closed
                # loop's later flows are timed by ka-send itself).
                first = fl[0].index if fl else -1
                late = 0.0
                if not closed or index == first:
                    start_s = next((x.start_s for x in fl if x.index == index), lag)
                    late = max(0.0, lag - (start_s + handicap))
                if isinstance(queued_ns, int):
                    queued = queued_ns / 1e9 + late
                    rec["queued_ms"] = round(queued * 1000.0, 3)
                    if rec.get("fct_ms") is not None:
                        rec["fct_ms"] = rec["fct_ms"] + (handicap + queued) * 1000.0
                if rec.get("error") == "interrupted":
                    rec["error"] = CUT_BY_STOP if self.stop.is_set() else CUT_AT_DEADLINE
                results[index] = rec
        finally:
            ended.set()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return results

    def _record(
        self,
        trial_id: str,
        local_index: int,
        period: Period,
        f: Flow,
        protocol: str,
        rec: dict[str, Any],
        started: datetime,
    ) -> None:
        fid = flow_record.flow_id(trial_id, local_index, f.index)
        planned = {
            "flow_id": fid,
            "period_index": local_index,
            "pair": period.pair,
            "arm": period.arm,
            "protocol": protocol,
            # TCP flows: the kernel's; Kick-Ass flows: their TCP mode's.
            "congestion_control": period.congestion_control
            if protocol == TCP
            else period.transport_cc,
            "size_bytes": f.size_bytes,
            "size_packets": f.size_packets,
            # When it was due (its clock's start; the handicap is the arm's).
            # A closed loop's flow: the earliest it could have been due (its
            # off times so far), as its real due time depends on the others.
            "started_at": datetime.fromtimestamp(started.timestamp() + f.start_s, UTC).isoformat(),
        }
        measured = {k: v for k, v in rec.items() if k in flow_record.FIELD_NAMES}
        if protocol == KICKASS:
            # What the transport negotiated: a flow that fell back to TCP from
            # the start ran as TCP, though its period was a Kick-Ass one.
            measured["negotiated_protocol"] = rec.get("negotiated_protocol")
        else:
            measured["negotiated_protocol"] = "tcp"
            cc_in_effect = rec.get("cc_in_effect")
            if cc_in_effect:
                measured["extra"] = {**(measured.get("extra") or {}), "cc_in_effect": cc_in_effect}
        row = {**measured, **planned, "completed": bool(rec.get("completed"))}
        try:
            flow_record.check(row)
        except flow_record.FlowRecordError as exc:
            # Kept, as a failed flow that says why, rather than lost.
            row = {**planned, "completed": False, "error": f"unusable sender record: {exc}"}
        row["trial_id"] = trial_id
        self.spool.put("flow", fid, row)
        with self._tally:
            if row["completed"] and row.get("fct_ms") is not None:
                by_arm = self.summary.setdefault(period.destination, {})
                by_arm.setdefault(period.arm, []).append(row["fct_ms"])
            else:
                self.failed += 1
