"""Where claims are made: the database itself, or the measurement server's
schedule API (a trial runner host holds a runner token, not database
credentials). Both give the same guarantee, since the server claims in the
same table: one run per item and due time, whatever the number of hosts.

Both apply the schedule's rules, not the claimer's: the item's owners and
the stale limit come from this host's schedule file for a database host
(the store refuses a host the item does not name, and a due time ahead of
the database's clock) and from the server's own copy of the file for a
runner host. A refused claim is ``ClaimRefused``: counted where operators
look (``claim_refusals``), and no run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from kickass_core import signing
from kickass_core.claims import Claim
from kickass_core.errors import KickassError

from .schedule_file import Item, Settings


class ClaimRefused(KickassError):
    """The schedule does not let this host claim this run (``reason``: why,
    one of ``kickass_db.models.operations.CLAIM_REFUSALS``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, hint="compare this host's schedule file with the server's")
        self.reason = reason


class Claims(Protocol):
    """What the runner needs of a claim backend."""

    host: str
    # True where claims go through the server (no database on this host).
    api: bool

    def claim(self, item: Item, due_at: datetime) -> Claim | None: ...

    def heartbeat(self, claim: Claim) -> bool: ...

    def finish(
        self, claim: Claim, outcome: str, reason: str | None, counts: dict[str, Any]
    ) -> bool: ...

    def existing(self, keys: list[tuple[str, datetime]]) -> dict[tuple[str, datetime], str]: ...

    def reap(self, current: dict[str, datetime]) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


class DatabaseClaims:
    """Claims in PostgreSQL (``kickass_db.schedule_store``)."""

    api = False

    def __init__(self, database_url: str | None, host: str, settings: Settings) -> None:
        try:
            from kickass_db.schedule_store import ScheduleStore
        except ImportError:
            raise KickassError(
                "this host has no database package (kickass-db)",
                hint="give --server and a runner token to claim through the measurement server",
            ) from None
        self.store = ScheduleStore(database_url)
        self.host = host
        self.stale_s = settings.stale_after_s

    def claim(self, item: Item, due_at: datetime) -> Claim | None:
        from kickass_db.schedule_store import ClaimRefused as Refused

        try:
            c = self.store.claim(
                item.name, item.kind, due_at, self.host, item.definition_hash(),
                stale_s=self.stale_s, owners=item.owners,
            )  # fmt: skip
        except Refused as exc:
            raise ClaimRefused(exc.reason, exc.message) from None
        return c

    def heartbeat(self, claim: Claim) -> bool:
        return self.store.heartbeat(claim.run_id, self.host)

    def finish(
        self, claim: Claim, outcome: str, reason: str | None, counts: dict[str, Any]
    ) -> bool:
        return self.store.finish(claim.run_id, self.host, outcome, reason, counts)

    def existing(self, keys: list[tuple[str, datetime]]) -> dict[tuple[str, datetime], str]:
        return self.store.existing(keys)

    def reap(self, current: dict[str, datetime]) -> list[dict[str, Any]]:
        return self.store.reap(current, stale_s=self.stale_s)

    def close(self) -> None:
        self.store.close()


class ApiClaims:
    """Claims through the measurement server, signed with the runner token
    (``/api/v1/schedule``): for trial runner hosts, which have no database.
    The server judges the claim by its own schedule (owners, due times, the
    stale limit)."""

    api = True

    def __init__(self, server_url: str, runner_token: str, timeout_s: float = 15.0) -> None:
        self.base = server_url.rstrip("/") + "/api/v1/schedule"
        self.name = signing.runner_name(runner_token)
        self.key = signing.key_from_secret(runner_token)
        self.host = self.name
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            status, payload = signing.signed_json(
                self.key, self.name, method, self.base + path, body, timeout_s=self.timeout_s
            )
        except (OSError, ValueError) as exc:
            raise KickassError(
                f"the measurement server is unreachable at {self.base}: {exc}",
                hint="the item is left for the next run",
            ) from None
        if status == 403 and payload.get("error") == "no-schedule":
            raise KickassError(
                f"the server refused a schedule call: {payload.get('message', '')}",
                hint="the server's operator sets its schedule file (kickass server "
                "--schedule-file, or KICKASS_SCHEDULE_FILE): the file this host runs",
            )
        if status == 403 and path == "/claims":
            # The server's schedule does not allow this claim: this item only.
            raise ClaimRefused(str(payload.get("error", "")), str(payload.get("message", "")))
        if status in (400, 401, 403):
            raise KickassError(
                f"the server refused a schedule call ({status}): {payload.get('message', '')}",
                hint="check the runner token and the server's clock",
            )
        return status, payload

    def claim(self, item: Item, due_at: datetime) -> Claim | None:
        status, body = self._call(
            "POST",
            "/claims",
            {
                "item": item.name,
                "kind": item.kind,
                "due_at": due_at.isoformat(),
                "definition_hash": item.definition_hash(),
            },  # fmt: skip
        )
        if status == 409:
            return None
        if status != 201:
            raise KickassError(
                f"claim of {item.name} failed: HTTP {status} {body.get('message', '')}"
            )
        return Claim(
            int(body["run_id"]), item.name, due_at, int(body["attempt"]), body.get("took_over")
        )

    def heartbeat(self, claim: Claim) -> bool:
        status, _ = self._call("POST", f"/runs/{claim.run_id}/heartbeat", {})
        return status == 200

    def finish(
        self, claim: Claim, outcome: str, reason: str | None, counts: dict[str, Any]
    ) -> bool:
        status, _ = self._call(
            "PUT",
            f"/runs/{claim.run_id}",
            {"outcome": outcome, "reason": reason, "counts": counts},
        )
        return status == 200

    def existing(self, keys: list[tuple[str, datetime]]) -> dict[tuple[str, datetime], str]:
        # The claim itself answers (409 for a run already held or over).
        return {}

    def reap(self, current: dict[str, datetime]) -> list[dict[str, Any]]:
        # The server reaps the items it is asked to claim.
        return []

    def close(self) -> None:
        pass
