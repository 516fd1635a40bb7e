"""A RIPE Atlas campaign as data: the YAML file, validated, and the plan it implies.

A campaign is the fragment viability study (paper §IV-C) run from
Atlas probes: the probes ping the server's ICMP responder, which answers
``whole`` sizes with ordinary replies and 1500-byte requests with replies cut
at the ``split`` sweep's leading-fragment lengths, one split per reply. So one
Atlas measurement covers the whole split sweep, and each whole size needs a
measurement of its own (an Atlas ping has one size).

Everything here is pure: the plan, its credit cost and the budget check run
without a key and without the network (``kickass atlas plan``).

Atlas vocabulary: ``size`` is the ICMP *data* length of an echo request
(IP length = size + 28), ``packets`` the echo requests per ping (1..16),
``interval`` the seconds between two pings of one probe, ``packet_interval``
the milliseconds between the packets of one ping; a *result* is one ping of
one probe. A result costs ``packets * (size // 1500 + 1)`` credits (RIPE
Atlas credit rules); the real figure is read back after creation.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kickass_core.errors import KickassError
from kickass_core.plan import PAPER_WHOLE_MAX, SPLIT, WHOLE, split_leading_ip_lens, whole_ip_lens
from kickass_core.rate import FRAGMENT_UNIT, FULL_PACKET_LEN, IPV4_HEADER_LEN

CAMPAIGN_VERSION = 1
ICMP_HEADER_LEN = 8
ECHO_OVERHEAD = IPV4_HEADER_LEN + ICMP_HEADER_LEN  # IP length = Atlas size + 28
# Atlas probes put their own record (timespec 16 + index 4 + cookie 8,
# padded: 32 bytes on 64-bit probes) at the start of the echo data and pad a
# smaller size up to it (fmticmp4 in ping.c; the real evping sends 60-byte
# requests for -s 0..32), so a smaller whole size would arrive larger than
# planned.
MIN_ATLAS_DATA = 32
# The probe caps its data at 4096 - 20 - 8 bytes (MAX_DATA_SIZE in ping.c).
MAX_ATLAS_DATA = 4068
MIN_WHOLE_IP_LEN = ECHO_OVERHEAD + MIN_ATLAS_DATA
SPLIT_REQUEST_IP_LEN = FULL_PACKET_LEN
# The Atlas API's bounds for ping measurements.
MAX_PACKETS = 16
MIN_INTERVAL_S = 60
MIN_PACKET_INTERVAL_MS = 2
# The firmware refuses more than 60000 ms ("bad interval"); RIPE's own
# command-line tools cap at 30000. The lower of the two: a value both the
# probes and RIPE's tools accept, and the interval is also the per-packet
# timeout, for which 30 s is already far beyond any Internet RTT.
MAX_PACKET_INTERVAL_MS = 30_000
# RIPE Atlas's limit on probes per user-defined measurement.
MAX_PROBES = 1000
PROBE_SELECTORS = ("area", "country", "asn", "prefix", "ids")
AREAS = ("WW", "West", "North-Central", "South-Central", "North-East", "South-East")
DEFAULT_WHOLE_SAMPLE = 4


class CampaignError(KickassError):
    """The campaign file is wrong; the message names the field."""


def wire_ip_len(size: int) -> int:
    """The IP length of a probe's echo request for an Atlas ``size``."""
    return ECHO_OVERHEAD + min(max(size, MIN_ATLAS_DATA), MAX_ATLAS_DATA)


