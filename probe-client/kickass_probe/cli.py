"""`kickass-probe`: measure whether fragmented IPv4 reaches you.

Argument parsing, the consent question, and printing; the measurement
itself is runner.Runner. Failures are ProbeError, printed as ``ERROR: ...``
plus a hint, never as a traceback (exit codes in errors.py). Ctrl-C and
SIGTERM are signals.StopSignals: the result is always printed, in one piece.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from typing import Any, TextIO

from kickass_core.cli import program
from kickass_core.plan import PlanError, ProbePlan
from kickass_core.rate import FULL_PACKET_LEN, IPV4_HEADER_LEN

from . import __version__
from .api import ApiClient, normalize_server_url, printable
from .errors import (
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_USAGE,
    ProbeError,
)
from .observe import ObserverUnavailable, open_packet_socket
from .output import format_summary, make_progress, result_json
from .reassembly import on_linux
from .runner import Runner, observe_error
from .signals import WRITING, StopSignals

ENV_SERVER = "KICKASS_SERVER"
DEFAULT_REPETITIONS = 100  # the paper's N
DEFAULT_STEP = 8  # the paper's 8-byte steps
# The paper's stop-and-wait (W=1) needs ~36,600 round trips: an hour at
# 100 ms. By default the server adapts the window (kickass_server.window):
# it grows from the measured RTT while the path shows no queue and no loss
# the window causes, up to AUTO_MAX_WINDOW, paced to at most 8 Mbit/s, so the
# paper's plan takes about a minute at 100 ms. --window N is exactly N
# (--window 1 the exact paper method).
AUTO_WINDOW = "auto"
DEFAULT_WINDOW = AUTO_WINDOW
# The reference server's largest window: only for the consent notice's
# estimate; the server's plan says what it chose.
AUTO_MAX_WINDOW = 64
DEFAULT_TIMEOUT_S = 10.0

EPILOG = """\
what is collected:
  the server stores your public IP address (as it sees it), the probe
  results, your system's IPv4 reassembly limits and counters (how full its
  fragment memory was), this client's version and your OS name. Nothing else.

exit codes:
  0    measurement complete (whatever the verdict)
  1    error: server unreachable, bad reply, UDP blocked, rate-limited...
  2    usage error, or no consent given (nothing was sent)
  3    measurement incomplete (server vanished, ended the session early or
       made no progress); partial results printed
  130  interrupted by Ctrl-C; the session was ended and partial results printed
  143  the same, for SIGTERM

Ctrl-C (or SIGTERM) ends the session with the server and prints the partial
result; pressing it twice more stops waiting for the server.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _window(text: str) -> int | str:
    if text.strip().lower() == AUTO_WINDOW:
        return AUTO_WINDOW
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"not a whole number of at least 1 or {AUTO_WINDOW!r}: {text!r}"
        ) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = program(
        "kickass-probe",
        __version__,
        description="Measure whether fragmented IPv4 packets reach you (the Kick-Ass\n"
        "fragment viability study): the server sends whole packets of every size and\n"
        "datagrams split in two fragments; this client acknowledges what arrives.\n"
        "No root needed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--server",
        metavar="URL",
        help=f"measurement server, e.g. https://measure.example.org (default: ${ENV_SERVER})",
    )
    plan = p.add_argument_group("probe plan (the server may adjust it; the summary says)")
    plan.add_argument(
        "--repetitions",
        "-n",
        type=_positive_int,
        metavar="N",
        help=f"probes per size (default {DEFAULT_REPETITIONS}, the paper's)",
    )
    plan.add_argument(
        "--step",
        type=_positive_int,
        metavar="BYTES",
        help=f"size step, a multiple of 8 (default {DEFAULT_STEP}, the paper's)",
    )
    plan.add_argument(
        "--window",
        "-w",
        type=_window,
        metavar="W",
        help="probes in flight at once. Default 'auto': the server starts with a few and "
        "grows the window from the measured round-trip time while it sees no queue building "
        f"and no loss its own sending causes, up to {AUTO_MAX_WINDOW}, sending at most "
        "8 Mbit/s (a rate your connection should not notice); the full plan takes about a "
        "minute at 100 ms. A number fixes the window: --window 1 is the paper's "
        "stop-and-wait (about an hour at 100 ms)",
    )
    plan.add_argument(
        "--quick",
        action="store_true",
        help="the server's quick plan: coarse sizes, a few probes each (seconds)",
    )
    p.add_argument(
        "--observe-fragments",
        action="store_true",
        help="also read every probe's fragments before your system reassembles them (needs "
        "root or CAP_NET_RAW): tells whether a split's leading fragment arrived as sent or "
        "swapped; without it only the largest fragment is known",
    )
    p.add_argument("--yes", "-y", action="store_true", help="agree to the data collection")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of a summary"
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for an HTTP reply or the UDP challenge (default "
        f"{DEFAULT_TIMEOUT_S:g}); the server counts as gone after 3x this without news",
    )
    p.add_argument(
        "--verbose", "-v", action="store_true", help="show protocol steps and every probe size"
    )
    return p


