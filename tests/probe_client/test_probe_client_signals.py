"""Ctrl-C and SIGTERM on the real `kickass-probe`: the partial result survives.

The client runs as a subprocess (signals are delivered to a real process)
against the scripted server of test_probe_client_loopback.py. What must hold:
the first signal ends the session with the server and prints the partial
result; more signals never lose it (a burst counts as one press, the third
distinct press only stops the wait for the server); the JSON on stdout is
never cut, even through a slow pipe; SIGTERM behaves like Ctrl-C.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_probe.errors import ProbeError
from kickass_probe.runner import Runner
from kickass_probe.signals import (
    DEBOUNCE_S,
    HARD_STOP_PRESSES,
    RUNNING,
    WRITING,
    Interrupted,
    StopSignals,
)
from test_probe_client_loopback import ScriptedServer

pytestmark = pytest.mark.timeout(90)

# The paper's full plan: long enough that a run is always mid-way when the
# tests signal it, and a partial result large enough (~60 kB of JSON) to
# fill a pipe.
BIG_PLAN = ProbePlan.build(repetitions=100, step=8, window=8)
# Spacing of signals meant as separate presses.
PRESS_GAP_S = DEBOUNCE_S + 0.2


@pytest.fixture
def make_peer() -> Iterator[Any]:
    peers: list[ScriptedServer] = []

    def make(**kw: Any) -> ScriptedServer:
        peer = ScriptedServer(**kw).start()
        peers.append(peer)
        return peer

    yield make
    for p in peers:
        p.close()


def _console_script() -> str:
    script = Path(sys.executable).parent / "kickass-probe"
    if not script.exists():
        pytest.skip("kickass-probe console script not installed next to this python")
    return str(script)


def start_client(peer: ScriptedServer, *extra: str, stdout: Any = subprocess.PIPE) -> Any:
    return subprocess.Popen(
        [_console_script(), "--server", peer.url, "--yes", "--json", *extra],
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


def wait_for_acks(peer: ScriptedServer, proc: Any, n: int) -> None:
    deadline = time.monotonic() + 20
    while len(peer.acks) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert len(peer.acks) >= n, "the client never got going"


def finish(proc: Any, timeout: float = 30) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return (out or b"").decode(), err.decode()


def assert_partial_json(out: str, err: str, peer: ScriptedServer, received_at_least: int) -> dict:
    assert "Traceback" not in err, err
    assert out.count("\n") == 1 and out.endswith("\n"), out[-200:]
    doc = json.loads(out)
    assert doc["session_id"] == peer.sid
    assert doc["outcome"] == "interrupted" and doc["incomplete"] is True
    assert received_at_least <= doc["local"]["received"] < BIG_PLAN.total_probes
    return doc


# -- on the real process -------------------------------------------------------------------


@pytest.mark.parametrize("signals", [3, 5])
def test_burst_of_sigints_still_ends_the_session_and_prints_it(
    make_peer: Any, signals: int
) -> None:
    # Three Ctrl-C 10 ms apart once lost ~12,000 measured probes ("interrupted
    # before the measurement started", empty stdout); five killed the client.
    peer = make_peer(plan=BIG_PLAN)
    proc = start_client(peer, "--timeout", "3")
    wait_for_acks(peer, proc, 2000)
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    doc = assert_partial_json(out, err, peer, 2000)
    # A burst is one press: the session was still ended with the server.
    assert peer.end_cookies == [peer.cookie]
    assert doc["state"] == "ended" and doc["source"] == "server"
    assert "interrupted before the measurement started" not in err


def test_sigterm_ends_the_session_like_ctrl_c(make_peer: Any) -> None:
    peer = make_peer(plan=BIG_PLAN)
    proc = start_client(peer, "--timeout", "3")
    wait_for_acks(peer, proc, 500)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    doc = assert_partial_json(out, err, peer, 500)
    assert peer.end_cookies == [peer.cookie]
    assert doc["state"] == "ended"
    assert doc["note"].startswith("interrupted by SIGTERM")
    assert "Interrupted (SIGTERM): ending the session" in err


def test_third_press_stops_waiting_for_a_hung_server(make_peer: Any) -> None:
    peer = make_peer(plan=BIG_PLAN)
    proc = start_client(peer, "--timeout", "10")
    wait_for_acks(peer, proc, 500)
    # From now on the server takes 6 s for any HTTP reply: ending the
    # session would take up to the client's 8 s budget.
    peer.http_delay = 6.0
    t0 = time.monotonic()
    for i in range(HARD_STOP_PRESSES):
        if i:
            time.sleep(PRESS_GAP_S)
        proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert elapsed < HARD_STOP_PRESSES * PRESS_GAP_S + 2.0
    doc = assert_partial_json(out, err, peer, 500)
    # Nothing from the server: the client's own counts, said so.
    assert doc["source"] == "local"
    assert "the counts are what this client received" in doc["note"]
    assert "still ending the session with the server" in err
    assert "press Ctrl-C once more" in err
    assert "not waiting for the server any more" in err


def test_shutdown_is_bounded_when_the_server_hangs(make_peer: Any) -> None:
    peer = make_peer(plan=BIG_PLAN)
    proc = start_client(peer, "--timeout", "1")
    wait_for_acks(peer, proc, 500)
    peer.http_delay = 6.0
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    # Two end attempts of --timeout each plus a backoff, well under 6 s.
    assert time.monotonic() - t0 < 5.0
    assert proc.returncode == 130, err
    doc = assert_partial_json(out, err, peer, 500)
    assert doc["source"] == "local"
    assert "Could not end the session on the server" in err


def test_signals_while_stdout_is_a_slow_pipe_never_cut_the_json(make_peer: Any) -> None:
    # Once, a Ctrl-C while the JSON was being written to a slow reader gave
    # a traceback and half a JSON document.
    peer = make_peer(plan=BIG_PLAN)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # far smaller than the result
    try:
        proc = start_client(peer, "--timeout", "3", stdout=w)
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as reader:
        wait_for_acks(peer, proc, 500)
        proc.send_signal(signal.SIGINT)
        # The first bytes mean the client is writing, and blocked: the pipe
        # holds 4 kB of ~60 kB.
        readable, _, _ = select.select([reader], [], [], 20)
        assert readable, "the client never started writing its result"
        for sig in (signal.SIGINT,) * 4 + (signal.SIGTERM,):
            time.sleep(PRESS_GAP_S)
            proc.send_signal(sig)
        chunks = []
        while chunk := reader.read1(1024):
            chunks.append(chunk)
            time.sleep(0.001)  # a slow reader
        out, err = finish(proc)
    assert proc.returncode == 130, err
    text = b"".join(chunks).decode()
    assert_partial_json(text, err, peer, 500)
    assert "it will not be cut short" in err


def test_reader_leaving_early_is_not_an_error(make_peer: Any) -> None:
    # `kickass-probe --json | head -c 0`: the result is stored on the server;
    # no "Exception ignored ... BrokenPipeError" and no exit code 120.
    peer = make_peer()
    proc = start_client(peer, "--timeout", "2")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert "BrokenPipe" not in err and "Exception ignored" not in err


def test_ctrl_c_while_the_session_is_being_created(make_peer: Any) -> None:
    peer = make_peer(http_delay=5.0)
    proc = start_client(peer, "--timeout", "10")
    deadline = time.monotonic() + 10
    while not peer.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert time.monotonic() - t0 < 2.0  # not after the server's 5 s
    assert proc.returncode == 130
    assert out == ""
    assert "interrupted before the measurement started" in err
    assert "Traceback" not in err


# -- the handler and the runner's waits, in process ----------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_one_press_and_presses_count() -> None:
    notes: list[str] = []
    clock = _Clock()
    stop = StopSignals(note=notes.append, clock=clock)
    assert not stop.requested and stop.exit_code == 130
    for _ in range(5):
        stop.trigger()
        clock.now += 0.01
    assert stop.presses == 1 and stop.signals == 5 and stop.requested
    assert notes == []  # the runner announces the first press itself
    clock.now += PRESS_GAP_S
    stop.trigger()
    assert stop.presses == 2
    assert "still ending the session" in notes[-1] and "press Ctrl-C" in notes[-1]
    clock.now += PRESS_GAP_S
    stop.trigger()
    assert stop.presses == HARD_STOP_PRESSES
    assert "not waiting for the server any more" in notes[-1]
    clock.now += PRESS_GAP_S
    stop.trigger()
    assert "already stopping" in notes[-1]


def test_sigterm_sets_the_exit_code_and_wording() -> None:
    notes: list[str] = []
    clock = _Clock()
    stop = StopSignals(note=notes.append, clock=clock)
    stop.trigger(signal.SIGTERM)
    clock.now += 1
    stop.trigger(signal.SIGINT)  # the first signal names the stop
    assert stop.exit_code == 143 and stop.label == "SIGTERM"
    assert "send SIGTERM once more" in notes[-1]
    assert stop.interrupted().signum == signal.SIGTERM


def test_writing_stage_promises_the_result_is_not_cut() -> None:
    notes: list[str] = []
    clock = _Clock()
    stop = StopSignals(note=notes.append, clock=clock)
    assert stop.stage == RUNNING
    stop.stage = WRITING
    stop.trigger()
    clock.now += 1
    stop.trigger()
    assert notes == ["kickass-probe: printing the result; it will not be cut short\n"]


def test_raise_now_raises_once_before_a_session_exists() -> None:
    stop = StopSignals(note=lambda _t: None, clock=_Clock())
    stop.raise_now = True
    with pytest.raises(Interrupted):
        stop.trigger()
    assert stop.raise_now is False
    stop.trigger()  # counted, not raised


def test_installed_handler_counts_real_signals_instead_of_raising() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stop = StopSignals(note=lambda _t: None)
    assert stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 2
        while stop.signals < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs between bytecodes
    finally:
        stop.restore()
    assert stop.signals == 2 and stop.signum == signal.SIGINT
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _runner(stop: StopSignals) -> Runner:
    class _Progress:
        def update(self, done: int, total: int, description: str) -> None: ...
        def note(self, text: str) -> None: ...
        def close(self) -> None: ...

    return Runner(
        None,  # type: ignore[arg-type]
        {},
        timeout=1.0,
        platform_name="Linux",
        progress=_Progress(),
        log=lambda _t: None,
        stop=stop,
    )


def test_a_hung_request_is_abandoned_at_the_press_that_asks() -> None:
    stop = StopSignals(note=lambda _t: None)
    r = _runner(stop)
    assert r._call(lambda: 42, abandon_at=1) == 42
    with pytest.raises(ValueError, match="boom"):
        r._call(lambda: int("boom"), abandon_at=1)
    threading.Timer(0.2, stop.trigger).start()
    t0 = time.monotonic()
    with pytest.raises(Interrupted):
        r._call(lambda: time.sleep(5), abandon_at=1)
    assert time.monotonic() - t0 < 1.0
    # While stopping, the same press does not abandon the end request...
    assert r._call(lambda: "ended", abandon_at=HARD_STOP_PRESSES) == "ended"
    # ...but the shutdown's deadline does.
    with pytest.raises(ProbeError, match="no answer from the server"):
        r._call(
            lambda: time.sleep(5),
            abandon_at=HARD_STOP_PRESSES,
            deadline=time.monotonic() + 0.2,
        )
