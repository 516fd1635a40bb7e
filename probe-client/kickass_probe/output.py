"""What the volunteer sees: progress on stderr, the summary or JSON on stdout.

Formatting is pure (RunResult in, text or dict out) so it is tested without
a network; the progress displays are the only stateful part.
"""

from __future__ import annotations

import math
import shutil
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

from kickass_core.plan import ProbePlan
from kickass_core.verdict import drop_rate, excess, pool

from . import __version__
from .api import printable
from .runner import RunResult
from .session import LocalCounts

JSON_FORMAT_VERSION = 1
# The compact summary shows each phase as at most this many size ranges.
SUMMARY_RANGES = 6
MAX_NOTABLE = 8
# A size is "notable" when its drop rate exceeds the phase's pooled rate by
# this much and by three binomial standard errors (small samples are noisy).
NOTABLE_MIN_EXCESS = 0.05

SIZE_KEY = {"whole": "ip_len", "split": "leading_ip_len"}


# -- rows: the server's, or the client's own when the server vanished -------------


def phase_rows(result: RunResult, phase: str) -> list[dict[str, Any]]:
    """Per-size rows with at least {size key, sent, acked, drop_rate}."""
    key = SIZE_KEY[phase]
    if result.server_result is not None:
        rows = []
        for raw in result.server_result.get(phase) or []:
            row = dict(raw)
            row.setdefault(key, raw.get("ip_len"))
            row["sent"] = _int(row.get("sent"))
            row["acked"] = _int(row.get("acked"))
            if row.get("drop_rate") is None:
                row["drop_rate"] = drop_rate(row["sent"], row["acked"])
            rows.append(row)
        return sorted(rows, key=lambda r: _int(r.get(key)))
    return local_rows(result.plan, result.local, phase)


def local_rows(plan: ProbePlan, local: LocalCounts, phase: str) -> list[dict[str, Any]]:
    """Rows from local counts: every seq up to the highest received must
    have been sent (the plan's order is fixed), so that is the best
    available lower bound for "sent"."""
    key = SIZE_KEY[phase]
    sent: Counter[int] = Counter()
    for seq in range(min(local.highest_seq + 1, plan.total_probes)):
        probe = plan.probe(seq)
        if probe.phase == phase:
            sent[probe.ip_len] += 1
    counts = local.phase_counts(phase)
    rows = []
    for size in plan.sizes(phase):
        acked = counts[size].received if size in counts else 0
        s = max(sent[size], acked)
        if s == 0:
            continue
        rows.append({key: size, "sent": s, "acked": acked, "drop_rate": drop_rate(s, acked)})
    return rows


# -- JSON -----------------------------------------------------------------------------


def result_json(result: RunResult) -> dict[str, Any]:
    srv = result.server_result or {}
    whole = phase_rows(result, "whole")
    split = phase_rows(result, "split")
    pw, ps = pool(whole), pool(split)
    x = excess(pw["sent"], pw["acked"], ps["sent"], ps["acked"])
    return {
        "format_version": JSON_FORMAT_VERSION,
        "session_id": result.session_id,
        "verdict": srv.get("verdict"),
        "verdict_reason": srv.get("verdict_reason"),
        "state": result.last_state,
        "end_reason": srv.get("end_reason"),
        "incomplete": result.incomplete,
        "outcome": result.outcome,
        "note": result.note,
        "source": "server" if result.server_result is not None else "local",
        "whole": whole,
        "split": split,
        "pooled": {"whole": pw, "split": ps},
        # Split drop minus the two-fragment bound 1 - (1 - whole)^2, with its
        # 95% interval (kickass_core.verdict.excess); null without both phases.
        "excess": None if x is None else x.to_json(),
        # Probes lost while this client's kernel refused fragments (its
        # reassembly memory was full): not in "sent" above, not loss.
        "reassembly_invalid": invalid_counts(result),
        # This client's reassembly memory before, during and after the split
        # phase, and the flow-control budget (kickass_probe.reassembly).
        "reassembly": result.reassembly,
        # --observe-fragments: every probe's fragments before reassembly
        # (null without the option: then only the largest fragment is known).
        "fragment_observation": observation_json(result),
        "total_probes": result.total_probes,
        "plan": srv.get("plan") or result.plan.to_json(),
        "server": result.server_url,
        "session_url": result.session_url,
        # The session's page (HTML), to look at or share; null from a server without pages.
        "page_url": result.page_url,
        "server_version": srv.get("server_version"),
        "client_version": __version__,
        "local": local_json(result.plan, result.local),
        # What this system could not tell (Linux-only facilities missing: macOS,
        # Windows); the numbers for those items above are null, not 0.
        "cannot_tell": cannot_tell(result),
    }