def plan_request(args: argparse.Namespace) -> tuple[dict[str, Any], ProbePlan]:
    """The plan to ask for, and the local estimate of it for the notice."""
    if args.quick:
        if any(v is not None for v in (args.repetitions, args.step, args.window)):
            raise ProbeError(
                "--quick cannot be combined with --repetitions, --step or --window",
                exit_code=EXIT_USAGE,
            )
        return {"quick": True}, ProbePlan.quick()
    window = args.window or DEFAULT_WINDOW
    req: dict[str, Any] = {
        "repetitions": args.repetitions or DEFAULT_REPETITIONS,
        "step": args.step or DEFAULT_STEP,
        "window": window,
    }
    adaptive = window == AUTO_WINDOW
    try:
        estimate = ProbePlan.build(
            repetitions=req["repetitions"],
            step=req["step"],
            window=AUTO_MAX_WINDOW if adaptive else int(window),
            adaptive=adaptive,
        )
    except PlanError as exc:
        raise ProbeError(str(exc), exit_code=EXIT_USAGE) from None
    return req, estimate


def plan_volume_bytes(plan: ProbePlan) -> int:
    """IP bytes the server sends (a split carries one extra IP header)."""
    whole = sum(plan.whole) * plan.repetitions
    split = len(plan.split) * plan.repetitions * (FULL_PACKET_LEN + IPV4_HEADER_LEN)
    return whole + split


def consent_notice(server: str, plan: ProbePlan, os_name: str, observe: bool = False) -> str:
    volume = plan_volume_bytes(plan)
    size = f"{volume / 1e6:.0f} MB" if volume >= 1e6 else f"{volume / 1e3:.0f} kB"
    reassembly = (
        "  - your system's IPv4 reassembly limits and counters (/proc/net: how full its\n"
        "    fragment memory was; the study paces itself by them)\n"
        if on_linux()
        # macOS, Windows: the system does not tell them (the summary says "cannot tell").
        else "  - your system's IPv4 reassembly limits and counters: none, this system does\n"
        "    not tell them (only Linux does)\n"
    )
    observed = (
        "  - (--observe-fragments) the length and number of the fragments of each probe,\n"
        "    read before your system reassembles them (only the server's probes)\n"
        if observe
        else ""
    )
    return (
        "kickass-probe tests whether fragmented IPv4 packets reach this computer.\n"
        f"The server {server} will send you about {plan.total_probes:,} UDP probes "
        f"(~{size}), and will store:\n"
        "  - your public IP address, as the server sees it\n"
        "  - the probe results (which probes arrived, their sizes, the fragment sizes\n"
        "    your system observed)\n"
        f"{reassembly}"
        f"{observed}"
        f"  - this client's version ({__version__}) and your OS name ({os_name})\n"
        "Nothing else is collected.\n"
    )


def ask_consent(
    notice: str, yes: bool, stdin: TextIO, stderr: TextIO
) -> None:  # raises ProbeError when not agreed
    stderr.write(notice)
    if yes:
        stderr.write("Agreed with --yes.\n")
        stderr.flush()
        return
    if not stdin.isatty():
        raise ProbeError(
            "consent needed, and there is no terminal to ask on",
            hint="run kickass-probe in a terminal to answer, or pass --yes to agree",
            exit_code=EXIT_USAGE,
        )
    stderr.write("Continue? [y/N] ")
    stderr.flush()
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise ProbeError("not agreed: nothing was sent", exit_code=EXIT_USAGE)


def os_name() -> str:
    return platform.system() or "unknown"


