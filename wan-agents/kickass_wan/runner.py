"""`kickass trials run`: interleaved Kick-Ass and TCP periods towards remote agents.

For each destination agent, the schedule (``schedule.interleaved``) alternates
periods of Kick-Ass flows and TCP flows, in an order drawn per pair. In each
period on-off senders start flows at the workload's exponential gaps with its
Pareto sizes (``workload.flows``, seeded per period), open loop: a slow flow
does not delay the next one. Kick-Ass flows run in one ``ka-send`` process per
period; TCP flows are kernel TCP sockets (``tcpflow``). Every flow's record is
spooled to disk as soon as it finishes and uploaded to the server with the
runner's token; what the server cannot take now stays spooled for
`kickass trials upload`.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kickass_core import flow_record, signing
from kickass_core.errors import KickassError

from . import __version__
from .schedule import KICKASS, Period, interleaved
from .spool import Spool
from .tcpflow import send_flow
from .uploader import Uploader
from .workload import Flow, Workload, period_flows

log = logging.getLogger("kickass.trials")

# A flow that has not finished this long after its period ended is given up.
FLOW_GRACE_S = 60.0
# First wait before asking an unreachable agent for tokens again (doubling).
TOKEN_RETRY_FIRST_S = 0.5


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
        data = None if body is None else json.dumps(body).encode()
        method = "GET" if body is None else "POST"
        base = urllib.parse.urlsplit(self.agent.control_url)
        req = urllib.request.Request(
            self.agent.control_url.rstrip("/") + path, data=data, method=method
        )
        # Signed with a key derived from the agent secret, which never travels.
        full = base.path.rstrip("/") + path
        headers = signing.sign(self.key, signing.AGENT_KEY_ID, method, full, data or b"")
        for name, value in headers.items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                reply: dict[str, Any] = json.loads(resp.read())
                return reply
        except urllib.error.HTTPError as exc:
            hint = "check the agent secret and both clocks" if exc.code == 401 else None
            raise KickassError(
                f"agent {self.agent.name}: HTTP {exc.code} on {path}: {_message(exc)}", hint
            ) from None
        except (OSError, ValueError) as exc:
            raise KickassError(
                f"agent {self.agent.name} unreachable at {self.agent.control_url}: {exc}",
                hint="is kickass-agent running there, and the control port open?",
            ) from None

    def health(self) -> dict[str, Any]:
        return self._call("/v1/health")

    def tokens(self, kind: str, count: int) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        port = 0
        while len(out) < count:
            reply = self._call("/v1/tokens", {"kind": kind, "count": min(200, count - len(out))})
            out += [bytes.fromhex(t) for t in reply["tokens"]]
            port = int(reply["port"])
        return out, port


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return ""
    return (
        str(body.get("message") or body.get("error") or "")[:200] if isinstance(body, dict) else ""
    )


@dataclass
class TrialConfig:
    agents: list[AgentRef]
    pairs: int = 3
    period_s: float = 120.0
    workload: Workload = field(default_factory=Workload)
    congestion_control: str = "cubic"
    handshake: str = "padded"
    access_capacity_bps: float | None = None
    router_run_name: str | None = None
    ka_send: str | None = None
    source: str | None = None
    protocols: tuple[str, ...] = ("kickass", "tcp")
    # Several runners sharing a seed keep the same period order (aligned
    # periods across senders) but draw their own flows.
    sender_index: int = 0
    # How long a period keeps asking an unreachable agent for flow tokens
    # before it is skipped (its flows recorded as not run).
    agent_retry_s: float = 30.0

    def parameters(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "period_s": self.period_s,
            "workload": self.workload.to_json(),
            "congestion_control": self.congestion_control,
            "handshake": self.handshake,
            "protocols": list(self.protocols),
            "sender_index": self.sender_index,
        }


def find_ka_send(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    here = Path(sys.executable).parent / "ka-send"
    return str(here) if here.exists() else shutil.which("ka-send")


def _now() -> datetime:
    return datetime.now(UTC)


class TrialRunner:
    def __init__(self, cfg: TrialConfig, spool: Spool, uploader: Uploader | None) -> None:
        self.cfg = cfg
        self.spool = spool
        self.uploader = uploader
        self.stop = threading.Event()
        self.summary: dict[str, dict[str, list[float]]] = {}
        self.failed = 0
        self.skipped_periods: list[dict[str, Any]] = []
        self._started = ""

    # -- the whole trial --------------------------------------------------

    def run(self, progress: Any = None) -> dict[str, Any]:
        cfg = self.cfg
        clients = {a.name: AgentClient(a) for a in cfg.agents}
        versions: dict[str, Any] = {"kickass-wan": __version__}
        for name, client in clients.items():
            versions[f"agent:{name}"] = client.health().get("name", name)
        try:
            schedule = interleaved(
                [a.name for a in cfg.agents],
                pairs=cfg.pairs,
                period_s=cfg.period_s,
                seed=cfg.workload.seed,
                protocols=cfg.protocols,
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
        self._started = _now().isoformat()
        # Each destination's trial stores its own periods, numbered from 0.
        local: dict[int, int] = {}
        for agent in cfg.agents:
            mine = [p for p in schedule if p.destination == agent.name]
            local.update({p.index: i for i, p in enumerate(mine)})
        for agent in cfg.agents:
            self.spool.put(
                "trial",
                trial_ids[agent.name],
                self._trial_record(agent, trial_ids, schedule, versions),
            )
        self._upload()
        for period in schedule:
            if self.stop.is_set():
                break
            if progress:
                progress(period)
            self._run_period(
                period,
                local[period.index],
                clients[period.destination],
                trial_ids[period.destination],
                ka_send,
            )
            self._upload()
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
            "spooled": self.spool.count(),
            "rejected": self.spool.rejected(),
            "upload_errors": report.errors[-5:] if report else [],
        }

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
            "started_at": self._started,
            "periods": [
                {
                    **p.to_json(),
                    "index": i,
                    "congestion_control": None if p.protocol == KICKASS else cfg.congestion_control,
                }
                for i, p in enumerate(mine)
            ],
        }

    def _upload(self) -> Any:
        if self.uploader is None:
            return None
        report = self.uploader.flush()
        for err in report.errors:
            log.warning("upload: %s (kept in the spool)", err)
        return report

    # -- one period -------------------------------------------------------

    def _run_period(
        self,
        period: Period,
        local_index: int,
        client: AgentClient,
        trial_id: str,
        ka_send: str | None,
    ) -> None:
        cfg = self.cfg
        fl = period_flows(cfg.workload, period.index, period.duration_s, cfg.sender_index)
        if not fl:
            time.sleep(period.duration_s)
            return
        kind = "kickass" if period.protocol == KICKASS else "tcp"
        started = _now()
        try:
            tokens, port = self._tokens(client, kind, len(fl))
        except KickassError as exc:
            # The trial goes on (the agent may be back for the next period);
            # every flow this period would have run is recorded as not run.
            why = f"not run: no flow tokens from agent {client.agent.name}: {exc.message}"
            log.warning("period %d skipped: %s", period.index + 1, why)
            self.skipped_periods.append(
                {"period": period.index, "destination": period.destination, "error": why}
            )
            for f in fl:
                self._record(
                    trial_id, local_index, period, f, {"completed": False, "error": why}, started
                )
            # The slot still passes, so periods stay aligned with other runners'.
            self.stop.wait(max(0.0, period.duration_s - (_now() - started).total_seconds()))
            return
        addr = (client.agent.host, port)
        if period.protocol == KICKASS:
            results = self._kickass_period(fl, tokens, addr, ka_send, trial_id)
        else:
            results = self._tcp_period(fl, tokens, addr, period)
        for f in fl:
            rec = results.get(f.index) or {"completed": False, "error": "no result from the sender"}
            self._record(trial_id, local_index, period, f, rec, started)

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
        self, fl: list[Flow], tokens: list[bytes], addr: tuple[str, int], period: Period
    ) -> dict[int, dict[str, Any]]:
        results: dict[int, dict[str, Any]] = {}
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=min(128, len(fl))) as pool:
            futures = {}
            for f, tok in zip(fl, tokens, strict=False):
                delay = t0 + f.start_s - time.monotonic()
                if delay > 0 and self.stop.wait(delay):
                    break
                futures[f.index] = pool.submit(
                    send_flow,
                    addr,
                    tok,
                    f.size_bytes,
                    self.cfg.congestion_control,
                    period.duration_s + FLOW_GRACE_S,
                    self.cfg.source,
                )
            rest = t0 + period.duration_s - time.monotonic()
            if rest > 0:
                self.stop.wait(rest)
            for index, fut in futures.items():
                results[index] = fut.result().to_json()
        return results

    def _kickass_period(
        self,
        fl: list[Flow],
        tokens: list[bytes],
        addr: tuple[str, int],
        ka_send: str | None,
        trial_id: str,
    ) -> dict[int, dict[str, Any]]:
        assert ka_send is not None
        cmd = [
            ka_send,
            "--agent",
            f"{addr[0]}:{addr[1]}",
            "--schedule",
            "-",
            "--handshake",
            self.cfg.handshake,
        ]
        if self.cfg.source:
            cmd += ["--bind", self.cfg.source]
        lines = [
            json.dumps(
                {
                    "flow_id": f"{trial_id}-{f.index}",
                    "start_s": f.start_s,
                    "size_bytes": f.size_bytes,
                    "token_hex": tok.hex(),
                }
            )
            for f, tok in zip(fl, tokens, strict=False)
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n".join(lines) + "\n")
        proc.stdin.close()
        results: dict[int, dict[str, Any]] = {}
        timer = threading.Timer(max(f.start_s for f in fl) + FLOW_GRACE_S + 10, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                try:
                    out = json.loads(line)
                    index = int(str(out["flow_id"]).rsplit("-", 1)[1])
                except (ValueError, KeyError, IndexError):
                    log.warning("ka-send printed something unexpected: %.200s", line)
                    continue
                results[index] = flow_record.from_transport(
                    out.get("record") or {}, out.get("error")
                )
        finally:
            timer.cancel()
            proc.wait()
        return results

    def _record(
        self,
        trial_id: str,
        local_index: int,
        period: Period,
        f: Flow,
        rec: dict[str, Any],
        started: datetime,
    ) -> None:
        fid = flow_record.flow_id(trial_id, local_index, f.index)
        planned = {
            "flow_id": fid,
            "period_index": local_index,
            "protocol": period.protocol,
            "congestion_control": None
            if period.protocol == KICKASS
            else self.cfg.congestion_control,
            "size_bytes": f.size_bytes,
            "size_packets": f.size_packets,
            "started_at": datetime.fromtimestamp(started.timestamp() + f.start_s, UTC).isoformat(),
        }
        measured = {k: v for k, v in rec.items() if k in flow_record.FIELD_NAMES}
        row = {**measured, **planned, "completed": bool(rec.get("completed"))}
        try:
            flow_record.check(row)
        except flow_record.FlowRecordError as exc:
            # Kept, as a failed flow that says why, rather than lost.
            row = {**planned, "completed": False, "error": f"unusable sender record: {exc}"}
        row["trial_id"] = trial_id
        self.spool.put("flow", fid, row)
        if row["completed"] and row.get("fct_ms") is not None:
            self.summary.setdefault(period.destination, {}).setdefault(period.protocol, []).append(
                row["fct_ms"]
            )
        else:
            self.failed += 1
