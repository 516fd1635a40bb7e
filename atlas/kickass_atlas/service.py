"""The Atlas operator's work as plain functions: plan, create, fetch, status.

Each takes an ``AtlasSettings`` (where the API and the database are) and a
``Campaign`` and returns a result object; none prints, parses flags or exits.
`kickass atlas` (cli.py) and the scheduled items of `kickass schedule`
(kickass_operations) are thin callers of these. Warnings that must not stop
the work (a probe that is disconnected, a status read that failed) are
collected in the result for the caller to show.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kickass_core import config
from kickass_core.errors import KickassError

from .campaign import (
    Campaign,
    CampaignError,
    Plan,
    PlannedMeasurement,
    credits_per_result,
)
from .client import DEFAULT_SERVER, AtlasClient, AtlasError, AtlasNoAnswer, probe_problem
from .ingest.fetch import (
    DEFAULT_CHUNK_S,
    DEFAULT_LATE_HORIZON_S,
    DEFAULT_SETTLE_S,
    FetchReport,
    fetch_campaign,
)
from .result_files import ImportReport, SourceLine, import_campaign, numbered_result_lines

if TYPE_CHECKING:
    from .store import AtlasStore

SECTION = "atlas"
SPLIT_KEY = "split-1500"
# Measurement statuses that will still produce results: Specified,
# Scheduled, Ongoing. Stopped ones (by us, over the budget) are not adopted.
LIVE_STATUSES = (0, 1, 2)


@dataclass(frozen=True)
class AtlasSettings:
    """Where the RIPE Atlas API and the database are. The API key is never a
    flag or a file setting's value: it is read from ``$KICKASS_ATLAS_KEY`` or
    a key file, and never printed, logged or stored."""

    server: str = DEFAULT_SERVER
    key: str | None = None
    ca_bundle: str | None = None
    database_url: str | None = None

    @classmethod
    def resolve(
        cls,
        *,
        atlas_server: str | None = None,
        key_file: str | Path | None = None,
        ca_bundle: str | None = None,
        database_url: str | None = None,
        file: dict[str, Any] | None = None,
    ) -> AtlasSettings:
        """Flag > ``KICKASS_*`` environment > the [atlas] table of $KICKASS_CONFIG."""
        settings = config.load_file(None) if file is None else file

        def setting(name: str, flag: Any, default: Any = None) -> Any:
            return config.resolve(name, flag, default=default, file=settings, section=SECTION)

        return cls(
            server=setting("atlas_server", atlas_server, DEFAULT_SERVER),
            key=read_key(setting("atlas_key_file", key_file)),
            ca_bundle=setting("atlas_ca_bundle", ca_bundle),
            database_url=setting("database_url", database_url),
        )

    def client(self) -> AtlasClient:
        return AtlasClient(server=self.server, key=self.key, verify=self.ca_bundle or True)

    def store(self) -> AtlasStore:
        from .store import AtlasStore  # the database layer only for work that needs it

        return AtlasStore(self.database_url)


def read_key(key_file: str | Path | None) -> str | None:
    """The API key: from $KICKASS_ATLAS_KEY, else the key file."""
    env_key = os.environ.get("KICKASS_ATLAS_KEY", "").strip()
    if env_key:
        return env_key
    return config.read_secret(
        key_file, "KICKASS_ATLAS_KEY", "API key", "check --key-file / $KICKASS_ATLAS_KEY_FILE"
    )


# -- plan ---------------------------------------------------------------------------------


def plan(campaign: Campaign, all_sizes: bool = False) -> Plan:
    """What would be created and what it costs; needs neither key nor database."""
    return campaign.plan(all_sizes=all_sizes)


# -- create -------------------------------------------------------------------------------


@dataclass
class CreateResult:
    campaign: str
    created: list[int] = field(default_factory=list)
    measurements: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[KickassError] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "campaign": self.campaign,
            "created": self.created,
            "measurements": self.measurements,
            "warnings": [w.message for w in self.warnings],
        }


class _Warnings(list[KickassError]):
    """Warnings kept for the result, and handed to ``warn`` as they arise (so a
    caller sees them even when the work then stops with an error)."""

    def __init__(self, warn: Callable[[KickassError], None] | None) -> None:
        super().__init__()
        self.warn = warn

    def append(self, item: KickassError) -> None:
        super().append(item)
        if self.warn is not None:
            self.warn(item)


# The measurements start this long after creation: time to read the real
# credits_per_result back and stop them, before any result costs anything,
# if RIPE Atlas prices them above the budget.
DEFAULT_START_IN_S = 120


def create(
    settings: AtlasSettings,
    campaign: Campaign,
    all_sizes: bool = False,
    warn: Callable[[KickassError], None] | None = None,
    *,
    start_in_s: int = DEFAULT_START_IN_S,
    now: Callable[[], float] = time.time,
) -> CreateResult:
    """Create the campaign's measurements that do not exist yet, never twice.

    All of them in one request, so that they share their probes. Before it,
    measurements an earlier run created but never heard back about are looked
    up by the campaign's tag and adopted. After it, RIPE Atlas's own
    ``credits_per_result`` is read back and compared with the budget while
    the measurements have not started yet: over it, they are stopped (nothing
    spent) and ``create`` fails with the real price."""
    the_plan = campaign.plan(all_sizes=all_sizes)
    the_plan.check_budget()
    client = settings.client()
    client.require_key("creating measurements")
    result = CreateResult(campaign.name, warnings=_Warnings(warn))
    with settings.store() as store:
        campaign_id = store.upsert_campaign(campaign)

        def stored() -> dict[str, dict[str, Any]]:
            return {m["key"]: m for m in store.measurements(campaign_id)}

        planned = {m.key: m for m in the_plan.measurements}
        existing = stored()
        missing = [m for m in the_plan.measurements if m.key not in existing]
        if missing:
            # An earlier run may have created them and lost the answer.
            adopted = _adopt(client, store, campaign, campaign_id, planned, existing)
            result.created += adopted
            existing = stored()
            missing = [m for m in missing if m.key not in existing]
        if missing:
            if campaign.probes.selector == "ids" and not existing:
                _check_probes(client, store, campaign.probes.ids, result.warnings)
            _check_price_before(campaign, existing, missing)
            result.created += _create_missing(
                client, store, campaign, campaign_id, planned, existing, missing, start_in_s, now()
            )
        if result.created:
            _check_price_after(client, store, campaign, campaign_id, result)
        result.measurements = [
            {
                "key": r["key"],
                "msm_id": r["msm_id"],
                "status": r["status_name"],
                "estimated_credits": r["estimated_credits"],
                "credits_per_result": r["credits_per_result"],
            }
            for r in store.measurements(campaign_id)
        ]
    return result


def _key_of(description: object) -> str | None:
    """The plan key in a measurement's description ("... [whole-1480]")."""
    if not isinstance(description, str) or not description.endswith("]") or "[" not in description:
        return None
    return description.rsplit("[", 1)[1][:-1]