def main(argv: list[str] | None = None, *, use_rich: bool = True) -> int:
    """The command; ``use_rich=False`` (the one-file client) draws the progress
    bar with the standard library only, whatever this Python has installed."""
    args = build_parser().parse_args(argv)
    stop = StopSignals()
    # Until the runner owns a session, the first Ctrl-C simply stops the
    # client (also out of the consent prompt): there is nothing to save.
    stop.raise_now = True
    stop.install()
    try:
        return _main(args, stop, use_rich)
    finally:
        # Called as a function (argv given: tests, embedding), give the
        # caller its handlers back. As the program itself, keep ours until
        # the process exits, so a late Ctrl-C cannot print a traceback after
        # the result.
        if argv is not None:
            stop.restore()


def _main(args: argparse.Namespace, stop: StopSignals, use_rich: bool = True) -> int:
    stderr = sys.stderr
    progress = make_progress(stderr, use_rich=use_rich)

    def log(text: str) -> None:
        if args.verbose:
            progress.note(f"  {text}")

    try:
        server = args.server or os.environ.get(ENV_SERVER)
        if not server:
            raise ProbeError(
                "no measurement server given",
                hint=f"pass --server URL or set {ENV_SERVER}",
                exit_code=EXIT_USAGE,
            )
        server = normalize_server_url(server)
        request, estimate = plan_request(args)
        if args.observe_fragments:
            # Before the question: without the privilege there is nothing to ask.
            try:
                open_packet_socket(rcvbuf=4096).close()
            except ObserverUnavailable as exc:
                raise observe_error(str(exc)) from None
        notice = consent_notice(server, estimate, os_name(), args.observe_fragments)
        ask_consent(notice, args.yes, sys.stdin, stderr)
        api = ApiClient(server, timeout=args.timeout, log=log, notify=progress.note)
        runner = Runner(
            api,
            request,
            timeout=args.timeout,
            platform_name=os_name(),
            progress=progress,
            log=log,
            stop=stop,
            observe_fragments=args.observe_fragments,
        )
        # From here on a signal is only counted; the runner stops cleanly.
        stop.raise_now = False
        result = runner.run()
    except ProbeError as exc:
        stop.raise_now = False
        progress.close()
        print(f"ERROR: {exc.message}", file=stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        stop.raise_now = False
        progress.close()
        print("\ninterrupted before the measurement started", file=stderr)
        return stop.exit_code
    except Exception as exc:  # a bug: say so plainly, traceback on request
        stop.raise_now = False
        progress.close()
        if args.verbose:
            traceback.print_exc()
        print(f"ERROR: internal error: {type(exc).__name__}: {exc}", file=stderr)
        print("hint: please report this; --verbose shows the traceback", file=stderr)
        return EXIT_ERROR

    # Signals from here on only add a note: the result is written whole.
    stop.stage = WRITING
    if result.exit_code == EXIT_INCOMPLETE and result.note:
        print(f"WARNING: measurement incomplete: {result.note}", file=stderr)
    if args.json:
        text = json.dumps(result_json(result)) + "\n"
    else:
        text = format_summary(result, verbose=args.verbose)
    try:
        write_result(text, sys.stdout)
    except OSError as exc:  # e.g. EIO: the terminal went away; not a bug
        print(f"ERROR: cannot write the result: {exc.strerror or exc}", file=stderr)
        where = result.page_url or result.session_url
        print(f"hint: it is stored on the server: {printable(where)}", file=stderr)
        return EXIT_ERROR
    return result.exit_code


def write_result(text: str, stream: TextIO) -> None:
    """Write the whole result, built beforehand, and never only part of it.

    Signals no longer raise during the write (they are counted), but that is
    not enough: on a pipe, CPython 3.11's BufferedWriter drops the rest of a
    large write when a signal interrupts it after a partial write (seen with
    strace: one write() returning 4096 of 60,001 bytes, then none, while
    stdout.write reported everything written). So the encoded text goes out
    through os.write in a loop, which resumes after every partial write.
    A reader that left (``kickass-probe --json | head -c 10``) is not an
    error: the result is stored on the server.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None  # not a real file (a test's StringIO): nothing can cut it
    try:
        if fd is None:
            stream.write(text)
            stream.flush()
            return
        stream.flush()  # whatever was printed before goes first
        data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8", "replace"))
        while data:
            data = data[os.write(fd, data) :]
    except BrokenPipeError:
        if fd is None:
            return
        # Point the descriptor at /dev/null: otherwise the interpreter's
        # final flush of stdout fails again and prints "Exception ignored
        # ... BrokenPipeError" on stderr.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
