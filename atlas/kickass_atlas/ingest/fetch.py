"""The I/O of ingest: windows of one measurement's results, parsed, joined, stored.

``fetch_campaign`` reads every measurement's results from the API window by
window from its watermark, each window committed with its watermark, and
reads each window once more when it is ``late_horizon_s`` old;
``ingest_window`` parses, joins and stores one window's lines, from the API
or from a file (``kickass atlas import``, ``result_files``). A result the
columns cannot hold is refused first (``storable_results``, by
``check.check_result``); one that cannot be read or joined is stored
``invalid``: nothing in a line stops a window.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kickass_core.errors import KickassError

from ..campaign import Campaign
from ..client import AtlasClient, AtlasError, probe_problem
from ..rows import ResultRow
from ..store import AtlasStore
from .check import ResultRefused, check_result
from .join import JOIN_SLACK_S, MeasurementSpec, invalid_row, join
from .parse import MAX_ERROR_CHARS, ParsedResult, ResultIgnored, ResultInvalid, parse_result

log = logging.getLogger("kickass.atlas")

DEFAULT_CHUNK_S = 6 * 3600
# A window is read once this long after its end (probes upload late) ...
DEFAULT_SETTLE_S = 600.0
# ... and once more when it is this old, for the results uploaded later
# still (a probe that was offline). Later than this is not fetched.
DEFAULT_LATE_HORIZON_S = 24 * 3600.0


@dataclass
class FetchReport:
    measurements: int = 0
    chunks: int = 0
    results_new: int = 0
    results_seen: int = 0
    results_late: int = 0
    results_replaced: int = 0  # of results_new: readable copies of results stored invalid
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
            "results_late": self.results_late,
            "results_replaced": self.results_replaced,
            "ignored": dict(self.ignored),
            "join": dict(self.join),
            "outcomes": dict(self.outcomes),
            "probes": len(self.probes),
            "warnings": [{"message": w.message, "hint": w.hint} for w in self.warnings],
        }


def storable_results(
    lines: Iterable[str | Mapping[str, Any]], report: FetchReport, msm_id: int
) -> list[dict[str, Any]]:
    """The results of ``lines`` (the API's) that can be stored (``check_result``);
    each other one counted in ``report.ignored`` and logged with its reason."""
    out = []
    for line in lines:
        try:
            out.append(check_result(line))
        except ResultRefused as exc:
            report.ignored["refused: out of its columns' bounds or unstorable"] += 1
            raw = line if isinstance(line, Mapping) else {}
            log.warning(
                "measurement %s: a result (probe %s, time %s) refused: %s",
                msm_id,
                str(raw.get("prb_id"))[:20],
                str(raw.get("timestamp"))[:20],
                exc,
            )
    return out


def _measurement_specs(store: AtlasStore, campaign: Campaign) -> tuple[int, list[dict[str, Any]]]:
    campaign_id = store.campaign_id(campaign.name)
    measurements = store.measurements(campaign_id) if campaign_id is not None else []
    if campaign_id is None or not measurements:
        raise KickassError(
            f"campaign {campaign.name!r} has no measurements yet",
            hint="create them first: kickass atlas create CAMPAIGN.yaml",
        )
    return campaign_id, measurements


def fetch_campaign(
    store: AtlasStore,
    client: AtlasClient,
    campaign: Campaign,
    *,
    settle_s: float = DEFAULT_SETTLE_S,
    chunk_s: int = DEFAULT_CHUNK_S,
    late_horizon_s: float = DEFAULT_LATE_HORIZON_S,
    now: Callable[[], float] = time.time,
    progress: Callable[[str], None] = lambda _msg: None,
) -> FetchReport:
    """Fetch every measurement's new results, window by window from its
    watermark; each window commits with its watermark, so an interruption
    loses nothing. Windows ``late_horizon_s`` old are read once more for
    the results probes uploaded late."""
    campaign_id, measurements = _measurement_specs(store, campaign)
    report = FetchReport()
    warned_probes: set[int] = set()
    for m in measurements:
        spec = MeasurementSpec.from_row(m)
        try:
            _fetch_measurement(
                store,
                client,
                spec,
                m,
                report,
                warned_probes,
                settle_s,
                chunk_s,
                late_horizon_s,
                now(),
                progress,
            )
        except AtlasError as exc:
            store.update_measurement(spec.msm_id, last_error=exc.message[:MAX_ERROR_CHARS])
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
    late_horizon_s: float,
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
    first = info.start_time or row.get("start_time") or row["created_at"]
    stop_limit = int(info.stop_time.timestamp()) + 1 if info.stop_time is not None else None
    fetched = row.get("fetched_until")

    def windows(start: int, end: int) -> Iterator[tuple[int, int]]:
        if stop_limit is not None:
            end = min(end, stop_limit)
        while start < end:
            stop = min(start + chunk_s, end)
            yield start, stop
            start = stop

    def read(start: int, stop: int, recheck: bool) -> None:
        lines = storable_results(client.results(spec.msm_id, start, stop - 1), report, spec.msm_id)
        fetcher = _Fetcher(store, client, report, warned_probes)
        new = ingest_window(
            store,
            spec,
            lines,
            start,
            stop,
            report,
            fetcher.addresses,
            watermark=datetime.fromtimestamp(stop, UTC),
            recheck=recheck,
            origin="fetch",
        )
        what = "late re-read" if recheck else "read"
        progress(
            f"measurement {spec.msm_id} ({spec.phase} {spec.ip_len}): {new} new results "
            f"({what}) up to {datetime.fromtimestamp(stop, UTC):%Y-%m-%d %H:%M:%S}Z"
        )

    # The late re-read first: windows read once, now late_horizon old.
    if fetched is not None:
        recheck_from = row.get("rechecked_until") or first
        recheck_to = min(int(fetched.timestamp()), int(now - late_horizon_s))
        for start, stop in windows(int(recheck_from.timestamp()), recheck_to):
            read(start, stop, recheck=True)
    begin = fetched or first
    for start, stop in windows(int(begin.timestamp()), int(now - settle_s)):
        read(start, stop, recheck=False)


class _Fetcher:
    """Probe metadata through the API, once per fetch per probe."""

    def __init__(
        self, store: AtlasStore, client: AtlasClient, report: FetchReport, warned: set[int]
    ) -> None:
        self.store, self.client, self.report, self.warned = store, client, report, warned

    def addresses(self, prb_ids: set[int]) -> dict[int, str | None]:
        return _probe_metadata(self.store, self.client, prb_ids, self.report, self.warned)


def ingest_window(
    store: AtlasStore,
    spec: MeasurementSpec,
    lines: Iterable[str | Mapping[str, Any]],
    start: float,
    stop: float,
    report: FetchReport,
    addresses: Callable[[set[int]], Mapping[int, str | None]],
    *,
    watermark: datetime | None,
    recheck: bool = False,
    origin: str = "fetch",
) -> int:
    """Parse, join and store one window's lines of one measurement; returns
    the new results. Nothing in a line can stop it."""
    parsed: dict[tuple[int, int], ParsedResult] = {}
    invalid: dict[tuple[int, int], ResultRow] = {}
    for line in lines:
        try:
            res = parse_result(line)
        except ResultInvalid as bad:
            if bad.msm_id == spec.msm_id:
                key = (bad.prb_id, bad.timestamp)
                if key not in parsed and key not in invalid:
                    invalid[key] = invalid_row(bad, spec, origin, str(bad))
            else:
                report.ignored["another measurement's result"] += 1
            continue
        except ResultIgnored as exc:
            report.ignored[str(exc).split(":")[0]] += 1
            continue
        if res.msm_id != spec.msm_id:
            report.ignored["another measurement's result"] += 1
            continue
        # One result per probe and time: the first readable line wins, as in
        # the table (where it replaces an unreadable copy stored before).
        key = (res.prb_id, res.timestamp)
        if key not in parsed:
            parsed[key] = res
            invalid.pop(key, None)
    results = list(parsed.values())
    prb_ids = {r.prb_id for r in results} | {k[0] for k in invalid}
    probe_addresses = addresses({r.prb_id for r in results}) if results else {}
    margin = spec.run_len_s + JOIN_SLACK_S + 2.0
    replies = (
        store.reply_log(
            spec.campaign_id, spec.target, spec.request_len, start - margin, stop + margin
        )
        if results
        else []
    )
    rows, outcomes = join(results, replies, spec, probe_addresses, origin)
    rows += invalid.values()
    stored = store.store_window(spec.msm_id, rows, outcomes, watermark, recheck=recheck)
    fresh = stored.fresh
    new = len(fresh)
    report.chunks += 1
    report.results_seen += len(rows)
    report.results_new += new
    report.results_replaced += len(stored.replaced)
    if recheck:
        report.results_late += len(stored.new)
    # What was stored this time (a result seen before keeps its first rows).
    report.join.update(r.join_status for r in rows if (r.msm_id, r.prb_id, r.result_at) in fresh)
    report.outcomes.update(
        o.outcome for o in outcomes if (o.msm_id, o.prb_id, o.result_at) in fresh
    )
    report.probes |= prb_ids
    return new


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