def _adopt(
    client: AtlasClient,
    store: AtlasStore,
    campaign: Campaign,
    campaign_id: int,
    planned: dict[str, PlannedMeasurement],
    existing: dict[str, dict[str, Any]],
) -> list[int]:
    """Record the campaign's measurements Atlas has and the database lacks
    (created by a run whose answer was lost); their ids."""
    adopted: list[int] = []
    for m in client.find_measurements(campaign.tag):
        key = _key_of(m.get("description"))
        status = (m.get("status") or {}).get("id")
        if key not in planned or key in existing or status not in LIVE_STATUSES:
            continue
        msm_id = int(m["id"])
        stop = m.get("stop_time")
        store.record_measurement(
            campaign_id,
            msm_id,
            planned[key],
            planned[key].definition(campaign.description, campaign.tag),
            datetime.fromtimestamp(stop, UTC) if isinstance(stop, int) else None,
        )
        existing[key] = {"msm_id": msm_id}
        adopted.append(msm_id)
    return adopted


def _create_missing(
    client: AtlasClient,
    store: AtlasStore,
    campaign: Campaign,
    campaign_id: int,
    planned: dict[str, PlannedMeasurement],
    existing: dict[str, dict[str, Any]],
    missing: list[PlannedMeasurement],
    start_in_s: int,
    now: float,
) -> list[int]:
    start = int(now + start_in_s)
    if existing:
        # Measurements added to a running campaign: from the probes Atlas
        # allocated to the running ones (which have them by now).
        first = existing.get(SPLIT_KEY) or next(iter(existing.values()))
        source: dict[str, Any] = {
            "type": "msm",
            "value": int(first["msm_id"]),
            "requested": campaign.probes.count,
        }
        stops = [int(r["stop_time"].timestamp()) for r in existing.values() if r.get("stop_time")]
        stop = max(stops) if stops and max(stops) > start + 60 else start + campaign.duration_s
    else:
        source = campaign.probes.to_source()
        stop = start + campaign.duration_s
    definitions = [m.definition(campaign.description, campaign.tag) for m in missing]
    try:
        ids = client.create(definitions, source, stop_time=stop, start_time=start)
    except AtlasNoAnswer:
        # The creation may have happened: look before creating again.
        adopted = _adopt(client, store, campaign, campaign_id, planned, existing)
        if adopted:
            if any(m.key not in existing for m in missing):
                raise KickassError(
                    "RIPE Atlas created part of the campaign's measurements and lost the answer",
                    hint="run the same command again: it adopts what exists, creates the rest",
                ) from None
            return adopted
        ids = client.create(definitions, source, stop_time=stop, start_time=start)
    for m, definition, msm_id in zip(missing, definitions, ids, strict=True):
        store.record_measurement(
            campaign_id, msm_id, m, definition, datetime.fromtimestamp(stop, UTC)
        )
    return ids


