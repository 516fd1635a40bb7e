"""The interleaved trial schedule: pairs of periods, one per *arm*, per destination.

An arm is what one period runs: Kick-Ass (with the padded or the paper's
handshake, and TCP mode's congestion control: ``kickass[:padded|paper][/cubic|newreno]``),
kernel TCP with a congestion control (``tcp[:cubic|reno|bbr]``), or Kick-Ass with a
share of the period's flows kernel TCP (``kickass@tcp50``: half of them; the same flows
in every period of a pair, so the TCP flows' completion times with and without Kick-Ass
beside them are paired, the paper's §III-D1 and §IV-A question). Each
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

# An arm's handshake and congestion controls are the flow record's words
# (kickass_core.flow_record), which the server's models take too.
from kickass_core.flow_record import (
    CONGESTION_CONTROL_RE,
    CONGESTION_CONTROLS,
    DEFAULT_CONGESTION_CONTROL,
    HANDSHAKES,
    PROTOCOLS,
    TRANSPORT_CONGESTION_CONTROLS,
)

KICKASS, TCP = PROTOCOLS
# The grammar, as said to whoever writes an arm.
ARM_GRAMMAR = (
    f"kickass[:{'|'.join(HANDSHAKES)}][/{'|'.join(TRANSPORT_CONGESTION_CONTROLS)}][@tcpNN], "
    f"tcp[:{'|'.join(CONGESTION_CONTROLS)}]"
)
_ARM = re.compile(
    r"^(kickass|tcp)(?::([a-z0-9_]+))?(?:/([a-z0-9_]+))?(?:@tcp(\d{1,2}))?"
    r"(?:\+(\d+(?:\.\d+)?)ms)?$"
)


@dataclass(frozen=True)
class Arm:
    """What one period of a pair runs."""

    name: str  # unique in the schedule: "kickass", "tcp:cubic", "tcp:cubic#2"...
    protocol: str  # kickass | tcp
    congestion_control: str | None = None  # tcp arms, and a kickass arm's TCP share
    handshake: str | None = None  # kickass arms
    handicap_ms: float = 0.0
    # kickass arms: TCP mode's congestion control in the transport.
    transport_cc: str | None = None
    # kickass arms: the share of the period's flows run as kernel TCP instead.
    tcp_share: float = 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def parse_arms(
    specs: list[str],
    *,
    congestion_control: str = DEFAULT_CONGESTION_CONTROL,
    handshake: str = "padded",
) -> tuple[Arm, ...]:
    """Arms from specs: ``kickass[:padded|paper][/cubic|newreno][@tcpNN]``,
    ``tcp[:cubic|reno|bbr]``, each optionally ``+<ms>ms`` (a handicap).
    ``congestion_control`` and ``handshake`` fill in what a spec leaves out
    (the kernel's congestion control also runs a Kick-Ass arm's TCP share).
    The default transport congestion control (cubic) is left out of names,
    so ``kickass`` names what it always named. Repeated specs get ``#2``..."""
    arms: list[Arm] = []
    seen: dict[str, int] = {}
    for spec in specs:
        m = _ARM.match(spec.strip())
        if m is None:
            raise ValueError(f"bad arm {spec!r}: {ARM_GRAMMAR}, optionally +<ms>ms")
        protocol, option, tcc, share, handicap = m.groups()
        handicap_ms = float(handicap or 0)
        if protocol == KICKASS:
            hs = option or handshake
            if hs not in HANDSHAKES:
                raise ValueError(f"bad arm {spec!r}: a Kick-Ass handshake is one of {HANDSHAKES}")
            if tcc is not None and tcc not in TRANSPORT_CONGESTION_CONTROLS:
                raise ValueError(
                    f"bad arm {spec!r}: Kick-Ass's TCP mode runs one of "
                    f"{TRANSPORT_CONGESTION_CONTROLS}"
                )
            tcp_share = int(share) / 100 if share else 0.0
            if share and not 0 < tcp_share < 1:
                raise ValueError(f"bad arm {spec!r}: @tcpNN is a share from 1 to 99 percent")
            base = KICKASS if hs == "padded" else f"{KICKASS}:{hs}"
            if tcc and tcc != DEFAULT_CONGESTION_CONTROL:
                base += f"/{tcc}"
            if share:
                base += f"@tcp{int(share)}"
            cc = congestion_control if share else None
            transport_cc = tcc or DEFAULT_CONGESTION_CONTROL
        else:
            if tcc is not None or share is not None:
                raise ValueError(f"bad arm {spec!r}: /cc and @tcpNN are for Kick-Ass arms")
            cc, hs, transport_cc, tcp_share = option or congestion_control, None, None, 0.0
            if not CONGESTION_CONTROL_RE.fullmatch(cc):
                raise ValueError(f"bad arm {spec!r}: not a congestion control name")
            base = f"{TCP}:{cc}"
        if handicap_ms:
            base += f"+{handicap_ms:g}ms"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        arms.append(Arm(name, protocol, cc, hs, handicap_ms, transport_cc, tcp_share))
    if not arms:
        raise ValueError("need at least one arm")
    return tuple(arms)


def default_arms(
    protocols: tuple[str, ...] = PROTOCOLS,
    congestion_control: str = DEFAULT_CONGESTION_CONTROL,
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
    transport_cc: str | None = None
    tcp_share: float = 0.0

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
                        arm.transport_cc,
                        arm.tcp_share,
                    )
                )
                t += period_s + gap_s
    return out