def local_json(plan: ProbePlan, c: LocalCounts) -> dict[str, Any]:
    split_counts = c.split.values()
    # Without IP_RECVFRAGSIZE (not Linux) fragment sizes were never seen: the
    # counts that depend on them are null ("cannot tell"), not 0.
    known = c.frag_size_supported

    def frag(n: int) -> int | None:
        return n if known else None

    return {
        "received": c.received,
        "duplicates": c.duplicates,
        "reordered": c.reordered,
        "corrupted": c.corrupted,
        "wrong_length": c.wrong_length,
        "unexpected_seq": c.unexpected_seq,
        "foreign": c.foreign,
        "highest_seq": c.highest_seq,
        "done_received": c.done_received,
        "frag_size_supported": c.frag_size_supported,
        # The largest fragment as the server cut it (IP_RECVFRAGSIZE): all an
        # unprivileged client can know; swapped pieces pass this test.
        "split_largest_fragment_as_sent": frag(sum(s.as_sent for s in split_counts)),
        # The same number under its pre-0007 name (kept for format_version 1).
        "split_as_sent": frag(sum(s.as_sent for s in split_counts)),
        "split_reassembled": frag(sum(s.reassembled for s in split_counts)),
        "split_refragmented": frag(sum(s.refragmented for s in split_counts)),
        "whole_fragmented": frag(sum(s.refragmented for s in c.whole.values())),
        "whole": [{"ip_len": k, "received": v.received} for k, v in sorted(c.whole.items())],
        "split": [
            {
                "leading_ip_len": k,
                "received": v.received,
                "largest_fragment_as_sent": frag(v.as_sent),
                "as_sent": frag(v.as_sent),
                "reassembled": frag(v.reassembled),
                "refragmented": frag(v.refragmented),
            }
            for k, v in sorted(c.split.items())
        ],
    }


# -- human summary ----------------------------------------------------------------------


def pct(rate: float | None) -> str:
    if rate is None:
        return "-"
    if 0 < rate < 0.001:
        return "<0.1%"
    return f"{rate:.1%}"


