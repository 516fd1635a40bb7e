"""One measurement, end to end: HTTP session + UDP probe protocol + polling.

The main thread polls the server over HTTP and drives the progress display;
the UdpShell thread answers probes. Every way a run can end (complete,
Ctrl-C or SIGTERM, server vanished, session expired) returns a RunResult, so
the CLI always has something to print; only failures before any measurement
raise ProbeError.

Stopping (signals.py): the signal handler only counts, and this loop looks
at the count every tick. Each HTTP exchange runs in a short-lived helper
thread while the main thread waits in small slices, so a signal is noticed
within a tick even when the server is slow to answer, and an exchange can be
abandoned without an exception landing in the middle of urllib.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from kickass_core.plan import ProbePlan
from kickass_core.states import LIVE_STATES

from . import reassembly as reasm
from .api import ApiClient, ApiError, parse_plan, printable, server_host
from .errors import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, ProbeError
from .observe import FragmentObserver, ObserverUnavailable, open_packet_socket
from .session import Failure, LocalCounts, ProbeSession, UdpShell, resolve_ipv4
from .signals import HARD_STOP_PRESSES, STOPPING, StopSignals

T = TypeVar("T")

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
# An older server refuses "window": "auto" (HTTP 400): ask again with the
# fixed window clients sent before the server adapted it.
FALLBACK_WINDOW = 8
# Bound on each end request after Ctrl-C: the user wants out.
END_TIMEOUT_S = 5.0
# Bound on the whole of ending the session after Ctrl-C/SIGTERM (retries
# included); after it the client prints what it received itself. A service
# manager's SIGTERM usually escalates to SIGKILL after 10 s or more.
END_BUDGET_S = 8.0
# How often the main thread looks at the signal count while an HTTP request
# is in flight.
WAIT_SLICE_S = 0.05


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
    # This client's reassembly memory: limits, counters before, during and
    # after the split phase, the flow-control budget (reassembly.py).
    reassembly: dict[str, Any] | None = None
    # Whether the end-of-session report reached the server.
    report_sent: bool = False
    # --observe-fragments: what the fragments looked like before reassembly.
    observer: FragmentObserver | None = None
    # The session's page on the server (HTML: this result next to other
    # volunteers'), when the server gave one.
    page_url: str | None = None


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
        stop: StopSignals | None = None,
        read_limits: Callable[[], reasm.Limits] = reasm.read_limits,
        read_sample: Callable[[float], reasm.Sample] = reasm.read_sample,
        observe_fragments: bool = False,
    ) -> None:
        self.observe_fragments = observe_fragments
        self.api = api
        self.plan_request = plan_request
        self._read_limits = read_limits
        self._read_sample = read_sample
        self.timeout = timeout
        self.stall_timeout = STALL_TIMEOUTS * timeout
        self.stuck_timeout = max(STUCK_MIN_S, STUCK_TIMEOUTS * timeout)
        self.platform_name = platform_name
        self.progress = progress
        self.log = log
        self._clock = clock
        self._sleep = sleep
        # Not installed (tests, embedding) it only fires through trigger().
        self.stop = stop or StopSignals()
        self._last_result: dict[str, Any] | None = None
        self._server_sent = 0

    def run(self) -> RunResult:
        # Interrupted here (abandoned create): nothing measured yet. The
        # server expires a session whose HELLO never comes.
        # The privileged observation first: without the privilege nothing
        # is created.
        psock = None
        if self.observe_fragments:
            try:
                psock = open_packet_socket()
            except ObserverUnavailable as exc:
                raise observe_error(str(exc)) from None
        # The reassembly memory before anything is sent: the server starts
        # the split phase with this credit and follows our REPORTs after it.
        limits = self._read_limits()
        before = self._read_sample(self._clock())
        announced = {
            "limits": limits.to_json(),
            "before": before.to_json(),
            "split_credit": reasm.credits_for(limits, before.memory),
            # The credit bounds splits in flight (reassembly.IN_FLIGHT); a
            # server that does not say so in its answer gets absolute limits.
            "credit_mode": reasm.IN_FLIGHT,
        }
        try:
            created = self._create(announced)
        except BaseException:
            if psock is not None:
                psock.close()
            raise
        sid: str = created["session_id"]
        cookie: str = created["cookie"]
        host = created.get("probe_host") or server_host(self.api.base_url)
        port = int(created["probe_port"])
        try:
            # Checked by api.validate_created already; parsed again here
            # rather than passed around inside the reply dict.
            plan = parse_plan(created["plan"])
            addr = self._call(lambda: resolve_ipv4(host, port), abandon_at=1)
            budget = reasm.ReassemblyBudget(
                limits,
                plan.split_from,
                plan.total_probes,
                plan.window,
                start=before,
                in_flight=created.get("flow_control") == reasm.IN_FLIGHT,
            )
            observer = None if psock is None else FragmentObserver(bytes.fromhex(sid), plan)
            shell = UdpShell(
                lambda frag_ok: ProbeSession(
                    bytes.fromhex(sid),
                    bytes.fromhex(cookie),
                    plan,
                    challenge_timeout=self.timeout,
                    frag_size_supported=frag_ok,
                    budget=budget,
                    log=self.log,
                ),
                addr,
                read_sample=self._read_sample,
                observer=observer,
                packet_socket=psock,
            )
        except (ProbeError, OSError, KeyboardInterrupt) as exc:
            if psock is not None:
                psock.close()
            self._end_quietly(sid, cookie)
            if isinstance(exc, OSError):
                raise ProbeError(f"cannot open a UDP socket: {exc.strerror or exc}") from None
            raise
        total = plan.total_probes
        self.log(f"session {sid}: probes from {addr[0]}:{addr[1]} to UDP port {shell.local_port}")
        window = f"adaptive up to {plan.window}" if plan.adaptive else str(plan.window)
        self.progress.note(
            f"Session {sid}: {total:,} probes (repetitions {plan.repetitions}, "
            f"step {plan.step} B, window {window})"
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

    def _create(self, announced: dict[str, Any]) -> dict[str, Any]:
        def create(request: dict[str, Any]) -> dict[str, Any]:
            return self._call(
                lambda: self.api.create_session(
                    request, platform=self.platform_name, reassembly=announced
                ),
                abandon_at=1,
            )

        try:
            return create(self.plan_request)
        except ApiError as exc:
            if exc.status != 400 or self.plan_request.get("window") != "auto":
                raise
            self.progress.note(
                f"The server does not adapt the window ({exc.message}); asking for a fixed "
                f"window of {FALLBACK_WINDOW}."
            )
            self.plan_request = {**self.plan_request, "window": FALLBACK_WINDOW}
            return create(self.plan_request)

    # -- the polling loop -----------------------------------------------------------

    def _loop(self, ctx: _Ctx) -> RunResult:
        start = self._clock()
        last_http_ok = start
        last_progress_at = start
        next_poll = start + POLL_INTERVAL_S
        done_seen_at: float | None = None
        warned_unreachable = False
        while True:
            if self.stop.requested:
                raise self.stop.interrupted()
            if ctx.shell.error is not None:
                err = ctx.shell.error
                raise ProbeError(
                    f"internal error in the UDP receiver: {type(err).__name__}: {err}",
                    hint="please report this (with --verbose output)",
                )
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
                    res = self._call(
                        lambda: self.api.get_session(
                            ctx.sid, cookie=ctx.cookie, tries=1, timeout=self.timeout
                        ),
                        abandon_at=1,
                    )
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
        res = self._report(ctx, res)
        state = res["state"]
        if state == "complete":
            self.progress.update(ctx.total, ctx.total, "done")
            return self._result(ctx, res, state, "complete", None, EXIT_OK)
        reason = printable(res.get("end_reason") or "no reason given", 120)
        return self._result(
            ctx,
            res,
            state,
            "server-ended",
            f"the server ended the session early ({printable(state, 40)}: {reason})",
            EXIT_INCOMPLETE,
        )

    def _interrupted(self, ctx: _Ctx) -> RunResult:
        """End the session after Ctrl-C/SIGTERM: bounded, and always a result.

        Further signals do not unwind this (signals.py); at the third press,
        or after END_BUDGET_S, the client stops waiting for the server and
        reports what it received itself.
        """
        self.stop.stage = STOPPING
        label = self.stop.label
        self.progress.note(
            f"Interrupted ({label}): ending the session and fetching the partial result..."
        )
        deadline = self._clock() + END_BUDGET_S
        each = min(self.timeout, END_TIMEOUT_S)
        res: dict[str, Any] | None = None
        try:
            try:
                res = self._call(
                    lambda: self.api.end_session(ctx.sid, ctx.cookie, tries=2, timeout=each),
                    abandon_at=HARD_STOP_PRESSES,
                    deadline=deadline,
                )
            except ApiError as exc:
                # e.g. the session finished a moment before the signal.
                self.log(f"end refused: {exc.message}")
                res = self._call(
                    lambda: self.api.get_session(ctx.sid, cookie=ctx.cookie, tries=1, timeout=each),
                    abandon_at=HARD_STOP_PRESSES,
                    deadline=deadline,
                )
        except ProbeError as exc:
            self.progress.note(f"Could not end the session on the server: {exc.message}")
        except KeyboardInterrupt:
            # The third press: the handler said so; print what we have, now.
            self.log("stopped waiting for the server")
        if res is not None and self.stop.presses < HARD_STOP_PRESSES:
            res = self._report(ctx, res, deadline=deadline, abandon_at=HARD_STOP_PRESSES)
        note = f"interrupted by {label}: partial result"
        if res is None:
            note += "; the counts are what this client received"
        state = res["state"] if res else self._last_state()
        return self._result(ctx, res, state, "interrupted", note, self.stop.exit_code)

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
        if res is not None and res.get("state") not in LIVE_STATES:
            res = self._report(ctx, res, deadline=self._clock() + END_BUDGET_S)
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
        if ctx.reassembly is None:
            ctx.reassembly = ctx.shell.reassembly_summary()
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
            reassembly=ctx.reassembly,
            report_sent=ctx.report_sent,
            observer=ctx.shell.observation(),
            page_url=self.api.page_url((res or {}).get("page_path")),
        )

    # -- the end-of-session report --------------------------------------------------------

    def _report(
        self,
        ctx: _Ctx,
        res: dict[str, Any],
        *,
        deadline: float | None = None,
        abandon_at: int = 1,
    ) -> dict[str, Any]:
        """Send the reassembly summary (and refused-fragment ranges) of a
        finished session; returns the results it answers with (the verdict
        may change: invalid probes are left out), or ``res`` if it failed.
        Never raises: the measurement is stored either way."""
        ctx.reassembly = ctx.shell.reassembly_summary()
        if ctx.reassembly is None:
            return res  # nothing to report
        body: dict[str, Any] = {
            "reassembly": ctx.reassembly,
            "invalid_ranges": [list(r) for r in ctx.shell.invalid_ranges()],
        }
        observer = ctx.shell.observation()
        if observer is not None:
            arrays = observer.encoded()
            summary = observer.summary()
            if arrays is None:
                summary["per_probe"] = "omitted: too large for one report"
            body["fragment_observation"] = {"summary": summary, **(arrays or {})}
        each = min(self.timeout, END_TIMEOUT_S)
        try:
            new = self._call(
                lambda: self.api.report_session(ctx.sid, ctx.cookie, body, tries=2, timeout=each),
                abandon_at=abandon_at,
                deadline=deadline,
            )
        except (ProbeError, KeyboardInterrupt) as exc:
            # An older server (404/405) or an unreachable one: the result
            # stands, without the report.
            self.log(f"end-of-session report not stored: {getattr(exc, 'message', exc)}")
            return res
        ctx.report_sent = True
        self._last_result = new
        return new

    # -- helpers -----------------------------------------------------------------------

    def _last_state(self) -> str:
        return str(self._last_result["state"]) if self._last_result else "unknown"

    def _end_quietly(self, sid: str, cookie: str) -> dict[str, Any] | None:
        """Release the server's session after a failure; never raises.

        One more Ctrl-C abandons it: the run is failing anyway.
        """
        try:
            return self._call(
                lambda: self.api.end_session(sid, cookie, tries=1, timeout=min(self.timeout, 5.0)),
                abandon_at=self.stop.presses + 1,
                deadline=self._clock() + END_BUDGET_S,
            )
        except (ProbeError, KeyboardInterrupt):
            return None

    def _call(self, fn: Callable[[], T], *, abandon_at: int, deadline: float | None = None) -> T:
        """Run one blocking exchange (HTTP, DNS) in a helper thread and wait for it.

        Raises ``Interrupted`` once ``abandon_at`` signal presses have arrived
        and ProbeError after ``deadline``; the abandoned thread is a daemon
        and finishes (or times out) on its own. Otherwise returns what ``fn``
        returned or raises what it raised.
        """
        if self.stop.presses >= abandon_at:
            raise self.stop.interrupted()
        box: list[tuple[bool, Any]] = []
        done = threading.Event()

        def work() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the main thread below
                box.append((False, exc))
            finally:
                done.set()

        threading.Thread(target=work, name="kickass-probe-http", daemon=True).start()
        while not done.wait(WAIT_SLICE_S):
            if self.stop.presses >= abandon_at:
                raise self.stop.interrupted()
            if deadline is not None and self._clock() >= deadline:
                raise ProbeError(f"no answer from the server within {END_BUDGET_S:g} s")
        ok, value = box[0]
        if ok:
            return cast(T, value)
        raise value

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
        self.reassembly: dict[str, Any] | None = None
        self.report_sent = False


def observe_error(why: str) -> ProbeError:
    return ProbeError(
        f"--observe-fragments {why}",
        hint="run kickass-probe as root (or give its Python CAP_NET_RAW), or leave the option "
        "out: without it the study reports the largest fragment of each split only",
        exit_code=EXIT_USAGE,
    )


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
    except (TypeError, ValueError, OverflowError):
        return 0
