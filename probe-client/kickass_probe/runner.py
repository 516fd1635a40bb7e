"""One measurement, end to end: HTTP session + UDP probe protocol + polling.

The main thread polls the server over HTTP and drives the progress display;
the UdpShell thread answers probes. Every way a run can end (complete,
Ctrl-C, server vanished, session expired) returns a RunResult, so the CLI
always has something to print; only failures before any measurement raise
ProbeError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kickass_core.plan import PlanError, ProbePlan
from kickass_core.states import LIVE_STATES

from .api import ApiClient, ApiError, server_host
from .errors import EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK, ProbeError
from .session import Failure, LocalCounts, ProbeSession, UdpShell, resolve_ipv4

# The contract asks clients to poll about every 2 s; after the server's DONE
# we poll faster, since only the final state is missing.
POLL_INTERVAL_S = 2.0
POLL_AFTER_DONE_S = 0.25
TICK_S = 0.1
# "Server vanished" = neither an HTTP reply nor a probe for this many
# multiples of --timeout.
STALL_TIMEOUTS = 3
# "Stuck" = the server answers HTTP but for this long neither its sent count
# grows nor does a probe arrive. Per-probe timeouts are at most a few
# seconds, so a live session never pauses anywhere near this long.
STUCK_MIN_S = 120.0
STUCK_TIMEOUTS = 12
# Bound on the end request after Ctrl-C: the user wants out.
END_TIMEOUT_S = 5.0


class Progress(Protocol):
    def update(self, done: int, total: int, description: str) -> None: ...

    def note(self, text: str) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunResult:
    server_url: str
    session_id: str
    session_url: str
    plan: ProbePlan
    total_probes: int
    # The server's view (GET / end reply); None when it became unreachable.
    server_result: dict[str, Any] | None
    # The last server state we heard of, even when server_result is None.
    last_state: str
    local: LocalCounts
    # complete | interrupted | vanished | server-ended | stuck
    outcome: str
    incomplete: bool
    note: str | None
    exit_code: int


class Runner:
    def __init__(
        self,
        api: ApiClient,
        plan_request: dict[str, Any],
        *,
        timeout: float,
        platform_name: str,
        progress: Progress,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.api = api
        self.plan_request = plan_request
        self.timeout = timeout
        self.stall_timeout = STALL_TIMEOUTS * timeout
        self.stuck_timeout = max(STUCK_MIN_S, STUCK_TIMEOUTS * timeout)
        self.platform_name = platform_name
        self.progress = progress
        self.log = log
        self._clock = clock
        self._sleep = sleep
        self._last_result: dict[str, Any] | None = None
        self._server_sent = 0

    def run(self) -> RunResult:
        created = self.api.create_session(self.plan_request, platform=self.platform_name)
        sid: str = created["session_id"]
        cookie: str = created["cookie"]
        try:
            plan = ProbePlan.from_json(created["plan"])
        except (PlanError, KeyError, TypeError, ValueError) as exc:
            self._end_quietly(sid, cookie)
            raise ProbeError(
                f"this client cannot follow the server's probe plan ({exc})",
                hint="upgrade kickass-probe: pip install -U kickass-probe",
            ) from None
        total = int(created.get("total_probes") or plan.total_probes)
        host = created.get("probe_host") or server_host(self.api.base_url)
        port = int(created["probe_port"])
        try:
            addr = resolve_ipv4(host, port)
            shell = UdpShell(
                lambda frag_ok: ProbeSession(
                    bytes.fromhex(sid),
                    bytes.fromhex(cookie),
                    plan,
                    challenge_timeout=self.timeout,
                    frag_size_supported=frag_ok,
                    log=self.log,
                ),
                addr,
            )
        except (ProbeError, OSError) as exc:
            self._end_quietly(sid, cookie)
            if isinstance(exc, ProbeError):
                raise
            raise ProbeError(f"cannot open a UDP socket: {exc.strerror or exc}") from None
        self.log(f"session {sid}: probes from {addr[0]}:{addr[1]} to UDP port {shell.local_port}")
        self.progress.note(
            f"Session {sid}: {total:,} probes (repetitions {plan.repetitions}, "
            f"step {plan.step} B, window {plan.window})"
        )
        # expires_in_s is the server's handshake window (HELLO + ECHO); our own
        # challenge timeout (--timeout) is what ends a handshake that fails.
        ctx = _Ctx(sid, cookie, plan, total, addr, shell)
        shell.start()
        try:
            return self._loop(ctx)
        except KeyboardInterrupt:
            return self._interrupted(ctx)
        except ProbeError:
            self._end_quietly(sid, cookie)
            raise
        finally:
            shell.stop()
            self.progress.close()

    # -- the polling loop -----------------------------------------------------------

    def _loop(self, ctx: _Ctx) -> RunResult:
        start = self._clock()
        last_http_ok = start
        last_progress_at = start
        next_poll = start + POLL_INTERVAL_S
        done_seen_at: float | None = None
        warned_unreachable = False
        while True:
            phase, failure, counts = ctx.shell.snapshot()
            if failure is Failure.NO_CHALLENGE:
                raise self._no_challenge(ctx, counts)
            if failure is Failure.NO_PROBES:
                raise ProbeError(
                    f"the server's challenge arrived and was answered, but no probe followed "
                    f"within {self.timeout:g} s",
                    hint="something on the path drops the server's probe datagrams, or the "
                    "server is overloaded; try again later",
                )
            now = self._clock()
            if counts.done_received and done_seen_at is None:
                done_seen_at = now
                next_poll = now
            if now >= next_poll:
                try:
                    res = self.api.get_session(ctx.sid, tries=1, timeout=self.timeout)
                except ApiError as exc:
                    if exc.status == 404:
                        return self._vanished(ctx, "the server no longer knows this session")
                    self.log(f"poll failed: {exc.message}")
                except ProbeError as exc:
                    self.log(f"poll failed: {exc.message}")
                    if not warned_unreachable:
                        warned_unreachable = True
                        self.progress.note(
                            f"The server is not answering ({exc.message}); giving up after "
                            f"{self.stall_timeout:g} s without news."
                        )
                else:
                    last_http_ok = self._clock()
                    warned_unreachable = False
                    self._last_result = res
                    sent = _int(res.get("sent"))
                    if sent > self._server_sent:
                        last_progress_at = last_http_ok
                    self._server_sent = sent
                    if res["state"] not in LIVE_STATES:
                        return self._finished(ctx, res)
                next_poll = self._clock() + (
                    POLL_AFTER_DONE_S if done_seen_at is not None else POLL_INTERVAL_S
                )
            now = self._clock()
            last_news = max(last_http_ok, counts.last_probe_at or start)
            if now - last_news > self.stall_timeout:
                return self._vanished(
                    ctx, f"no reply from the server and no probe for {self.stall_timeout:g} s"
                )
            if done_seen_at is not None and now - done_seen_at > self.stall_timeout:
                # DONE arrived but HTTP never reported a final state.
                return self._end_early(ctx, "the server said DONE but never reported a result")
            if now - max(last_progress_at, counts.last_probe_at or start) > self.stuck_timeout:
                # The server answers but neither sends nor counts probes.
                return self._end_early(
                    ctx, f"the server made no progress for {self.stuck_timeout:g} s"
                )
            self.progress.update(
                max(counts.highest_seq + 1, self._server_sent),
                ctx.total,
                describe_position(ctx.plan, counts.highest_seq, phase.value),
            )
            self._sleep(TICK_S)

    # -- ways to finish ----------------------------------------------------------------

    def _finished(self, ctx: _Ctx, res: dict[str, Any]) -> RunResult:
        state = res["state"]
        if state == "complete":
            self.progress.update(ctx.total, ctx.total, "done")
            return self._result(ctx, res, state, "complete", None, EXIT_OK)
        reason = res.get("end_reason") or "no reason given"
        return self._result(
            ctx,
            res,
            state,
            "server-ended",
            f"the server ended the session early ({state}: {reason})",
            EXIT_INCOMPLETE,
        )

    def _interrupted(self, ctx: _Ctx) -> RunResult:
        self.progress.note("Interrupted: ending the session and fetching the partial result...")
        res: dict[str, Any] | None = None
        try:
            try:
                res = self.api.end_session(
                    ctx.sid, ctx.cookie, tries=2, timeout=min(self.timeout, END_TIMEOUT_S)
                )
            except ApiError as exc:
                # e.g. the session finished a moment before Ctrl-C.
                self.log(f"end refused: {exc.message}")
                res = self.api.get_session(
                    ctx.sid, tries=1, timeout=min(self.timeout, END_TIMEOUT_S)
                )
        except ProbeError as exc:
            self.progress.note(f"Could not reach the server to end the session: {exc.message}")
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: print what we have, now
        state = res["state"] if res else self._last_state()
        return self._result(
            ctx,
            res,
            state,
            "interrupted",
            "interrupted by Ctrl-C: partial result",
            EXIT_INTERRUPTED,
        )

    def _vanished(self, ctx: _Ctx, why: str) -> RunResult:
        return self._result(
            ctx,
            None,
            self._last_state(),
            "vanished",
            f"lost contact with the server ({why}); the counts are what this client received",
            EXIT_INCOMPLETE,
        )

    def _end_early(self, ctx: _Ctx, why: str) -> RunResult:
        res = self._end_quietly(ctx.sid, ctx.cookie) or self._last_result
        return self._result(
            ctx,
            res,
            res["state"] if res else self._last_state(),
            "stuck",
            why,
            EXIT_INCOMPLETE,
        )

    def _result(
        self,
        ctx: _Ctx,
        res: dict[str, Any] | None,
        state: str,
        outcome: str,
        note: str | None,
        exit_code: int,
    ) -> RunResult:
        _, _, counts = ctx.shell.snapshot()
        return RunResult(
            server_url=self.api.base_url,
            session_id=ctx.sid,
            session_url=(res or {}).get("url") or self.api.session_url(ctx.sid),
            plan=ctx.plan,
            total_probes=ctx.total,
            server_result=res,
            last_state=state,
            local=counts,
            outcome=outcome,
            incomplete=state != "complete",
            note=note,
            exit_code=exit_code,
        )

    # -- helpers -----------------------------------------------------------------------

    def _last_state(self) -> str:
        return str(self._last_result["state"]) if self._last_result else "unknown"

    def _end_quietly(self, sid: str, cookie: str) -> dict[str, Any] | None:
        """Release the server's session after a failure; never raises."""
        try:
            return self.api.end_session(sid, cookie, tries=1, timeout=min(self.timeout, 5.0))
        except (ProbeError, KeyboardInterrupt):
            return None

    def _no_challenge(self, ctx: _Ctx, counts: LocalCounts) -> ProbeError:
        host, port = ctx.addr
        err = ctx.shell.last_send_error
        detail = f" (last send error: {err})" if err else ""
        return ProbeError(
            f"no challenge from the server's UDP port {host}:{port} within {self.timeout:g} s "
            f"({counts.hellos_sent} hellos sent){detail}",
            hint=f"UDP to or from port {port} seems blocked (firewall, corporate or captive "
            "network?); try from another network",
        )


class _Ctx:
    """What one running session needs, grouped for the loop's helpers."""

    def __init__(
        self,
        sid: str,
        cookie: str,
        plan: ProbePlan,
        total: int,
        addr: tuple[str, int],
        shell: UdpShell,
    ) -> None:
        self.sid = sid
        self.cookie = cookie
        self.plan = plan
        self.total = total
        self.addr = addr
        self.shell = shell


def describe_position(plan: ProbePlan, highest_seq: int, phase: str) -> str:
    if highest_seq < 0:
        return "waiting for the server's challenge" if phase == "hello" else "waiting for probes"
    if highest_seq >= plan.total_probes:
        return "probing"
    probe = plan.probe(highest_seq)
    label = "whole" if probe.phase == "whole" else "split, leading"
    return f"{label} {probe.ip_len} B"


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