def format_summary(result: RunResult, verbose: bool = False) -> str:
    srv = result.server_result or {}
    whole = phase_rows(result, "whole")
    split = phase_rows(result, "split")
    lines: list[str] = []
    # Text that came from the server goes through printable(): the summary
    # lands on a terminal, where control characters would act.
    state = printable(result.last_state, 40)
    head = "Kick-Ass fragment viability"
    if result.incomplete:
        head += f" - INCOMPLETE ({result.outcome}, state {state})"
    lines.append(head)
    if result.note:
        lines.append(
            textwrap.fill(
                printable(result.note), width=96, initial_indent="  ", subsequent_indent="  "
            )
        )
    verdict = srv.get("verdict")
    if verdict:
        lines.append(f"  Verdict: {printable(verdict, 40)}")
        if srv.get("verdict_reason"):
            lines.append(f"           {printable(srv['verdict_reason'])}")
    else:
        lines.append("  Verdict: none (no result from the server)")
    lines.append("")
    lines.append(f"  {'':<18}{'sent':>9}{'acked':>9}{'drop':>8}")
    for label, rows in (("whole packets", whole), ("split datagrams", split)):
        p = pool(rows)
        lines.append(f"  {label:<18}{p['sent']:>9,}{p['acked']:>9,}{pct(p['drop_rate']):>8}")
    lines.append("")
    for text in (
        f"Largest fragment as sent: {splits_as_sent(result.local)}",
        leading_line(result),
        whole_fragmented_line(result, whole),
        excess_line(whole, split),
        *reassembly_lines(result),
    ):
        if text:
            lines.append(
                textwrap.fill(text, width=96, initial_indent="  ", subsequent_indent="    ")
            )
    for phase, all_rows in (("whole", whole), ("split", split)):
        # A partial session has sizes nothing was sent for: not worth a row.
        rows = [r for r in all_rows if r["sent"]]
        if not rows:
            continue
        title = "whole packets, by IP length" if phase == "whole" else "split, by leading_ip_len"
        lines.append("")
        lines.append(f"  {title:<28}{'sent':>9}{'acked':>9}{'drop':>8}")
        for label, r in size_ranges(rows, phase, None if verbose else SUMMARY_RANGES):
            lines.append(f"    {label:<26}{r['sent']:>9,}{r['acked']:>9,}{pct(r['drop_rate']):>8}")
        notable = notable_sizes(rows, phase)
        if notable:
            shown = ", ".join(f"{s} B {pct(rate)}" for s, rate in notable[:MAX_NOTABLE])
            more = f" and {len(notable) - MAX_NOTABLE} more" if len(notable) > MAX_NOTABLE else ""
            lines.append(f"    notable drops: {shown}{more}")
    c = result.local
    lines.append("")
    lines.append(
        textwrap.fill(
            f"This client received {c.received:,} distinct probes; {c.duplicates:,} "
            f"duplicates, {c.reordered:,} reordered, {c.corrupted:,} corrupted, "
            f"{c.wrong_length:,} of the wrong length.",
            width=96,
            initial_indent="  ",
            subsequent_indent="  ",
        )
    )
    if result.server_result is None:
        lines.append("  (Server unreachable: 'sent' counts up to the last probe received.)")
    url = printable(result.session_url)
    lines.append(f"  Session {result.session_id} ({state}): {url}")
    if result.page_url:
        # The last line: the page a volunteer looks at (and may share).
        lines.append(f"  Your results beside other volunteers': {printable(result.page_url)}")
    return "\n".join(lines) + "\n"


# What the summary says where this system lacks a Linux-only facility.
CANNOT_TELL = "cannot tell on this system"
NEEDS_FRAGSIZE = "needs Linux IP_RECVFRAGSIZE"
NEEDS_PROC = "needs Linux /proc"


def cannot_tell(result: RunResult) -> list[dict[str, str]]:
    """What this run could not tell because the system lacks a Linux-only
    facility (macOS, Windows; or a Linux that refuses the call): each item with
    the facility it ``needs`` and what stays unknown (``unknown``)."""
    out: list[dict[str, str]] = []
    if not result.local.frag_size_supported:
        out.append(
            {
                "item": "fragment_sizes",
                "needs": "Linux IP_RECVFRAGSIZE",
                "unknown": "the fragment sizes on arrival: whether each split's largest fragment "
                "was as the server cut it, reassembled or re-cut on the way, and whether whole "
                "packets arrived fragmented (a smaller MTU on the path)",
            }
        )
    r = result.reassembly
    if isinstance(r, dict):
        limits = r.get("limits") or {}
        during = r.get("during") or {}
        if not limits.get("high_thresh"):
            out.append(
                {
                    "item": "reassembly_limit",
                    "needs": "Linux /proc/sys/net/ipv4/ipfrag_high_thresh",
                    "unknown": "this system's reassembly memory limit (Linux's default, 4 MB, "
                    "was assumed for the flow control)",
                }
            )
        if during.get("max_memory") is None:
            out.append(
                {
                    "item": "reassembly_memory",
                    "needs": "Linux /proc/net/sockstat",
                    "unknown": "how full this system's reassembly memory was; the split phase "
                    "was paced by an estimate from the splits that did not arrive",
                }
            )
        if during.get("refused") is None:
            out.append(
                {
                    "item": "refused_fragments",
                    "needs": "Linux /proc/net/snmp",
                    "unknown": "whether this system's kernel refused fragments (memory full): a "
                    "probe lost that way counts as lost on the path, none could be marked invalid",
                }
            )
    return out


