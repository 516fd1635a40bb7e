"""Atlas ping results in, per-echo outcomes joined to the reply log out, stored.

Parsing. Sagan (``ripe.atlas.sagan``) reads each result and evens out the
firmware differences: before firmware 4460 the target is ``addr``/``name``
(not ``dst_addr``/``dst_name``), before 4570 the ICMP ``size`` includes the
8-byte header. What Sagan cannot do is tell a timeout ``{"x": "*"}`` from an
error entry ``{"error": "..."}`` (both are a packet with no RTT), so each of
its packets is read beside the raw entry it came from. An entry with ``dup``
is a duplicate *or a late reply*: the probe firmware flags every reply whose
sequence number is not the one it waits for.

The join. An Atlas result names neither ICMP identifier nor sequence
numbers, only the probe's public address (``from``), the target, the ping's
start time and its entries in sending order. The responder's reply log has
(requester address, ICMP id, sequence, what it sent, when). So:

1. the log rows of one measurement's target and request size are grouped
   per requester address and ICMP id into *runs* (one probe's ping: rows
   within one ping's duration, sequence numbers within ``packets``);
2. each result takes the unclaimed run of its probe's address (``from``, or
   the probe's registered address) that started nearest its timestamp;
3. the run's sequence numbers, relative to each other, are laid over the
   result's entries: every entry with an RTT must fall on a reply we sent,
   no entry the probe failed to send may. One offset fits: ``exact``. Several
   fit (requests lost at the ends of the ping, and replies lost too): the
   one whose timing best matches the timestamp, ``ambiguous`` — counts are
   the same either way, only which split a lost reply had may differ. None
   fits: ``inconsistent`` (the log lost rows, e.g. a responder crash).

Per echo request that gives: ``acked`` (we replied, it arrived), ``lost`` (we
replied, the probe timed out), ``late`` (lost, then a late reply came back,
listed by Atlas as a duplicate), ``unanswered`` (no reply of ours: the
request was lost on the way in, or over the responder's caps) and ``error``.
Only the first three are about our replies, so only they enter drop rates,
exactly as the volunteers' server-sent probes do.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kickass_core.errors import KickassError
from kickass_core.plan import WHOLE
from ripe.atlas.sagan.base import ParsingDict, ResultParseError
from ripe.atlas.sagan.ping import PingResult

from .campaign import Campaign
from .client import AtlasClient, AtlasError, probe_problem
from .store import AtlasStore, LoggedReply, OutcomeRow, ResultRow

log = logging.getLogger("kickass.atlas")

REPLY, TIMEOUT, ERROR = "reply", "timeout", "error"
# A result's run may start this much before or after its timestamp, on top
# of the ping's own duration (timestamps are whole seconds; clocks drift).
JOIN_SLACK_S = 3.0
DEFAULT_CHUNK_S = 6 * 3600
# Results are fetched only this long after their time: probes upload late.
DEFAULT_SETTLE_S = 600.0


class ResultIgnored(Exception):
    """A result line that is not a usable IPv4 ping result (the message says why)."""


@dataclass(slots=True)
class Slot:
    """One echo request of a ping, as the probe saw it."""

    kind: str  # reply | timeout | error
    rtt_ms: float | None = None
    error: str | None = None


@dataclass
class ParsedResult:
    msm_id: int
    prb_id: int
    timestamp: int
    firmware: int | None
    from_address: str | None
    dst_address: str | None
    size: int | None  # ICMP data bytes, firmware-corrected
    sent: int | None
    rcvd: int | None
    dup: int | None
    raw: dict[str, Any]
    slots: list[Slot] | None  # None: the firmware reported counts only
    dups: list[tuple[int, float | None]] = field(default_factory=list)  # (slots before, rtt)


def parse_result(line: str | Mapping[str, Any]) -> ParsedResult:
    """One Atlas result (a JSON line or its dict); ResultIgnored if unusable."""
    if isinstance(line, str):
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise ResultIgnored(f"not JSON: {exc}") from None
    else:
        raw = dict(line)
    if not isinstance(raw, dict) or raw.get("type") != "ping":
        raise ResultIgnored(
            f"not a ping result (type {raw.get('type') if isinstance(raw, dict) else None!r})"
        )
    try:
        r = PingResult(
            raw, on_error=ParsingDict.ACTION_IGNORE, on_malformation=ParsingDict.ACTION_IGNORE
        )
    except (ResultParseError, AttributeError, TypeError, ValueError) as exc:
        raise ResultIgnored(f"Sagan cannot parse it: {exc}") from None
    if r.af == 6:
        raise ResultIgnored("an IPv6 result (the study is about IPv4 fragments)")
    if r.measurement_id is None or r.probe_id is None:
        raise ResultIgnored("no msm_id or prb_id")
    slots: list[Slot] | None = None
    dups: list[tuple[int, float | None]] = []
    entries = raw.get("result")
    if isinstance(entries, list):
        slots = []
        # Sagan made one packet per entry, in order: pair them up.
        for packet, entry in zip(r.packets, entries, strict=True):
            entry = entry if isinstance(entry, Mapping) else {}
            if packet.dup:
                dups.append((len(slots), packet.rtt))
            elif packet.rtt is not None:
                slots.append(Slot(REPLY, rtt_ms=packet.rtt))
            elif "x" in entry:
                slots.append(Slot(TIMEOUT))
            elif "error" in entry:
                slots.append(Slot(ERROR, error=str(entry["error"])[:500]))
            else:
                slots.append(Slot(ERROR, error=f"unrecognised entry {json.dumps(entry)[:200]}"))
    return ParsedResult(
        msm_id=r.measurement_id,
        prb_id=r.probe_id,
        timestamp=int(raw["timestamp"]),
        firmware=r.firmware,
        from_address=r.origin,
        dst_address=r.destination_address,
        size=r.packet_size,
        sent=r.packets_sent,
        rcvd=r.packets_received,
        dup=r.duplicates,
        raw=raw,
        slots=slots,
        dups=dups,
    )


# -- the join ------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasurementSpec:
    """What the join needs to know of a measurement (a row of atlas_measurements)."""

    msm_id: int
    campaign_id: int
    phase: str
    target: str
    ip_len: int
    packets: int
    packet_interval_ms: int

    @property
    def run_len_s(self) -> float:
        return self.packets * self.packet_interval_ms / 1000.0

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> MeasurementSpec:
        return MeasurementSpec(
            msm_id=int(row["msm_id"]),
            campaign_id=int(row["campaign_id"]),
            phase=row["phase"],
            target=str(row["target"]),
            ip_len=int(row["ip_len"]),
            packets=int(row["packets"]),
            packet_interval_ms=int(row["packet_interval_ms"]),
        )


@dataclass
class LoggedRun:
    """The replies we sent to one probe's ping (one requester address and ICMP id)."""

    dst: str
    icmp_id: int
    replies: list[LoggedReply]

    @property
    def start(self) -> float:
        return self.replies[0].sent_at

    def offsets(self) -> list[int]:
        """Each reply's sequence number relative to the run's lowest (wrap-aware:
        Atlas firmware counts modulo 256)."""
        seqs = [r.icmp_seq for r in self.replies]
        mod = 256 if max(seqs) < 256 else 65536
        rel = [_signed((s - seqs[0]) % mod, mod) for s in seqs]
        low = min(rel)
        return [x - low for x in rel]


