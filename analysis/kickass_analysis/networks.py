"""Which network (ASN) and country an address belongs to, from a table the
operator provides: the volunteers' sessions store only their address, so
their country and network are looked up when a report or the volunteer's
page groups them (RIPE Atlas probes come with their own, in the views).

The table is the ip2asn TSV format (``ip2asn-v4.tsv``, ``ip2asn-combined.tsv``;
optionally gzipped): one range per line,

    range_start  range_end  AS_number  country_code  AS_description

tab-separated, ranges sorted or not, IPv4 and IPv6 alike. AS number 0 (and
country ``None``) means "not routed": such an address has no network. Lines
starting with ``#`` and blank lines are skipped; a malformed line is an error
that names it (a table silently half-read would misplace volunteers).
"""

from __future__ import annotations

import bisect
import gzip
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from kickass_core.errors import KickassError


@dataclass(frozen=True)
class Network:
    asn: int
    country: str | None  # ISO 3166 alpha-2, upper case; None when the table says none


def _key(address: str) -> tuple[int, int] | None:
    try:
        ip = ipaddress.ip_address(address.split("/", 1)[0].strip())
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.version, int(ip))


class NetworkTable:
    """Address ranges -> Network, looked up by bisection."""

    def __init__(self, ranges: list[tuple[tuple[int, int], tuple[int, int], Network]]) -> None:
        ranges = sorted(ranges, key=lambda r: r[0])
        self._starts = [r[0] for r in ranges]
        self._ends = [r[1] for r in ranges]
        self._networks = [r[2] for r in ranges]

    def __len__(self) -> int:
        return len(self._starts)

    @classmethod
    def load(cls, path: str | Path) -> NetworkTable:
        """The table in ``path`` (KickassError naming the line when malformed)."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise KickassError(
                f"cannot read the network table {p}: {exc.strerror or exc}",
                hint="an ip2asn TSV file (range_start, range_end, AS number, country, name)",
            ) from None
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return cls.parse(raw.decode("utf-8", "replace"), str(p))

    @classmethod
    def parse(cls, text: str, where: str = "network table") -> NetworkTable:
        ranges = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            fields = line.split("\t")
            start = _key(fields[0]) if len(fields) >= 4 else None
            end = _key(fields[1]) if len(fields) >= 4 else None
            try:
                asn = int(fields[2]) if len(fields) >= 4 else -1
            except ValueError:
                asn = -1
            if start is None or end is None or start[0] != end[0] or end < start or asn < 0:
                raise KickassError(
                    f"{where}, line {n}: not a range of the ip2asn format: {line[:80]!r}",
                    hint="range_start, range_end, AS number, country, name; tab-separated",
                )
            if asn == 0:
                continue  # not routed
            cc = fields[3].strip().upper()
            country = cc if len(cc) == 2 and cc.isalpha() else None
            ranges.append((start, end, Network(asn, country)))
        return cls(ranges)

    def lookup(self, address: str | None) -> Network | None:
        """The network of ``address`` (an IP, optionally with a /prefix), or None."""
        if not address:
            return None
        key = _key(address)
        if key is None:
            return None
        i = bisect.bisect_right(self._starts, key) - 1
        if i >= 0 and key <= self._ends[i]:
            return self._networks[i]
        return None