def splits_as_sent(c: LocalCounts) -> str:
    received = sum(s.received for s in c.split.values())
    if received == 0:
        return "no split datagram arrived"
    if not c.frag_size_supported:
        return f"{CANNOT_TELL} ({NEEDS_FRAGSIZE})"
    as_sent = sum(s.as_sent for s in c.split.values())
    reassembled = sum(s.reassembled for s in c.split.values())
    other = sum(s.refragmented for s in c.split.values())
    if as_sent == received:
        return (
            f"yes, in all {received:,} splits the largest fragment was as the server cut it "
            "(this cannot tell whether the pieces arrived swapped; --observe-fragments can, "
            "as root)"
        )
    parts = [f"{as_sent:,} of {received:,} with the largest fragment as cut by the server"]
    if reassembled:
        parts.append(
            f"{reassembled:,} reassembled on the way (typical of a NAT or firewall with "
            "connection tracking)"
        )
    if other:
        parts.append(f"{other:,} cut differently on the way")
    return "; ".join(parts)


def observation_json(result: RunResult) -> dict[str, Any] | None:
    obs = result.observer
    if obs is None:
        return None
    per = obs.per_split()
    return {
        **obs.summary(),
        "split": [{"leading_ip_len": size, **row} for size, row in sorted(per.items())],
    }


def leading_line(result: RunResult) -> str | None:
    """The privileged observation's answer: leading fragment as sent or swapped."""
    obs = result.observer
    if obs is None:
        return None
    s = obs.summary()
    seen = s["split_observed"]
    drops = f" ({s['kernel_drops']:,} packets missed by the observer)" if s["kernel_drops"] else ""
    if not seen:
        return f"Leading fragment (observed before reassembly): no split observed{drops}"
    if s["split_leading_as_sent"] == seen:
        return (
            f"Leading fragment as sent (observed before reassembly): yes, in all {seen:,} "
            f"splits{drops}"
        )
    parts = [f"{s['split_leading_as_sent']:,} of {seen:,} as sent"]
    if s["split_swapped"]:
        sizes = s["swapped_leading_ip_lens"]
        span = f"{sizes[0]}-{sizes[-1]} B" if sizes else "?"
        parts.append(
            f"{s['split_swapped']:,} SWAPPED, largest piece first (leading fragment {span}): "
            "something on the path reassembled and re-cut them, and a Kick-Ass receiver "
            "would read another rate"
        )
    if s["split_recut"]:
        parts.append(f"{s['split_recut']:,} cut differently")
    return "Leading fragment (observed before reassembly): " + "; ".join(parts) + drops


def whole_fragmented_line(result: RunResult, whole: list[dict[str, Any]]) -> str | None:
    """A whole packet that arrived fragmented: a link with a smaller MTU."""
    c = result.local
    if not c.frag_size_supported:
        if not any(v.received for v in c.whole.values()):
            return None
        return f"Whole packets arrived fragmented: {CANNOT_TELL} ({NEEDS_FRAGSIZE})"
    fragmented = {k: v.refragmented for k, v in c.whole.items() if v.refragmented}
    if not fragmented:
        return None
    received = sum(v.received for v in c.whole.values())
    smallest = min(fragmented)
    return (
        f"Whole packets arrived fragmented: {sum(fragmented.values()):,} of {received:,} "
        f"(IP length {smallest} B and up): a link on the path has an MTU below {smallest} B, "
        "and something on the way fragmented them"
    )