def _signed(x: int, mod: int) -> int:
    return x - mod if x > mod // 2 else x


def group_runs(replies: Iterable[LoggedReply], spec: MeasurementSpec) -> list[LoggedRun]:
    by_probe: dict[tuple[str, int], list[LoggedReply]] = defaultdict(list)
    for r in replies:
        by_probe[(r.dst_address, r.icmp_id)].append(r)
    runs: list[LoggedRun] = []
    limit = spec.run_len_s + 1.0
    for (dst, icmp_id), rows in by_probe.items():
        rows.sort(key=lambda r: r.sent_at)
        current: LoggedRun | None = None
        for r in rows:
            if current is not None:
                mod = 256 if max(r.icmp_seq, current.replies[0].icmp_seq) < 256 else 65536
                rel = _signed((r.icmp_seq - current.replies[0].icmp_seq) % mod, mod)
                if r.sent_at - current.start <= limit and abs(rel) < spec.packets:
                    current.replies.append(r)
                    continue
            current = LoggedRun(dst, icmp_id, [r])
            runs.append(current)
    return runs


def _fits(result: ParsedResult, run: LoggedRun) -> bool:
    n = len(result.slots) if result.slots is not None else (result.sent or 0)
    return len(set(run.offsets())) <= max(n, 1)


