"""One side of a congestion experiment, run inside a sender namespace.

    python -m kickass_testbed.congestion_driver kickass --agent URL --flows 8 ...
    python -m kickass_testbed.congestion_driver tcp --agent URL --flows 8 --epoch 8:20 ...

``kickass``: long-lived Kick-Ass flows, all from one ``ka-send`` (one endpoint),
for ``--duration`` seconds. ``tcp``: kernel TCP flows (the trial's baseline
sender, ``kickass_wan.tcpflow``) switched on for each ``--epoch START:END``
(seconds from the driver's start) and cut at its end. Both ask the agent for
their own flow tokens (the agent secret in ``KICKASS_AGENT_SECRET``) and print
NDJSON on stdout: every ``--interval`` one line per running flow,
``{"type": "progress", "flow", "protocol", "t" (unix seconds), "acked_bytes",
"ka_mode"}``, and ``{"type": "done", ...}`` at the end. The experiment
(``kickass_testbed.congestion``) turns the lines into per-flow rates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kickass_core.flow_record import DEFAULT_CONGESTION_CONTROL
from kickass_wan.tcpflow import TcpProgress, send_flow
from kickass_wan.trials.runner import AgentClient, AgentRef

_print_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def _client(url: str) -> AgentClient:
    secret = os.environ.get("KICKASS_AGENT_SECRET", "")
    if not secret:
        raise SystemExit("congestion_driver: KICKASS_AGENT_SECRET is not set")
    return AgentClient(AgentRef("far", url, secret))


def _wait_until(at: float | None) -> None:
    """Sleep until unix time ``at`` (both drivers share one start)."""
    if at is not None:
        time.sleep(max(0.0, at - time.time()))


def run_kickass(args: argparse.Namespace) -> int:
    client = _client(args.agent)
    tokens, port = client.tokens("kickass", args.flows)
    _wait_until(args.at)
    host = client.agent.host
    cmd = [
        args.ka_send,
        "--agent", f"{host}:{port}",
        "--schedule", "-",
        # Each flow gives up at the run's end and prints its record.
        "--timeout", f"{args.duration:g}",
        "--progress", f"{int(args.interval * 1000)}ms",
        "--cc", args.cc,
    ]  # fmt: skip
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    for i, tok in enumerate(tokens):
        line = {
            "flow_id": f"ka-{i}",
            "start_s": i * args.stagger,
            "size_bytes": args.size,
            "token_hex": tok.hex(),
        }
        proc.stdin.write(json.dumps(line) + "\n")
    proc.stdin.close()
    timer = threading.Timer(args.duration + args.flows * args.stagger + 5, proc.terminate)
    timer.start()
    ended: dict[str, Any] = {}
    try:
        for raw in proc.stdout:
            try:
                out = json.loads(raw)
            except ValueError:
                continue
            if out.get("type") == "progress":
                emit(
                    {
                        "type": "progress",
                        "flow": out["flow_id"],
                        "protocol": "kickass",
                        "t": spawned + out["t_ns"] / 1e9,
                        "acked_bytes": out["acked_bytes"],
                        "ka_mode": out["ka_mode"] == "kickass",
                        "cwnd_bytes": out.get("cwnd_bytes"),
                        "flight_bytes": out.get("flight_bytes"),
                    }
                )
            elif "flow_id" in out:
                rec = out.get("record") or {}
                ended[out["flow_id"]] = {
                    "error": out.get("error"),
                    "mode_switches": rec.get("mode_switch_count"),
                    "ka_mode_fraction": rec.get("ka_mode_fraction"),
                    **{
                        k: rec.get(k)
                        for k in (
                            "retransmissions",
                            "rto_count",
                            "fast_retransmits",
                            "datagrams_sent",
                        )
                    },
                }
    finally:
        timer.cancel()
        proc.wait(30)
    emit({"type": "done", "protocol": "kickass", "flows": ended})
    return 0


# The kernel's loss-recovery counters of this namespace (its TCP flows are
# the driver's alone): how the TCP flows met their losses.
_TCP_EXT = ("TCPTimeouts", "TCPLossProbes", "TCPLossProbeRecovery", "TCPSackRecovery",
            "TCPLostRetransmit", "TCPSpuriousRTOs")  # fmt: skip


def _tcp_ext() -> dict[str, int]:
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return {k: int(row[k]) for k in _TCP_EXT if k in row}
    return {}


def run_tcp(args: argparse.Namespace) -> int:
    client = _client(args.agent)
    epochs = [tuple(float(x) for x in e.split(":")) for e in args.epoch]
    tokens, port = client.tokens("tcp", args.flows * len(epochs))
    addr = (client.agent.host, port)
    _wait_until(args.at)
    t0 = time.monotonic()
    wall0 = time.time()
    results: dict[str, Any] = {}

    def one(label: str, tok: bytes, start: float, end: float) -> None:
        wait = t0 + start - time.monotonic()
        if wait > 0:
            time.sleep(wait)

        def progress(p: TcpProgress) -> None:
            emit(
                {
                    "type": "progress",
                    "flow": label,
                    "protocol": "tcp",
                    "t": wall0 + (p.at - t0),
                    "acked_bytes": p.acked_bytes,
                    "ka_mode": False,
                    "cwnd_bytes": p.cwnd_bytes,
                    "flight_bytes": p.unacked_bytes,
                }
            )

        r = send_flow(
            addr,
            tok,
            args.size,
            args.cc,
            max(0.1, t0 + end - time.monotonic()),
            progress=progress,
            progress_interval_s=args.interval,
        )
        results[label] = {
            "error": r.error,
            "completed": r.completed,
            "retransmissions": r.retransmissions,
        }

    threads = []
    k = 0
    for e, (start, end) in enumerate(epochs):
        for i in range(args.flows):
            label = f"tcp-{i}" if len(epochs) == 1 else f"tcp-{e}-{i}"
            th = threading.Thread(
                target=one, args=(label, tokens[k], start + i * args.stagger, end), daemon=True
            )
            k += 1
            th.start()
            threads.append(th)
    for th in threads:
        th.join()
    emit({"type": "done", "protocol": "tcp", "flows": results, "netstat": _tcp_ext()})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="side", required=True)
    for name in ("kickass", "tcp"):
        p = sub.add_parser(name)
        p.add_argument("--agent", required=True, help="the agent's control URL")
        p.add_argument("--flows", type=int, default=8)
        p.add_argument(
            "--size", type=int, required=True, help="bytes per flow (more than it can send)"
        )
        p.add_argument("--interval", type=float, default=0.1, help="progress every S seconds")
        p.add_argument("--stagger", type=float, default=0.01, help="between flow starts, s")
        p.add_argument(
            "--cc",
            default=DEFAULT_CONGESTION_CONTROL,
            help="TCP mode's (kickass) or the kernel's (tcp)",
        )
        p.add_argument("--at", type=float, help="start the flows at this unix time")
        if name == "kickass":
            p.add_argument("--duration", type=float, required=True)
            p.add_argument("--ka-send", required=True)
        else:
            p.add_argument("--epoch", action="append", required=True, help="START:END, s")
    args = ap.parse_args(argv)
    return run_kickass(args) if args.side == "kickass" else run_tcp(args)


if __name__ == "__main__":
    sys.exit(main())