def excess_line(whole: list[dict[str, Any]], split: list[dict[str, Any]]) -> str | None:
    pw, ps = pool(whole), pool(split)
    x = excess(pw["sent"], pw["acked"], ps["sent"], ps["acked"])
    if x is None:
        return None
    return (
        f"Split loss beyond two whole-packet chances: {x.estimate * 100:+.1f} points "
        f"(95% interval {x.low * 100:+.1f} to {x.high * 100:+.1f})"
    )


def invalid_counts(result: RunResult) -> dict[str, int]:
    srv = result.server_result or {}
    counts = srv.get("reassembly_invalid")
    out = {"whole": 0, "split": 0}
    if isinstance(counts, dict):
        for k in out:
            out[k] = _int(counts.get(k))
    else:
        for phase in out:
            out[phase] = sum(_int(r.get("reassembly_invalid")) for r in srv.get(phase) or [])
    return out


def _mb(n: Any) -> str:
    return f"{_int(n) / 1e6:.1f} MB"


def reassembly_lines(result: RunResult) -> list[str]:
    """What this system's reassembly memory did, and what it means."""
    r = result.reassembly
    if not isinstance(r, dict):
        return []
    during = r.get("during") or {}
    limits = r.get("limits") or {}
    budget = r.get("budget") or {}
    refused = _int(during.get("refused"))
    invalid = invalid_counts(result)
    n_invalid = invalid["whole"] + invalid["split"]
    limit = f"{_mb(limits['high_thresh'])}" if limits.get("high_thresh") else "unknown"
    if during.get("max_memory") is None:
        line = (
            f"Reassembly memory of this system: cannot tell ({NEEDS_PROC}); the split phase "
            "was paced by an estimate from the splits that did not arrive; "
        )
    else:
        line = (
            f"Reassembly memory of this system: peak {_mb(during.get('max_memory'))} of {limit}; "
        )
    if during.get("refused") is None:
        line += (
            "fragments refused by its kernel: cannot tell (a probe lost that way counts as "
            "lost on the path)"
        )
    elif refused:
        line += f"the kernel REFUSED {refused:,} fragments (memory full)"
    else:
        line += "no fragment refused"
    wait = budget.get("zero_credit_s") or 0
    if wait:
        line += f"; the split phase paused {wait:.0f} s to keep it from filling"
    lines = [line]
    if n_invalid:
        lines.append(
            f"WARNING: {n_invalid:,} probes were measured while this system refused fragments "
            "(its reassembly memory was full, not the path's fault); they are marked invalid "
            "and left out of the drop rates"
        )
    elif refused:
        lines.append("No probe was affected by the refused fragments.")
    return lines


def size_ranges(
    rows: list[dict[str, Any]], phase: str, max_ranges: int | None
) -> list[tuple[str, dict[str, Any]]]:
    """Consecutive sizes pooled into at most ``max_ranges`` rows (None: all)."""
    key = SIZE_KEY[phase]
    if max_ranges is None or len(rows) <= max_ranges:
        return [(f"{r[key]} B", r) for r in rows]
    per = math.ceil(len(rows) / max_ranges)
    out = []
    for i in range(0, len(rows), per):
        chunk = rows[i : i + per]
        lo, hi = chunk[0][key], chunk[-1][key]
        out.append((f"{lo}-{hi} B", pool(chunk)))
    return out


def notable_sizes(rows: list[dict[str, Any]], phase: str) -> list[tuple[int, float]]:
    """Sizes lost clearly more often than their phase as a whole, worst first."""
    key = SIZE_KEY[phase]
    base = pool(rows)["drop_rate"]
    if base is None:
        return []
    out = []
    for r in rows:
        rate, sent = r["drop_rate"], r["sent"]
        if rate is None or sent == 0:
            continue
        se = math.sqrt(max(base * (1.0 - base), 1.0 / sent) / sent)
        if rate - base > max(NOTABLE_MIN_EXCESS, 3.0 * se):
            out.append((int(r[key]), float(rate)))
    return sorted(out, key=lambda x: (-x[1], x[0]))


