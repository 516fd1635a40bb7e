"""The interleaved trial schedule: pairs of periods, one per *arm*, per destination.

An arm is what one period runs: Kick-Ass (with the padded or the paper's
handshake) or kernel TCP with a congestion control (CUBIC, Reno, BBR). Each
*pair* holds one period of each arm, in an order drawn per pair from the seed
(as flent shuffles its batches), and every period of a pair replays the same
flows (workload.pair_flows): the comparison is paired, flow by flow, and slow
drift and order effects cancel across pairs. The schedule is data: it is
stored with the trial and the runner only executes it, starting each period
at its scheduled time; a ``gap_s`` between periods lets the flows of one
period end before the next begins (what is still running then is cut and
counted as not completed).

An A/A schedule (two arms that are the same, e.g. ``tcp:cubic,tcp:cubic``)
calibrates the comparison: its speedup must be 1 within its interval. An
arm's ``handicap_ms`` (``tcp:cubic+50ms``) delays each of its flows by that
much after it is due, a known difference the comparison must detect.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

KICKASS = "kickass"
TCP = "tcp"
PROTOCOLS = (KICKASS, TCP)
HANDSHAKES = ("padded", "paper")
CONGESTION_CONTROLS = ("cubic", "reno", "bbr")
_ARM = re.compile(r"^(kickass|tcp)(?::([a-z0-9_]+))?(?:\+(\d+(?:\.\d+)?)ms)?$")


@dataclass(frozen=True)
class Arm:
    """What one period of a pair runs."""

    name: str  # unique in the schedule: "kickass", "tcp:cubic", "tcp:cubic#2"...
    protocol: str  # kickass | tcp
    congestion_control: str | None = None  # tcp arms
    handshake: str | None = None  # kickass arms
    handicap_ms: float = 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def parse_arms(
    specs: list[str], *, congestion_control: str = "cubic", handshake: str = "padded"
) -> tuple[Arm, ...]:
    """Arms from specs: ``kickass[:padded|paper]``, ``tcp[:cubic|reno|bbr]``,
    each optionally ``+<ms>ms`` (a handicap). ``congestion_control`` and
    ``handshake`` fill in what a spec leaves out. Repeated specs get ``#2``..."""
    arms: list[Arm] = []
    seen: dict[str, int] = {}
    for spec in specs:
        m = _ARM.match(spec.strip())
        if m is None:
            raise ValueError(
                f"bad arm {spec!r}: kickass[:padded|paper] or tcp[:cubic|reno|bbr], "
                "optionally +<ms>ms"
            )
        protocol, option, handicap = m.group(1), m.group(2), float(m.group(3) or 0)
        if protocol == KICKASS:
            hs = option or handshake
            if hs not in HANDSHAKES:
                raise ValueError(f"bad arm {spec!r}: a Kick-Ass handshake is one of {HANDSHAKES}")
            base, cc = KICKASS if hs == "padded" else f"{KICKASS}:{hs}", None
        else:
            cc, hs = option or congestion_control, None
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", cc):
                raise ValueError(f"bad arm {spec!r}: not a congestion control name")
            base = f"{TCP}:{cc}"
        if handicap:
            base += f"+{handicap:g}ms"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        arms.append(Arm(name, protocol, cc, hs, handicap))
    if not arms:
        raise ValueError("need at least one arm")
    return tuple(arms)


def default_arms(
    protocols: tuple[str, ...] = PROTOCOLS,
    congestion_control: str = "cubic",
    handshake: str = "padded",
) -> tuple[Arm, ...]:
    """The arms of a plain Kick-Ass against TCP trial (``protocols`` narrows it)."""
    if (
        not protocols
        or not set(protocols) <= set(PROTOCOLS)
        or len(set(protocols)) != len(protocols)
    ):
        raise ValueError(f"protocols must be distinct names from {PROTOCOLS}")
    return parse_arms(list(protocols), congestion_control=congestion_control, handshake=handshake)


@dataclass(frozen=True)
class Period:
    index: int
    pair: int
    destination: str
    protocol: str
    start_s: float
    duration_s: float
    arm: str = ""
    congestion_control: str | None = None
    handshake: str | None = None
    handicap_ms: float = 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def interleaved(
    destinations: list[str],
    *,
    pairs: int,
    period_s: float = 120.0,
    gap_s: float = 0.0,
    seed: int = 1,
    protocols: tuple[str, ...] = PROTOCOLS,
    arms: tuple[Arm, ...] | None = None,
) -> list[Period]:
    """Per destination, ``pairs`` pairs holding one period of each arm, back to
    back (``gap_s`` apart). ``arms`` defaults to Kick-Ass and TCP (``protocols``
    narrows that to one of them: a TCP-only baseline, say).

    Destinations take turns pair by pair, so every destination sees the same
    slow drift of the day.
    """
    if pairs < 1 or period_s <= 0 or gap_s < 0:
        raise ValueError("need pairs >= 1, period_s > 0, gap_s >= 0")
    if not destinations or len(set(destinations)) != len(destinations):
        raise ValueError("need distinct destinations")
    the_arms = arms if arms is not None else default_arms(protocols)
    if len({a.name for a in the_arms}) != len(the_arms):
        raise ValueError("arm names must be distinct")
    rng = random.Random(seed)
    out: list[Period] = []
    t = 0.0
    for pair in range(pairs):
        for dest in destinations:
            order = list(the_arms)
            rng.shuffle(order)
            for arm in order:
                out.append(
                    Period(
                        len(out),
                        pair,
                        dest,
                        arm.protocol,
                        t,
                        period_s,
                        arm.name,
                        arm.congestion_control,
                        arm.handshake,
                        arm.handicap_ms,
                    )
                )
                t += period_s + gap_s
    return out
