"""Kick-Ass rate encoding (paper section II-A).

A router advertises a rate R (bytes per millisecond) by cutting a full-size
packet so that its leading fragment carries L bytes of IP payload:
``L = 128 * ln(R / 12.4392)``, inverse ``R = 12.4392 * exp(L / 128)``.
"""

from __future__ import annotations

import math

RATE_SCALE_BYTES_PER_MS = 12.4392
LENGTH_SCALE = 128.0
# 24 bytes keep the whole TCP/UDP header inside the leading fragment.
MIN_LEADING_FRAGMENT_LEN = 24
# A 1500-byte packet has 1480 bytes of IP payload: nothing longer can be cut.
MAX_LEADING_FRAGMENT_LEN = 1480
FRAGMENT_UNIT = 8
IPV4_HEADER_LEN = 20
FULL_PACKET_LEN = 1500
# Absorbs the last-ulp error of exp/ln so that an exact inverse round-trips
# (leading_fragment_len(advertised_rate(L)) == L) instead of dropping 8 bytes.
_ROUNDING_SLACK = 1e-9


def leading_fragment_len_exact(rate_bytes_per_ms: float) -> float:
    """F(R) before any rounding; -inf for a zero rate."""
    if rate_bytes_per_ms <= 0:
        return -math.inf
    return LENGTH_SCALE * math.log(rate_bytes_per_ms / RATE_SCALE_BYTES_PER_MS)


def leading_fragment_len(rate_bytes_per_ms: float) -> int | None:
    """Leading-fragment IP payload length that advertises ``rate_bytes_per_ms``.

    Rounded *down* to a multiple of 8 so a router never advertises more than it
    computed; capped at 1480. ``None`` when the rate is below the smallest
    encodable one (the router then stops fragmenting and endpoints fall back
    to TCP mode).
    """
    exact = leading_fragment_len_exact(rate_bytes_per_ms)
    if exact + _ROUNDING_SLACK < MIN_LEADING_FRAGMENT_LEN:
        return None
    units = math.floor((exact + _ROUNDING_SLACK) / FRAGMENT_UNIT)
    return min(units * FRAGMENT_UNIT, MAX_LEADING_FRAGMENT_LEN)


def advertised_rate(leading_fragment_len: int) -> float:
    """Rate in bytes/ms that a leading fragment of this payload length carries."""
    if not MIN_LEADING_FRAGMENT_LEN <= leading_fragment_len <= MAX_LEADING_FRAGMENT_LEN:
        raise ValueError(
            f"leading_fragment_len {leading_fragment_len} outside "
            f"[{MIN_LEADING_FRAGMENT_LEN}, {MAX_LEADING_FRAGMENT_LEN}]"
        )
    if leading_fragment_len % FRAGMENT_UNIT:
        raise ValueError(f"leading_fragment_len {leading_fragment_len} is not a multiple of 8")
    return RATE_SCALE_BYTES_PER_MS * math.exp(leading_fragment_len / LENGTH_SCALE)


def bytes_per_ms_to_bps(rate_bytes_per_ms: float) -> float:
    return rate_bytes_per_ms * 8000.0


def bps_to_bytes_per_ms(rate_bps: float) -> float:
    return rate_bps / 8000.0


MIN_ADVERTISED_RATE_BYTES_PER_MS = advertised_rate(MIN_LEADING_FRAGMENT_LEN)