# -- progress ---------------------------------------------------------------------------


class NullProgress:
    def update(self, done: int, total: int, description: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class PlainProgress:
    """For a stderr that is not a terminal: a line per 10%, and the notes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._last_decile = -1

    def update(self, done: int, total: int, description: str) -> None:
        if total <= 0:
            return
        decile = min(10, done * 10 // total)
        if decile > self._last_decile and decile > 0:
            self._last_decile = decile
            print(f"progress: {decile * 10}% ({done:,} of {total:,} probes)", file=self.stream)

    def note(self, text: str) -> None:
        print(text, file=self.stream)

    def close(self) -> None:
        pass


def _hms(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LineProgress:
    """A progress bar with ETA on a terminal without rich (the one-file client):
    one line redrawn in place with a carriage return, at most every
    ``REDRAW_S``, notes printed above it. Standard library only."""

    BAR_WIDTH = 24
    REDRAW_S = 0.2

    def __init__(
        self, stream: TextIO, clock: Callable[[], float] = time.monotonic, width: int | None = None
    ) -> None:
        self.stream = stream
        self._clock = clock
        # One column short of the terminal: a line that wraps cannot be redrawn.
        self._width = (width or shutil.get_terminal_size((80, 24)).columns) - 1
        self._start: float | None = None
        self._drawn_at = -math.inf
        self._line = ""

    def update(self, done: int, total: int, description: str) -> None:
        now = self._clock()
        if self._start is None:
            self._start = now
        if now - self._drawn_at < self.REDRAW_S and done < total:
            return
        self._drawn_at = now
        frac = min(1.0, max(0.0, done / total)) if total > 0 else 0.0
        filled = int(frac * self.BAR_WIDTH)
        bar = "#" * filled + "-" * (self.BAR_WIDTH - filled)
        elapsed = now - self._start
        if 0 < done < total and elapsed > 0:
            eta = _hms(elapsed * (total - done) / done)
        else:
            eta = "-:--:--" if done < total else _hms(0)
        self._draw(
            f"{description[:26]:<26} [{bar}] {done:,}/{total:,} probes {_hms(elapsed)} ETA {eta}"
        )

    def _draw(self, line: str) -> None:
        line = line[: max(20, self._width)]
        pad = " " * max(0, len(self._line) - len(line))
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()
        self._line = line

    def note(self, text: str) -> None:
        line = self._line
        if line:
            self.stream.write("\r" + " " * len(line) + "\r")
        print(text, file=self.stream)
        if line:
            self._line = ""
            self._draw(line)
        else:
            self.stream.flush()

    def close(self) -> None:
        if self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = ""


class RichProgress:
    """A progress bar with ETA on a terminal (stderr), notes printed above it."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(file=stream, highlight=False)
        self._progress = Progress(
            TextColumn("{task.description:<26}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("probes"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task: Any = None
        self._started = False

    def update(self, done: int, total: int, description: str) -> None:
        if not self._started:
            self._progress.start()
            self._task = self._progress.add_task(description, total=total)
            self._started = True
        self._progress.update(self._task, completed=done, total=total, description=description)

    def note(self, text: str) -> None:
        self.console.print(text, markup=False)

    def close(self) -> None:
        if self._started:
            self._progress.stop()
            self._started = False


def make_progress(stream: TextIO | None = None, enabled: bool = True, use_rich: bool = True) -> Any:
    """The progress display for ``stream``: rich's bar on a terminal (``use_rich``
    and rich importable), else a plain bar redrawn in place on a terminal, else
    a line every 10%."""
    stream = stream or sys.stderr
    if not enabled:
        return NullProgress()
    if stream.isatty():
        if use_rich:
            try:
                return RichProgress(stream)
            except ImportError:
                pass  # a Python without rich: the plain bar says the same
        return LineProgress(stream)
    return PlainProgress(stream)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