def match_runs(
    results: Sequence[ParsedResult],
    runs: Sequence[LoggedRun],
    spec: MeasurementSpec,
    probe_addresses: Mapping[int, str | None],
) -> dict[int, LoggedRun]:
    """Result index -> its run: nearest in time first, each run used once."""
    by_dst: dict[str, list[int]] = defaultdict(list)
    for j, run in enumerate(runs):
        by_dst[run.dst].append(j)
    tolerance = spec.run_len_s + JOIN_SLACK_S
    pairs: list[tuple[float, int, int]] = []
    for i, res in enumerate(results):
        addresses = {a for a in (res.from_address, probe_addresses.get(res.prb_id)) if a}
        for a in addresses:
            for j in by_dst.get(a, ()):
                # Timestamps are whole seconds: the ping began within the second.
                distance = abs(runs[j].start - (res.timestamp + 0.5))
                if distance <= tolerance and _fits(res, runs[j]):
                    pairs.append((distance, i, j))
    pairs.sort()
    chosen: dict[int, LoggedRun] = {}
    used: set[int] = set()
    for _, i, j in pairs:
        if i not in chosen and j not in used:
            chosen[i] = runs[j]
            used.add(j)
    return chosen


def align(
    slots: Sequence[Slot],
    offsets: Sequence[int],
    times: Sequence[float] = (),
    timestamp: float | None = None,
    packet_interval_s: float = 1.0,
) -> tuple[int, str]:
    """The slot index of relative sequence 0, and how sure the join is."""
    n = len(slots)
    unique = sorted(set(offsets))
    replies = {k for k, s in enumerate(slots) if s.kind == REPLY}
    errors = {k for k, s in enumerate(slots) if s.kind == ERROR}
    candidates = range(max(0, n - unique[-1])) if unique else range(1)
    valid = []
    for o in candidates:
        ks = {o + r for r in unique}
        if not ks & errors and replies <= ks:
            valid.append(o)
    if len(valid) == 1:
        return valid[0], "exact"
    if valid:
        if times and timestamp is not None:

            def start_error(o: int) -> float:
                start = statistics.median(
                    t - (o + r) * packet_interval_s for t, r in zip(times, offsets, strict=True)
                )
                return abs(start - (timestamp + 0.5))

            return min(valid, key=lambda o: (start_error(o), o)), "ambiguous"
        return valid[0], "ambiguous"

    def score(o: int) -> tuple[int, int]:
        ks = {o + r for r in unique}
        return (len(replies & ks) - len(errors & ks), -o)

    return max(candidates, key=score), "inconsistent"


def outcomes_for(
    res: ParsedResult, run: LoggedRun | None, spec: MeasurementSpec
) -> tuple[ResultRow, list[OutcomeRow]]:
    """The stored rows of one result joined to its run (None: no reply of ours)."""
    result_at = datetime.fromtimestamp(res.timestamp, UTC)
    nominal = spec.ip_len if spec.phase == WHOLE else None
    out: list[dict[str, Any]] = []
    if res.slots is None:
        status = "aggregate"
        out = _aggregate(res, run, nominal)
    else:
        by_slot: dict[int, list[LoggedReply]] = defaultdict(list)
        if run is None:
            status = "no-log"
        else:
            offsets = run.offsets()
            o, status = align(
                res.slots,
                offsets,
                [r.sent_at for r in run.replies],
                res.timestamp,
                spec.packet_interval_ms / 1000.0,
            )
            for reply, r in zip(run.replies, offsets, strict=True):
                by_slot[o + r].append(reply)
        for k, slot in enumerate(res.slots):
            ours = by_slot.get(k)
            first = ours[0] if ours else None
            row: dict[str, Any] = {
                "ip_len": first.ip_len if first else nominal,
                "rtt_ms": slot.rtt_ms,
                "ack_count": 0,
                "icmp_seq": first.icmp_seq if first else None,
                "replied_at": datetime.fromtimestamp(first.sent_at, UTC) if first else None,
                "error": slot.error,
            }
            if slot.kind == ERROR:
                row["outcome"] = "error"
            elif slot.kind == REPLY:
                row.update(outcome="acked", ack_count=1)
            else:
                row["outcome"] = "lost" if first else "unanswered"
            out.append(row)
        _attribute_duplicates(out, res.dups, spec.packet_interval_ms)
    result = ResultRow(
        msm_id=res.msm_id,
        prb_id=res.prb_id,
        result_at=result_at,
        campaign_id=spec.campaign_id,
        firmware=res.firmware,
        from_address=res.from_address,
        dst_address=res.dst_address,
        size=res.size,
        sent=res.sent,
        rcvd=res.rcvd,
        dup=res.dup,
        join_status=status,
        raw=res.raw,
    )
    outcomes = [
        OutcomeRow(
            msm_id=res.msm_id,
            prb_id=res.prb_id,
            result_at=result_at,
            packet_index=k,
            campaign_id=spec.campaign_id,
            phase=spec.phase,
            ip_len=row["ip_len"],
            outcome=row["outcome"],
            rtt_ms=row["rtt_ms"],
            ack_count=row["ack_count"],
            icmp_seq=row["icmp_seq"],
            replied_at=row["replied_at"],
            error=row["error"],
        )
        for k, row in enumerate(out)
    ]
    return result, outcomes


