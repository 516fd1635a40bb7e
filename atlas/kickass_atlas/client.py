"""RIPE Atlas through Cousteau, behind one small class; every failure a KickassError.

Cousteau (``ripe.atlas.cousteau``) builds ``https://{server}/api/v2/...``
itself and sends ``Authorization: Key <key>``. It does not raise on an HTTP
error: it returns ``(ok, body)``, the body being Atlas's error envelope::

    {"error": {"status": 403, "code": 102, "title": "Forbidden",
               "detail": "...", "errors": [{"source": {"pointer": "..."}, "detail": "..."}]}}

or, when the request never got an answer, the exception's arguments. This
module turns each into one clear ``AtlasError`` with a hint (bad key,
rate-limited, not enough credits, not found, server trouble, unreachable).
The key is handed to Cousteau and nowhere else: it is never logged, printed
or stored, and no message here can contain it.

``verify`` is requests' ``verify``: True (the system's CAs), or the path of
a CA bundle — how the tests trust their local HTTPS stand-in without turning
verification off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kickass_core.errors import KickassError
from ripe.atlas.cousteau import (
    AtlasCreateRequest,
    AtlasResultsRequest,
    AtlasSource,
    Measurement,
    Ping,
    ProbeRequest,
)
from ripe.atlas.cousteau.exceptions import APIResponseError, CousteauGenericError

log = logging.getLogger("kickass.atlas")

DEFAULT_SERVER = "atlas.ripe.net"
# Measurement status ids (Atlas API): what each means for a campaign.
STATUS_NAMES = {
    0: "Specified",
    1: "Scheduled",
    2: "Ongoing",
    4: "Stopped",
    5: "Forced to stop",
    6: "No suitable probes",
    7: "Failed",
}
FINISHED_STATUSES = (4, 5, 6, 7)
STATUS_PROBLEMS = {
    5: "RIPE Atlas forced measurement {msm_id} to stop",
    6: "RIPE Atlas found no suitable probes for measurement {msm_id}",
    7: "RIPE Atlas reports measurement {msm_id} as failed",
}
STATUS_HINTS = {
    5: "its results up to the stop are kept and fetched; see "
    "https://atlas.ripe.net/measurements/{msm_id}/ for the reason",
    6: "the probe selection matched no connected probe: widen probes in the campaign file "
    "and create a new campaign",
    7: "see https://atlas.ripe.net/measurements/{msm_id}/ for the reason; its other "
    "measurements go on",
}
PROBE_STATUS_PROBLEMS = {
    "Never Connected": "has never connected to RIPE Atlas: it will produce no results",
    "Disconnected": "is disconnected: its results stop until it reconnects",
    "Abandoned": "is abandoned: no more results will come from it",
}


class AtlasError(KickassError):
    """RIPE Atlas refused or failed a request."""

    def __init__(self, message: str, hint: str | None = None, status: int | None = None) -> None:
        super().__init__(message, hint)
        self.status = status


class AtlasAuthError(AtlasError):
    """The API key is missing, wrong, disabled or lacks the permission."""


class AtlasRateLimited(AtlasError):
    """Too many requests: wait and run the same command again."""


class AtlasCreditsError(AtlasError):
    """The account behind the key cannot pay for the measurements."""


class AtlasNotFound(AtlasError):
    pass


class AtlasUnavailable(AtlasError):
    """No answer, or a server error: worth trying again later."""


RESUME = "the campaign is resumable: run the same command again"


def error_from_response(body: object, what: str) -> AtlasError:
    """The AtlasError for a failed Cousteau call's ``body``."""
    if isinstance(body, tuple):  # requests raised: no answer at all
        reason = "; ".join(str(a) for a in body) or "no answer"
        return AtlasUnavailable(
            f"cannot reach RIPE Atlas ({what}): {reason}",
            hint=f"check the network and --atlas-server; {RESUME}",
        )
    envelope = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(envelope, Mapping):
        text = str(body).strip().splitlines()
        return AtlasUnavailable(
            f"RIPE Atlas gave an unexpected answer ({what}): {text[0][:200] if text else 'empty'}",
            hint=f"RIPE Atlas may be having trouble; {RESUME} later",
        )
    status = envelope.get("status")
    status = int(status) if isinstance(status, int | str) and str(status).isdigit() else None
    title = str(envelope.get("title") or "")
    detail = str(envelope.get("detail") or "")
    details = [
        f"{(e.get('source') or {}).get('pointer', '')}: {e.get('detail', '')}".lstrip(": ")
        for e in envelope.get("errors") or []
        if isinstance(e, Mapping)
    ]
    said = "; ".join(x for x in [detail or title, *details] if x) or "no detail"
    head = f"RIPE Atlas refused {what} ({status} {title}): {said}"
    everything = " ".join([title, detail, *details]).lower()
    if status in (401, 403):
        return AtlasAuthError(
            f"RIPE Atlas refused the API key ({what}, {status} {title}): {said}",
            hint="set a valid key in $KICKASS_ATLAS_KEY or a --key-file; it must be enabled and "
            "allow creating measurements (atlas.ripe.net, My Atlas > API keys). "
            f"Nothing was changed; {RESUME}",
            status=status,
        )
    if status == 429:
        return AtlasRateLimited(
            f"RIPE Atlas is rate-limiting this client ({what}): {said}",
            hint=f"wait a minute; {RESUME}, it resumes where it stopped",
            status=status,
        )
    if status == 402 or "credit" in everything:
        return AtlasCreditsError(
            f"not enough RIPE Atlas credits ({what}): {said}",
            hint="top up the account behind the key or shrink the plan (`kickass atlas plan` "
            f"shows the cost); nothing was created for this step, {RESUME}",
            status=status,
        )
    if status == 404:
        return AtlasNotFound(head, hint="check the measurement id", status=status)
    if status is not None and status >= 500:
        return AtlasUnavailable(
            head, hint=f"RIPE Atlas is having trouble; {RESUME} later", status=status
        )
    return AtlasError(
        head, hint="fix the campaign file (the pointers name the fields)", status=status
    )


