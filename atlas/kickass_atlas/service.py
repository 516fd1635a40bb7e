"""The Atlas operator's work as plain functions: plan, create, fetch, status.

Each takes an ``AtlasSettings`` (where the API and the database are) and a
``Campaign`` and returns a result object; none prints, parses flags or exits.
`kickass atlas` (cli.py) and the scheduled items of `kickass schedule`
(kickass_operations) are thin callers of these. Warnings that must not stop
the work (a probe that is disconnected, a status read that failed) are
collected in the result for the caller to show.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kickass_core import config
from kickass_core.errors import KickassError

from .campaign import Campaign, Plan
from .client import DEFAULT_SERVER, AtlasClient, AtlasError, probe_problem
from .ingest import DEFAULT_CHUNK_S, DEFAULT_SETTLE_S, FetchReport, fetch_campaign

if TYPE_CHECKING:
    from .store import AtlasStore

SECTION = "atlas"


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


def create(
    settings: AtlasSettings,
    campaign: Campaign,
    all_sizes: bool = False,
    warn: Callable[[KickassError], None] | None = None,
) -> CreateResult:
    """Create the campaign's measurements that do not exist yet (never twice)."""
    the_plan = campaign.plan(all_sizes=all_sizes)
    the_plan.check_budget()
    client = settings.client()
    client.require_key("creating measurements")
    result = CreateResult(campaign.name, warnings=_Warnings(warn))
    with settings.store() as store:
        campaign_id = store.upsert_campaign(campaign)
        existing = {m["key"]: m for m in store.measurements(campaign_id)}
        split, wholes = the_plan.measurements[0], the_plan.measurements[1:]
        now = time.time()
        if split.key not in existing:
            if campaign.probes.selector == "ids":
                _check_probes(client, store, campaign.probes.ids, result.warnings)
            stop = int(now + campaign.duration_s)
            definition = split.definition(campaign.description)
            [msm_id] = client.create([definition], campaign.probes.to_source(), stop_time=stop)
            store.record_measurement(
                campaign_id, msm_id, split, definition, datetime.fromtimestamp(stop, UTC)
            )
            result.created.append(msm_id)
            existing = {m["key"]: m for m in store.measurements(campaign_id)}
        split_row = existing[split.key]
        todo = [m for m in wholes if m.key not in existing]
        if todo:
            # Whole sizes ping from exactly the split measurement's probes (an
            # Atlas "msm" source), so the two phases compare probe by probe.
            split_stop = split_row.get("stop_time")
            stop = (
                int(split_stop.timestamp())
                if split_stop is not None and split_stop.timestamp() > now + 60
                else int(now + campaign.duration_s)
            )
            source = {"type": "msm", "value": split_row["msm_id"], "requested": split.probes}
            definitions = [m.definition(campaign.description) for m in todo]
            ids = client.create(definitions, source, stop_time=stop)
            for m, definition, msm_id in zip(todo, definitions, ids, strict=True):
                store.record_measurement(
                    campaign_id, msm_id, m, definition, datetime.fromtimestamp(stop, UTC)
                )
                result.created.append(msm_id)
        for row in store.measurements(campaign_id):
            if row["msm_id"] in result.created:
                refresh(client, store, row, result.warnings)
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
    progress: Callable[[str], None] | None = None,
) -> FetchReport:
    """Pull new results, join them to the reply log, store them."""
    client = settings.client()
    with settings.store() as store:
        return fetch_campaign(
            store,
            client,
            campaign,
            settle_s=settle_s,
            chunk_s=chunk_s,
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