def _attribute_duplicates(
    out: list[dict[str, Any]], dups: Sequence[tuple[int, float | None]], packet_interval_ms: int
) -> None:
    """A duplicate entry with an RTT of at least the packet interval is a late
    reply (the probe had timed its request out and moved on): it turns the
    lost request it most likely belongs to ``late``. Otherwise it is a true
    duplicate of a reply that arrived, counted in ``ack_count``."""
    for pos, rtt in dups:
        if rtt is None:
            continue
        prior = range(min(pos, len(out)))
        if rtt >= packet_interval_ms:
            # It came back while request `pos` was outstanding, `rtt` after
            # its own request was sent.
            estimate = pos + 0.5 - rtt / packet_interval_ms
            lost = [k for k in prior if out[k]["outcome"] in ("lost", "late")]
            if lost:
                k = min(lost, key=lambda k: (abs(k - estimate), -k))
                row = out[k]
                row["outcome"] = "late"
                row["ack_count"] += 1
                if row["rtt_ms"] is None:
                    row["rtt_ms"] = rtt
                continue
        acked = [k for k in range(len(out)) if out[k]["outcome"] in ("acked", "late")]
        if acked:
            k = min(acked, key=lambda k: (abs(k - (pos - 1)), k))
            out[k]["ack_count"] += 1


def _aggregate(
    res: ParsedResult, run: LoggedRun | None, nominal: int | None
) -> list[dict[str, Any]]:
    """Firmware that reported only counts: as many outcomes as it allows."""
    sent = res.sent or 0
    rcvd = min(res.rcvd or 0, sent)
    replied = len(set(run.offsets())) if run is not None else rcvd
    replied = min(max(replied, rcvd), sent)

    def row(outcome: str) -> dict[str, Any]:
        return {
            "ip_len": nominal,
            "outcome": outcome,
            "rtt_ms": None,
            "ack_count": 1 if outcome == "acked" else 0,
            "icmp_seq": None,
            "replied_at": None,
            "error": None,
        }

    return (
        [row("acked")] * rcvd
        + [row("lost")] * (replied - rcvd)
        + [row("unanswered")] * (sent - replied)
    )


def join(
    results: Sequence[ParsedResult],
    replies: Iterable[LoggedReply],
    spec: MeasurementSpec,
    probe_addresses: Mapping[int, str | None],
) -> tuple[list[ResultRow], list[OutcomeRow]]:
    runs = group_runs(replies, spec)
    chosen = match_runs(results, runs, spec, probe_addresses)
    rows: list[ResultRow] = []
    outcomes: list[OutcomeRow] = []
    for i, res in enumerate(results):
        row, outs = outcomes_for(res, chosen.get(i), spec)
        rows.append(row)
        outcomes.extend(outs)
    return rows, outcomes


# -- fetching ----------------------------------------------------------------------------


@dataclass
class FetchReport:
    measurements: int = 0
    chunks: int = 0
    results_new: int = 0
    results_seen: int = 0
    ignored: Counter[str] = field(default_factory=Counter)
    join: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    warnings: list[KickassError] = field(default_factory=list)
    probes: set[int] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {
            "measurements": self.measurements,
            "chunks": self.chunks,
            "results_new": self.results_new,
            "results_seen": self.results_seen,
            "ignored": dict(self.ignored),
            "join": dict(self.join),
            "outcomes": dict(self.outcomes),
            "probes": len(self.probes),
            "warnings": [{"message": w.message, "hint": w.hint} for w in self.warnings],
        }