@dataclass(frozen=True)
class MeasurementInfo:
    msm_id: int
    status_id: int | None
    status_name: str | None
    start_time: datetime | None
    stop_time: datetime | None
    credits_per_result: int | None
    meta: dict[str, Any]

    @property
    def problem(self) -> AtlasError | None:
        """A clear message for a status that means trouble (forced stop,
        no suitable probes, failed), else None."""
        if self.status_id not in STATUS_PROBLEMS:
            return None
        return AtlasError(
            STATUS_PROBLEMS[self.status_id].format(msm_id=self.msm_id)
            + f" (status {self.status_id} {self.status_name})",
            hint=STATUS_HINTS[self.status_id].format(msm_id=self.msm_id),
        )

    @property
    def finished(self) -> bool:
        return self.status_id in FINISHED_STATUSES


class AtlasClient:
    def __init__(
        self, server: str = DEFAULT_SERVER, key: str | None = None, verify: bool | str = True
    ) -> None:
        self.server = server
        self._key = key
        self.verify = verify

    def __repr__(self) -> str:  # never the key
        return f"AtlasClient(server={self.server!r}, key={'set' if self._key else 'unset'})"

    def require_key(self, what: str) -> str:
        if not self._key:
            raise AtlasAuthError(
                f"{what} needs a RIPE Atlas API key",
                hint="set $KICKASS_ATLAS_KEY, or point --key-file / $KICKASS_ATLAS_KEY_FILE at a "
                "file holding the key",
            )
        return self._key

    def _common(self) -> dict[str, Any]:
        return {"server": self.server, "verify": self.verify}

    def create(
        self,
        definitions: Iterable[Mapping[str, Any]],
        source: Mapping[str, Any],
        stop_time: int,
        start_time: int | None = None,
    ) -> list[int]:
        """Create ping measurements sharing one probe source; their ids, in order."""
        key = self.require_key("creating measurements")
        measurements = [Ping(**dict(d)) for d in definitions]
        kwargs: dict[str, Any] = {
            "key": key,
            "measurements": measurements,
            "sources": [AtlasSource(**dict(source))],
            "stop_time": _naive_utc(stop_time),
            "is_oneoff": False,
            **self._common(),
        }
        if start_time is not None:
            kwargs["start_time"] = _naive_utc(start_time)
        ok, body = AtlasCreateRequest(**kwargs).create()
        if not ok:
            raise error_from_response(body, "creating measurements")
        ids = body.get("measurements") if isinstance(body, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(measurements):
            raise AtlasUnavailable(
                f"RIPE Atlas answered the creation with {body!r:.200}",
                hint="check the campaign's measurements on atlas.ripe.net before creating again",
            )
        return [int(i) for i in ids]

    def measurement(self, msm_id: int) -> MeasurementInfo:
        try:
            m = Measurement(id=msm_id, key=self._key, **self._common())
        except APIResponseError as exc:
            raise error_from_response(
                exc.args[0] if exc.args else None, f"measurement {msm_id}"
            ) from None
        except CousteauGenericError as exc:
            raise AtlasError(f"measurement {msm_id}: {exc}") from None
        meta = m.meta_data if isinstance(m.meta_data, dict) else {}
        cpr = meta.get("credits_per_result")
        return MeasurementInfo(
            msm_id=msm_id,
            status_id=m.status_id,
            status_name=m.status,
            start_time=m.start_time,
            stop_time=m.stop_time,
            credits_per_result=int(cpr) if isinstance(cpr, int | float) else None,
            meta=meta,
        )

    def results(self, msm_id: int, start: int, stop: int) -> list[dict[str, Any]]:
        """Results with ``start <= timestamp <= stop`` (unix seconds)."""
        ok, body = AtlasResultsRequest(
            msm_id=msm_id,
            start=_naive_utc(start),
            stop=_naive_utc(stop),
            key=self._key,
            **self._common(),
        ).create()
        if not ok:
            raise error_from_response(body, f"the results of measurement {msm_id}")
        if not isinstance(body, list):
            raise AtlasUnavailable(
                f"RIPE Atlas sent results of measurement {msm_id} that are not a list",
                hint=f"{RESUME} later",
            )
        return body

    def probes(self, prb_ids: Iterable[int]) -> list[dict[str, Any]]:
        """Probe metadata (ASN, country, address, status) for ``prb_ids``."""
        ids = sorted(set(prb_ids))
        if not ids:
            return []
        try:
            return list(ProbeRequest(id__in=ids, **self._common()))
        except APIResponseError as exc:
            raise error_from_response(exc.args[0] if exc.args else None, "probe metadata") from None


def _naive_utc(t: int) -> datetime:
    """Cousteau turns naive datetimes into unix seconds with calendar.timegm (as UTC)."""
    return datetime.fromtimestamp(t, UTC).replace(tzinfo=None)


def probe_problem(probe: Mapping[str, Any]) -> str | None:
    """A warning for a probe that will not (or no longer) produce results."""
    name = (probe.get("status") or {}).get("name")
    reason = PROBE_STATUS_PROBLEMS.get(str(name))
    return None if reason is None else f"probe {probe.get('id')} {reason}"