def _check_price_before(
    campaign: Campaign,
    existing: dict[str, dict[str, Any]],
    missing: list[PlannedMeasurement],
) -> None:
    """Before creating more: the campaign's cost at the prices RIPE Atlas
    charges for what exists (its ``credits_per_result``), the new ones priced
    at the highest ratio of Atlas's price to the documented rule seen so far."""
    ratio = 1.0
    total = 0
    for row in existing.values():
        rule = credits_per_result(int(row["packets"]), int(row["size"]))
        real = row.get("credits_per_result")
        if real:
            ratio = max(ratio, real / rule)
        total += (real or rule) * int(row["probes_requested"]) * campaign.results_per_probe
    for m in missing:
        total += math.ceil(m.credits_per_result * ratio) * m.probes * m.results_per_probe
    if total > campaign.credit_budget:
        raise CampaignError(
            f"creating {len(missing)} more measurements would bring the campaign to {total} "
            f"credits at RIPE Atlas's prices, above its credit_budget of {campaign.credit_budget}",
            hint="raise credit_budget or plan fewer measurements; nothing was created",
        )


def _check_price_after(
    client: AtlasClient,
    store: AtlasStore,
    campaign: Campaign,
    campaign_id: int,
    result: CreateResult,
) -> None:
    """Read RIPE Atlas's own ``credits_per_result`` back for every measurement
    of the campaign; if they bring it above the budget, stop the new ones
    (they have not started: nothing is spent) and fail with the real price."""
    total = 0
    unknown = []
    for row in store.measurements(campaign_id):
        problem = refresh(client, store, row, result.warnings)
        if problem is not None:
            result.warnings.append(problem)
    for row in store.measurements(campaign_id):
        cpr = row.get("credits_per_result")
        if cpr is None:
            unknown.append(row["key"])
            cpr = credits_per_result(int(row["packets"]), int(row["size"]))
        total += int(cpr) * int(row["probes_requested"]) * campaign.results_per_probe
    if unknown:
        result.warnings.append(
            KickassError(
                f"RIPE Atlas did not say what {', '.join(unknown)} cost: priced by the rule",
                hint="check `kickass atlas status` once they run",
            )
        )
    if total <= campaign.credit_budget:
        return
    stopped, failed = [], []
    for msm_id in result.created:
        try:
            client.stop(msm_id)
        except AtlasError:
            failed.append(msm_id)
            continue
        store.forget_measurement(msm_id)
        stopped.append(msm_id)
    result.created = []
    raise CampaignError(
        f"RIPE Atlas prices the campaign at {total} credits (its credits_per_result), above "
        f"its credit_budget of {campaign.credit_budget}: stopped {len(stopped)} new "
        "measurements before they started, nothing was spent"
        + (f"; could not stop {', '.join(map(str, failed))}" if failed else ""),
        hint=(
            "stop " + ", ".join(map(str, failed)) + " on atlas.ripe.net now, then "
            if failed
            else ""
        )
        + "raise credit_budget or shrink the plan (fewer probes, packets, sizes or a shorter "
        "duration) and run create again",
    )


def _check_probes(
    client: AtlasClient, store: AtlasStore, ids: tuple[int, ...], warnings: list[KickassError]
) -> None:
    """Explicit probe ids: say which will not produce results before paying."""
    probes = client.probes(ids)
    store.upsert_probes(probes)
    found = {int(p["id"]) for p in probes}
    usable = 0
    for p in probes:
        problem = probe_problem(p)
        if problem:
            warnings.append(
                KickassError(problem, hint="RIPE Atlas schedules only connected probes")
            )
        else:
            usable += 1
    for missing in sorted(set(ids) - found):
        warnings.append(
            KickassError(f"probe {missing} is unknown to RIPE Atlas", hint="check probes.ids")
        )
    if usable == 0:
        raise KickassError(
            "none of the campaign's probes is connected: nothing would be measured",
            hint="pick connected probes in probes.ids (atlas.ripe.net/probes)",
        )


