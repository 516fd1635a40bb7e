"""RTT indicators (paper section II-B): endpoints tell routers their RTT.

Every 100 ms an endpoint sends one DF packet whose IP length is 600..611.
Length 600 + k stands for RTTs in [2^k, 2^(k+1)) ms; 600 also covers
anything below 2 ms and 611 anything from 2048 ms up.
"""

from __future__ import annotations

import math

RTT_INDICATOR_MIN_LEN = 600
RTT_INDICATOR_MAX_LEN = 611
RTT_INDICATOR_INTERVAL_MS = 100
# 611 is open-ended; 1.5x its lower bound mirrors the midpoint of every other bucket.
_TOP_BUCKET_RTT_MS = 3072.0


def is_rtt_indicator(ip_len: int, dont_fragment: bool) -> bool:
    return dont_fragment and RTT_INDICATOR_MIN_LEN <= ip_len <= RTT_INDICATOR_MAX_LEN


def rtt_indicator(rtt_ms: float) -> int:
    """IP length of the indicator packet an endpoint sends for ``rtt_ms``."""
    if rtt_ms < 2.0:
        return RTT_INDICATOR_MIN_LEN
    k = int(math.floor(math.log2(rtt_ms)))
    return min(RTT_INDICATOR_MIN_LEN + k, RTT_INDICATOR_MAX_LEN)


def rtt_indicator_range_ms(ip_len: int) -> tuple[float, float]:
    """[low, high) RTT range in ms that an indicator length stands for."""
    if not RTT_INDICATOR_MIN_LEN <= ip_len <= RTT_INDICATOR_MAX_LEN:
        raise ValueError(f"{ip_len} is not an RTT indicator length (600..611)")
    k = ip_len - RTT_INDICATOR_MIN_LEN
    if k == 0:
        return (0.0, 2.0)
    if ip_len == RTT_INDICATOR_MAX_LEN:
        return (2.0**k, math.inf)
    return (2.0**k, 2.0 ** (k + 1))


def rtt_indicator_midpoint_ms(ip_len: int) -> float:
    """RTT a router takes from an indicator: the midpoint of its range.

    600 is read as 1 ms (the paper's value), 611 as 3072 ms.
    """
    low, high = rtt_indicator_range_ms(ip_len)
    if ip_len == RTT_INDICATOR_MIN_LEN:
        return 1.0
    if math.isinf(high):
        return _TOP_BUCKET_RTT_MS
    return (low + high) / 2.0