def credits_per_result(packets: int, size: int) -> int:
    """Credits one result (one ping of one probe) costs, by the Atlas rule."""
    return packets * (size // 1500 + 1)


def sample_sizes(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
    """``n`` whole sizes out of ``sizes``: 1500 and the paper's 1480 first
    (the split sweep is compared with them), then evenly spread from the
    smallest up."""
    if n >= len(sizes):
        return sizes
    must = [s for s in (FULL_PACKET_LEN, PAPER_WHOLE_MAX) if s in sizes][:n]
    rest = [s for s in sizes if s not in must]
    k = n - len(must)
    picked = [rest[i * len(rest) // k] for i in range(k)] if k > 0 else []
    return tuple(sorted(set(picked) | set(must)))


@dataclass(frozen=True)
class ProbeSelection:
    """Which probes: ``count`` of them from one Atlas source (area, country,
    asn, prefix) or an explicit list of probe ids."""

    count: int
    selector: str
    value: str

    def to_source(self) -> dict[str, Any]:
        """The Atlas ``probes`` entry (Cousteau's AtlasSource fields)."""
        kind = "probes" if self.selector == "ids" else self.selector
        return {"type": kind, "value": self.value, "requested": self.count}

    @property
    def ids(self) -> tuple[int, ...]:
        if self.selector != "ids":
            return ()
        return tuple(int(x) for x in self.value.split(","))


@dataclass(frozen=True)
class ResponderLimits:
    """Abuse limits of the ICMP responder (as for the probe engine): replies
    per second per address, per /24 and in total."""

    pps_per_address: float = 50.0
    pps_per_prefix: float = 500.0
    pps_global: float = 5000.0


@dataclass(frozen=True)
class PlannedMeasurement:
    """One Atlas ping measurement of the campaign."""

    key: str  # stable within a campaign: "split-1500", "whole-576"
    phase: str
    target: str
    ip_len: int  # IP length of the echo request (and of the reply datagram)
    packets: int
    interval_s: int
    packet_interval_ms: int
    probes: int
    results_per_probe: int

    @property
    def size(self) -> int:
        """The Atlas ``size``: ICMP data bytes."""
        return self.ip_len - ECHO_OVERHEAD

    @property
    def credits_per_result(self) -> int:
        return credits_per_result(self.packets, self.size)

    @property
    def credits(self) -> int:
        return self.credits_per_result * self.probes * self.results_per_probe

    @property
    def run_len_s(self) -> float:
        """How long one ping of one probe lasts (its packets, spaced)."""
        return self.packets * self.packet_interval_ms / 1000.0

    def definition(self, description: str, tag: str | None = None) -> dict[str, Any]:
        """The Atlas definition fields (Cousteau ``Ping(**definition)``)."""
        d: dict[str, Any] = {
            "target": self.target,
            "af": 4,
            "description": f"{description} [{self.key}]",
            "packets": self.packets,
            "size": self.size,
            "interval": self.interval_s,
            "packet_interval": self.packet_interval_ms,
            "resolve_on_probe": False,
        }
        if tag is not None:
            d["tags"] = [tag]
        return d

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(size=self.size, credits_per_result=self.credits_per_result, credits=self.credits)
        return d


@dataclass(frozen=True)
class Campaign:
    name: str
    description: str
    whole_target: str
    split_target: str
    probes: ProbeSelection
    whole_sizes: tuple[int, ...]
    whole_sample: int
    splits: tuple[int, ...]
    packets: int
    interval_s: int
    packet_interval_ms: int
    duration_s: int
    credit_budget: int
    responder: ResponderLimits = field(default_factory=ResponderLimits)

    # -- loading ---------------------------------------------------------------

    @staticmethod
    def load(path: str | Path) -> Campaign:
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise CampaignError(
                f"campaign file {p} not found",
                hint="see atlas/example-campaign.yaml",
            ) from None
        except (OSError, yaml.YAMLError) as exc:
            raise CampaignError(f"cannot read campaign file {p}: {exc}") from None
        return Campaign.from_dict(data, source=str(p))

    @staticmethod
    def from_dict(data: object, source: str = "campaign") -> Campaign:
        return _Parser(data, source).campaign()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = CAMPAIGN_VERSION
        d["probes"]["source"] = self.probes.to_source()
        return d

    @property
    def tag(self) -> str:
        """The Atlas tag on every measurement of the campaign: how ``create``
        finds what an earlier run created whose answer it never got."""
        return "kickass-" + hashlib.sha256(self.name.encode()).hexdigest()[:12]

    # -- the plan --------------------------------------------------------------

    @property
    def results_per_probe(self) -> int:
        return max(1, math.ceil(self.duration_s / self.interval_s))

    def plan(self, all_sizes: bool = False) -> Plan:
        """The measurements to create: the split sweep in one measurement,
        then one per whole size (a sample unless ``all_sizes``)."""
        whole = self.whole_sizes if all_sizes else sample_sizes(self.whole_sizes, self.whole_sample)

        def planned(phase: str, target: str, ip_len: int) -> PlannedMeasurement:
            return PlannedMeasurement(
                key=f"{phase}-{ip_len}",
                phase=phase,
                target=target,
                ip_len=ip_len,
                packets=self.packets,
                interval_s=self.interval_s,
                packet_interval_ms=self.packet_interval_ms,
                probes=self.probes.count,
                results_per_probe=self.results_per_probe,
            )

        measurements = [planned(SPLIT, self.split_target, SPLIT_REQUEST_IP_LEN)]
        measurements += [planned(WHOLE, self.whole_target, s) for s in whole]
        return Plan(self, tuple(measurements), all_sizes)


@dataclass(frozen=True)
class Plan:
    campaign: Campaign
    measurements: tuple[PlannedMeasurement, ...]
    all_sizes: bool = False

    @property
    def total_credits(self) -> int:
        return sum(m.credits for m in self.measurements)

    def check_budget(self) -> None:
        budget = self.campaign.credit_budget
        if self.total_credits > budget:
            raise CampaignError(
                f"the plan costs {self.total_credits} credits, above the campaign's "
                f"credit_budget of {budget}",
                hint="lower probes.count, packets or duration, sample fewer whole sizes, "
                "or raise credit_budget in the campaign file",
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "campaign": self.campaign.name,
            "credit_budget": self.campaign.credit_budget,
            "total_credits": self.total_credits,
            "within_budget": self.total_credits <= self.campaign.credit_budget,
            "all_sizes": self.all_sizes,
            "measurements": [m.to_json() for m in self.measurements],
        }


# -- validation ------------------------------------------------------------------


class _Parser:
    """Reads the YAML mapping field by field; every mistake names its field."""

    def __init__(self, data: object, source: str) -> None:
        if not isinstance(data, Mapping):
            raise CampaignError(f"{source}: a campaign must be a YAML mapping")
        self.data = data
        self.source = source

    def fail(self, field_name: str, problem: str) -> CampaignError:
        return CampaignError(
            f"{self.source}: {field_name}: {problem}",
            hint="see atlas/README.md, campaign file reference",
        )

    def section(self, name: str, required: bool = True) -> Mapping[str, Any]:
        value = self.data.get(name)
        if value is None and not required:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(name, "must be a mapping")
        return value

    def integer(
        self,
        where: Mapping[str, Any],
        name: str,
        label: str,
        low: int,
        high: int,
        default: int | None = None,
    ) -> int:
        value = where.get(name, default)
        if value is None:
            raise self.fail(label, "is required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(label, f"must be an integer, got {value!r}")
        if not low <= value <= high:
            raise self.fail(label, f"must be between {low} and {high}, got {value}")
        return value

    def number(self, where: Mapping[str, Any], name: str, label: str, default: float) -> float:
        value = where.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(label, f"must be a number above 0, got {value!r}")
        return float(value)

    def address(self, where: Mapping[str, Any], name: str, label: str) -> str:
        value = where.get(name)
        try:
            ip = ipaddress.ip_address(str(value))
        except ValueError:
            raise self.fail(label, f"must be an IPv4 address literal, got {value!r}") from None
        if ip.version != 4:
            raise self.fail(label, "must be IPv4 (the study is about IPv4 fragments)")
        return str(ip)

    def sizes(
        self, where: Mapping[str, Any], label: str, list_key: str, default: list[int]
    ) -> tuple[int, ...]:
        if list_key in where and "step" in where:
            raise self.fail(label, f"give either {list_key} or step, not both")
        if list_key in where:
            raw = where[list_key]
            if not isinstance(raw, list) or not raw:
                raise self.fail(f"{label}.{list_key}", "must be a non-empty list of integers")
            if any(isinstance(x, bool) or not isinstance(x, int) for x in raw):
                raise self.fail(f"{label}.{list_key}", "must be a list of integers")
            return tuple(sorted(set(raw)))
        return tuple(default)

    def step(self, where: Mapping[str, Any], label: str) -> int:
        step = self.integer(where, "step", f"{label}.step", 8, FULL_PACKET_LEN, default=8)
        if step % FRAGMENT_UNIT:
            raise self.fail(f"{label}.step", "must be a multiple of 8 (fragment offsets)")
        return step

    def campaign(self) -> Campaign:
        d = self.data
        name = d.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 100:
            raise self.fail("name", "must be a non-empty string of at most 100 characters")
        description = d.get("description", f"Kick-Ass fragment viability study {name}")
        if not isinstance(description, str):
            raise self.fail("description", "must be a string")

        target = self.section("target")
        whole_target = self.address(target, "whole", "target.whole")
        split_target = self.address(target, "split", "target.split")

        probes = self.probes(self.section("probes"))

        whole = self.section("whole", required=False)
        default_whole = [s for s in whole_ip_lens(self.step(whole, "whole"))]
        whole_sizes = self.sizes(whole, "whole", "sizes", default_whole)
        if "sizes" not in whole:
            whole_sizes = tuple(s for s in whole_sizes if s >= MIN_WHOLE_IP_LEN)
        for s in whole_sizes:
            if not MIN_WHOLE_IP_LEN <= s <= FULL_PACKET_LEN:
                raise self.fail(
                    "whole.sizes",
                    f"IP length {s} outside {MIN_WHOLE_IP_LEN}..{FULL_PACKET_LEN} (Atlas probes "
                    f"pad echo data below {MIN_ATLAS_DATA} bytes, their own record, so a "
                    f"smaller size arrives as {MIN_WHOLE_IP_LEN}; larger would be fragmented "
                    "by the probe itself)",
                )
        whole_sample = self.integer(
            whole,
            "sample",
            "whole.sample",
            1,
            len(whole_sizes),
            default=min(DEFAULT_WHOLE_SAMPLE, len(whole_sizes)),
        )

        split = self.section("split", required=False)
        splits = self.sizes(
            split, "split", "leading", split_leading_ip_lens(self.step(split, "split"))
        )
        valid = set(split_leading_ip_lens(FRAGMENT_UNIT))
        for s in splits:
            if s not in valid:
                raise self.fail(
                    "split.leading",
                    f"leading fragment IP length {s} is not one of 44, 52, ..., 1492 "
                    "(20 + a multiple of 8, leaving at least 8 bytes for the second fragment)",
                )
        if whole_target == split_target and FULL_PACKET_LEN in whole_sizes:
            raise self.fail(
                "target",
                "whole and split share an address, so a 1500-byte echo request there is "
                "answered split: give the split sweep its own address, or leave 1500 out of "
                "whole.sizes",
            )

        packets = self.integer(d, "packets", "packets", 1, MAX_PACKETS, default=MAX_PACKETS)
        interval = self.integer(d, "interval", "interval", MIN_INTERVAL_S, 86400 * 7, default=240)
        packet_interval = self.integer(
            d,
            "packet_interval",
            "packet_interval",
            MIN_PACKET_INTERVAL_MS,
            MAX_PACKET_INTERVAL_MS,
            default=1000,
        )
        if packets * packet_interval / 1000.0 >= interval / 2:
            raise self.fail(
                "packet_interval",
                "one ping (packets x packet_interval) must last under half the interval, "
                "so the pings of one probe never overlap in the reply log",
            )
        duration = self.integer(d, "duration", "duration", interval, 86400 * 365)
        budget = self.integer(d, "credit_budget", "credit_budget", 1, 10**12)

        r = self.section("responder", required=False)
        defaults = ResponderLimits()
        limits = ResponderLimits(
            pps_per_address=self.number(
                r, "pps_per_address", "responder.pps_per_address", defaults.pps_per_address
            ),
            pps_per_prefix=self.number(
                r, "pps_per_prefix", "responder.pps_per_prefix", defaults.pps_per_prefix
            ),
            pps_global=self.number(r, "pps_global", "responder.pps_global", defaults.pps_global),
        )
        known = {
            "name", "description", "target", "probes", "whole", "split", "packets", "interval",
            "packet_interval", "duration", "credit_budget", "responder",
        }  # fmt: skip
        unknown = sorted(set(d) - known)
        if unknown:
            raise self.fail(", ".join(map(str, unknown)), "unknown field")
        return Campaign(
            name=name.strip(),
            description=description,
            whole_target=whole_target,
            split_target=split_target,
            probes=probes,
            whole_sizes=whole_sizes,
            whole_sample=whole_sample,
            splits=splits,
            packets=packets,
            interval_s=interval,
            packet_interval_ms=packet_interval,
            duration_s=duration,
            credit_budget=budget,
            responder=limits,
        )

    def probes(self, p: Mapping[str, Any]) -> ProbeSelection:
        given = [k for k in PROBE_SELECTORS if k in p]
        if len(given) != 1:
            raise self.fail(
                "probes",
                f"give exactly one of {', '.join(PROBE_SELECTORS)} (got {given or 'none'})",
            )
        selector = given[0]
        raw = p[selector]
        if selector == "ids":
            if (
                not isinstance(raw, list)
                or not raw
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in raw)
            ):
                raise self.fail("probes.ids", "must be a non-empty list of probe ids")
            ids = sorted(set(raw))
            if len(ids) > MAX_PROBES:
                raise self.fail(
                    "probes.ids",
                    f"at most {MAX_PROBES} probes (RIPE Atlas's limit per measurement)",
                )
            count = self.integer(p, "count", "probes.count", 1, len(ids), default=len(ids))
            return ProbeSelection(count, "ids", ",".join(map(str, ids)))
        count = self.integer(p, "count", "probes.count", 1, MAX_PROBES)
        if selector == "area":
            if raw not in AREAS:
                raise self.fail("probes.area", f"must be one of {', '.join(AREAS)}, got {raw!r}")
            value = raw
        elif selector == "country":
            if not isinstance(raw, str) or len(raw) != 2 or not raw.isalpha():
                raise self.fail("probes.country", f"must be an ISO 3166 code like NL, got {raw!r}")
            value = raw.upper()
        elif selector == "asn":
            if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw < 2**32:
                raise self.fail("probes.asn", f"must be an AS number, got {raw!r}")
            value = str(raw)
        else:
            try:
                net = ipaddress.ip_network(str(raw))
            except ValueError:
                raise self.fail(
                    "probes.prefix", f"must be a prefix like 192.0.2.0/24, got {raw!r}"
                ) from None
            value = str(net)
        unknown = sorted(set(p) - {selector, "count"})
        if unknown:
            raise self.fail(f"probes.{', '.join(map(str, unknown))}", "unknown field")
        return ProbeSelection(count, selector, value)