def refresh(
    client: AtlasClient,
    store: AtlasStore,
    row: dict[str, Any],
    warnings: list[KickassError],
) -> AtlasError | None:
    """Read a measurement's status and credits_per_result back from Atlas.
    A failed request becomes a warning; a status that means trouble (forced
    stop, no suitable probes, failed) is returned."""
    try:
        info = client.measurement(row["msm_id"])
    except AtlasError as exc:
        warnings.append(exc)
        return None
    store.update_measurement(
        row["msm_id"],
        status_id=info.status_id,
        status_name=info.status_name,
        credits_per_result=info.credits_per_result,
        start_time=info.start_time,
        stop_time=info.stop_time or row.get("stop_time"),
    )
    return info.problem


# -- fetch --------------------------------------------------------------------------------


def fetch(
    settings: AtlasSettings,
    campaign: Campaign,
    *,
    settle_s: float = DEFAULT_SETTLE_S,
    chunk_s: int = DEFAULT_CHUNK_S,
    late_horizon_s: float = DEFAULT_LATE_HORIZON_S,
    progress: Callable[[str], None] | None = None,
) -> FetchReport:
    """Pull new results (and, once, the late uploads of windows
    ``late_horizon_s`` old), join them to the reply log, store them."""
    client = settings.client()
    with settings.store() as store:
        return fetch_campaign(
            store,
            client,
            campaign,
            settle_s=settle_s,
            chunk_s=chunk_s,
            late_horizon_s=late_horizon_s,
            progress=(lambda _msg: None) if progress is None else progress,
        )


# -- import -------------------------------------------------------------------------------


def import_results(
    settings: AtlasSettings,
    campaign: Campaign,
    sources: list[str],
    *,
    progress: Callable[[str], None] | None = None,
) -> ImportReport:
    """Store result lines from files (``-``: standard input) as ``fetch``
    would: the API's JSON list, NDJSON, RIPE Atlas's archive dumps, plain or
    compressed. Idempotent; needs no API access. A line that cannot be
    stored is skipped and named in the report (``result_files``)."""

    def lines() -> Iterator[SourceLine]:
        for source in sources:
            yield from numbered_result_lines(source)

    with settings.store() as store:
        return import_campaign(
            store,
            campaign,
            lines(),
            progress=(lambda _msg: None) if progress is None else progress,
        )


# -- status -------------------------------------------------------------------------------


@dataclass
class StatusResult:
    campaign: str
    credit_budget: int
    measurements: list[dict[str, Any]]
    verdicts: dict[str, int]
    replies_logged: int
    problems: list[KickassError] = field(default_factory=list)

    @property
    def credits_spent(self) -> int:
        return sum(m["credits_spent"] or 0 for m in self.measurements)

    @property
    def credits_estimated(self) -> int:
        return sum(m["estimated_credits"] or 0 for m in self.measurements)

    def to_json(self) -> dict[str, Any]:
        return {
            "campaign": self.campaign,
            "measurements": [
                {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in m.items()}
                for m in self.measurements
            ],
            "credits_spent": self.credits_spent,
            "credits_estimated": self.credits_estimated,
            "credit_budget": self.credit_budget,
            "verdicts": self.verdicts,
            "replies_logged": self.replies_logged,
            "problems": [p.message for p in self.problems],
        }


def status(
    settings: AtlasSettings,
    campaign: Campaign,
    *,
    offline: bool = False,
    warn: Callable[[KickassError], None] | None = None,
) -> StatusResult:
    """The campaign's measurements as stored, refreshed from Atlas unless ``offline``."""
    problems: list[KickassError] = _Warnings(warn)
    with settings.store() as store:
        campaign_id = store.campaign_id(campaign.name)
        if campaign_id is None:
            raise KickassError(
                f"campaign {campaign.name!r} is not in the database",
                hint="create it first: kickass atlas create CAMPAIGN.yaml",
            )
        if not offline:
            client = settings.client()
            for row in store.measurements(campaign_id):
                problem = refresh(client, store, row, problems)
                if problem is not None:
                    problems.append(problem)
        st = store.status(campaign.name)
    return StatusResult(
        campaign.name,
        campaign.credit_budget,
        st["measurements"],
        st["verdicts"],
        st["replies_logged"],
        problems,
    )