def fetch_campaign(
    store: AtlasStore,
    client: AtlasClient,
    campaign: Campaign,
    *,
    settle_s: float = DEFAULT_SETTLE_S,
    chunk_s: int = DEFAULT_CHUNK_S,
    now: Callable[[], float] = time.time,
    progress: Callable[[str], None] = lambda _msg: None,
) -> FetchReport:
    """Fetch every measurement's new results, window by window from its
    watermark; each window commits with its watermark, so an interruption
    loses nothing and fetches nothing twice."""
    campaign_id = store.campaign_id(campaign.name)
    measurements = store.measurements(campaign_id) if campaign_id is not None else []
    if campaign_id is None or not measurements:
        raise KickassError(
            f"campaign {campaign.name!r} has no measurements yet",
            hint="create them first: kickass atlas create CAMPAIGN.yaml",
        )
    report = FetchReport()
    warned_probes: set[int] = set()
    for m in measurements:
        spec = MeasurementSpec.from_row(m)
        try:
            _fetch_measurement(
                store, client, spec, m, report, warned_probes, settle_s, chunk_s, now(), progress
            )
        except AtlasError as exc:
            store.update_measurement(spec.msm_id, last_error=exc.message[:500])
            raise
        report.measurements += 1
    if report.probes:
        store.refresh_verdicts(campaign_id, report.probes)
    return report


def _fetch_measurement(
    store: AtlasStore,
    client: AtlasClient,
    spec: MeasurementSpec,
    row: Mapping[str, Any],
    report: FetchReport,
    warned_probes: set[int],
    settle_s: float,
    chunk_s: int,
    now: float,
    progress: Callable[[str], None],
) -> None:
    info = client.measurement(spec.msm_id)
    store.update_measurement(
        spec.msm_id,
        status_id=info.status_id,
        status_name=info.status_name,
        credits_per_result=info.credits_per_result,
        start_time=info.start_time,
        stop_time=info.stop_time or row.get("stop_time"),
    )
    if info.problem is not None:
        report.warnings.append(info.problem)
    begin = row.get("fetched_until") or info.start_time or row["created_at"]
    start = int(begin.timestamp())
    end = int(now - settle_s)
    if info.stop_time is not None:
        end = min(end, int(info.stop_time.timestamp()) + 1)
    margin = spec.run_len_s + JOIN_SLACK_S + 2.0
    while start < end:
        stop = min(start + chunk_s, end)
        lines = client.results(spec.msm_id, start, stop - 1)
        parsed: list[ParsedResult] = []
        for line in lines:
            try:
                res = parse_result(line)
            except ResultIgnored as exc:
                report.ignored[str(exc).split(":")[0]] += 1
                continue
            if res.msm_id != spec.msm_id:
                report.ignored["another measurement's result"] += 1
                continue
            parsed.append(res)
        prb_ids = {r.prb_id for r in parsed}
        addresses = _probe_metadata(store, client, prb_ids, report, warned_probes)
        replies = store.reply_log(
            spec.campaign_id, spec.target, spec.ip_len, start - margin, stop + margin
        )
        rows, outcomes = join(parsed, replies, spec, addresses)
        new = store.store_chunk(spec.msm_id, rows, outcomes, datetime.fromtimestamp(stop, UTC))
        report.chunks += 1
        report.results_seen += len(rows)
        report.results_new += new
        report.join.update(r.join_status for r in rows)
        report.outcomes.update(o.outcome for o in outcomes)
        report.probes |= prb_ids
        progress(
            f"measurement {spec.msm_id} ({spec.phase} {spec.ip_len}): {new} new results up to "
            f"{datetime.fromtimestamp(stop, UTC):%Y-%m-%d %H:%M:%S}Z"
        )
        start = stop


def _probe_metadata(
    store: AtlasStore,
    client: AtlasClient,
    prb_ids: set[int],
    report: FetchReport,
    warned: set[int],
) -> dict[int, str | None]:
    """Probe id -> address. Metadata (ASN, country, address, status) is read
    through Cousteau once per fetch for every probe with results in it — a
    probe's status changes — with a warning for one that stopped producing
    results."""
    fresh = sorted(prb_ids - report.probes - warned)
    if fresh:
        probes = client.probes(fresh)
        store.upsert_probes(probes)
        for p in probes:
            pid = int(p["id"])
            problem = probe_problem(p)
            if problem and pid not in warned:
                warned.add(pid)
                report.warnings.append(
                    KickassError(
                        problem,
                        hint="its results so far are kept; the campaign goes on with the others",
                    )
                )
    return store.known_probes(prb_ids)
