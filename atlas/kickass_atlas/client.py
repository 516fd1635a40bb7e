"""RIPE Atlas through Cousteau, behind one small class; every failure a KickassError.

Cousteau (``ripe.atlas.cousteau``) builds ``https://{server}/api/v2/...``
itself and sends ``Authorization: Key <key>``. It does not raise on an HTTP
error: it returns ``(ok, body)``, the body being Atlas's error envelope::

    {"error": {"status": 403, "code": 102, "title": "Forbidden",
               "detail": "...", "errors": [{"source": {"pointer": "..."}, "detail": "..."}]}}

or, when the request never got an answer, the exception's arguments. This
module turns each into one clear ``AtlasError`` with a hint (bad key,
rate-limited, not enough credits, not found, server trouble, unreachable).
Requests this module sends itself keep the HTTP status (Cousteau drops it),
so that an answer without the envelope — a proxy's bare ``429 Too Many
Requests`` page — is still told for what it is.
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
from urllib.parse import urlparse

from kickass_core.errors import KickassError
from ripe.atlas.cousteau import (
    AtlasCreateRequest,
    AtlasRequest,
    AtlasResultsRequest,
    AtlasSource,
    AtlasStopRequest,
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


class AtlasNoAnswer(AtlasUnavailable):
    """The request went out and no answer came back: it may or may not have
    been carried out (a creation must be looked up before it is retried)."""


RESUME = "the campaign is resumable: run the same command again"


def _throttled(text: str) -> bool:
    low = text.lower()
    return "429" in low or "too many requests" in low or "throttl" in low


def error_from_response(body: object, what: str, http_status: int | None = None) -> AtlasError:
    """The AtlasError for a failed call's ``body`` (and its HTTP status, when known)."""
    if isinstance(body, tuple):  # requests raised: no answer at all
        reason = "; ".join(str(a) for a in body) or "no answer"
        return AtlasNoAnswer(
            f"cannot reach RIPE Atlas ({what}): {reason}",
            hint=f"check the network and --atlas-server; {RESUME}",
        )
    envelope = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(envelope, Mapping):
        lines = str(body).strip().splitlines()
        first = lines[0][:200] if lines else "empty"
        if http_status == 429 or (http_status is None and _throttled(str(body)[:2000])):
            return AtlasRateLimited(
                f"RIPE Atlas is rate-limiting this client ({what}): {first}",
                hint=f"wait a minute; {RESUME}, it resumes where it stopped",
                status=429,
            )
        said = f" ({http_status})" if http_status else ""
        return AtlasUnavailable(
            f"RIPE Atlas gave an unexpected answer{said} ({what}): {first}",
            hint=f"RIPE Atlas may be having trouble; {RESUME} later",
            status=http_status,
        )
    status = envelope.get("status")
    status = int(status) if isinstance(status, int | str) and str(status).isdigit() else None
    if status is None:
        status = http_status
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
    def probes(self) -> int | None:
        """Probes Atlas scheduled (else requested): what the results will cost."""
        for key in ("probes_scheduled", "participant_count", "probes_requested"):
            value = self.meta.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None

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

    def _send(self, request: AtlasRequest, method: str, what: str) -> Any:
        """Send a Cousteau request, keeping the HTTP status Cousteau drops."""
        request.build_url()
        try:
            response: Any = request.get_http_method(method)
        except OSError as exc:  # requests' RequestException is an OSError
            raise error_from_response(exc.args or (str(exc),), what) from None
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        if not response.ok:
            raise error_from_response(body, what, response.status_code)
        return body

    def create(
        self,
        definitions: Iterable[Mapping[str, Any]],
        source: Mapping[str, Any],
        stop_time: int,
        start_time: int | None = None,
    ) -> list[int]:
        """Create ping measurements in one request: they share their probes
        (Atlas allocates one set for the request). Their ids, in order.
        ``AtlasNoAnswer``: the answer was lost, the creation may have happened."""
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
        request = AtlasCreateRequest(**kwargs)
        request._construct_post_data()  # what Cousteau's post() does, keeping the status
        request.http_method_args.update({"json": request.post_data})
        body = self._send(request, "POST", "creating measurements")
        ids = body.get("measurements") if isinstance(body, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(measurements):
            raise AtlasUnavailable(
                f"RIPE Atlas answered the creation with {body!r:.200}",
                hint="check the campaign's measurements on atlas.ripe.net before creating again",
            )
        return [int(i) for i in ids]

    def find_measurements(self, tag: str) -> list[dict[str, Any]]:
        """The key owner's measurements carrying ``tag`` (every page). A key
        without the "list your measurements" permission falls back on the
        public list (the campaign's measurements are public)."""
        key = self.require_key("looking up measurements")
        try:
            return self._list(f"/api/v2/measurements/my/?tags={tag}&page_size=100", key)
        except AtlasAuthError:
            return self._list(f"/api/v2/measurements/?tags={tag}&page_size=100", key)

    def _list(self, first: str, key: str) -> list[dict[str, Any]]:
        path: str | None = first
        found: list[dict[str, Any]] = []
        pages = 0
        while path and pages < 100:
            request = AtlasRequest(url_path=path, key=key, **self._common())
            body = self._send(request, "GET", "looking up the campaign's measurements")
            if not isinstance(body, Mapping):
                raise AtlasUnavailable(
                    "RIPE Atlas sent a measurement list that is not one",
                    hint=f"{RESUME} later",
                )
            found += [m for m in body.get("results") or [] if isinstance(m, dict)]
            nxt = body.get("next")
            path = _path_of(nxt) if isinstance(nxt, str) and nxt else None
            pages += 1
        return found

    def stop(self, msm_id: int) -> None:
        """Stop a measurement (before it started: it never costs anything)."""
        key = self.require_key("stopping measurements")
        request = AtlasStopRequest(msm_id=msm_id, key=key, **self._common())
        self._send(request, "DELETE", f"stopping measurement {msm_id}")

    def measurement(self, msm_id: int) -> MeasurementInfo:
        request = AtlasRequest(
            url_path=f"/api/v2/measurements/{int(msm_id)}/", key=self._key, **self._common()
        )
        body = self._send(request, "GET", f"measurement {msm_id}")
        if not isinstance(body, dict):
            raise AtlasUnavailable(
                f"RIPE Atlas sent measurement {msm_id} as {type(body).__name__}",
                hint=f"{RESUME} later",
            )
        try:
            m = Measurement(meta_data=body, **self._common())
        except (CousteauGenericError, KeyError, TypeError, ValueError) as exc:
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
        request = AtlasResultsRequest(
            msm_id=msm_id,
            start=_naive_utc(start),
            stop=_naive_utc(stop),
            key=self._key,
            **self._common(),
        )
        body = self._send(request, "GET", f"the results of measurement {msm_id}")
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


def _path_of(url: str) -> str:
    """Path and query of a ``next`` link (Cousteau adds the server itself)."""
    parsed = urlparse(url)
    return f"{parsed.path}?{parsed.query}" if parsed.query else parsed.path


def _naive_utc(t: int) -> datetime:
    """Cousteau turns naive datetimes into unix seconds with calendar.timegm (as UTC)."""
    return datetime.fromtimestamp(t, UTC).replace(tzinfo=None)


def probe_problem(probe: Mapping[str, Any]) -> str | None:
    """A warning for a probe that will not (or no longer) produce results."""
    name = (probe.get("status") or {}).get("name")
    reason = PROBE_STATUS_PROBLEMS.get(str(name))
    return None if reason is None else f"probe {probe.get('id')} {reason}"
