"""Sends spooled trial results to the measurement server, idempotently.

Trials go before their flows (the server keeps flows of a trial it does not
have yet waiting: 404 ``unknown-trial``). A record leaves the spool only once
the server has confirmed its id. The server answers a batch of flows record
by record: a stored id leaves the spool, a refused one (a bad record, or a
conflict with what is stored under its id) is moved aside to ``rejected/``
with the server's reason, alone; its neighbours are unaffected. Batches are
cut to fit the trials API's body cap before they are sent, and one the server
still finds too large (413: a smaller cap) is halved until it fits. A network
error, a 5xx, a 401/429 keep everything for the next attempt, so nothing disappears
without a word. A pass given a deadline (the trial runner's, between two
periods) sends nothing after it and waits for no answer past it: what it did
not send, or sent without hearing back, stays spooled for the next pass
(re-sending a stored record is a no-op).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kickass_core import signing

from .spool import Spool

log = logging.getLogger("kickass.trials.upload")

# Flow records are ~1 KB each: 100 stay well inside the server's 256 KiB body cap.
BATCH = 100
# ...but a record with a long error or many transport counters is several KB.
# Cut a batch before its JSON passes 3/4 of the trials API's cap (256 KiB,
# server/kickass_server/trials_api.py): a server refusing a body mid-send
# closes the connection, and a client still writing then sees a broken pipe,
# not the 413 it could split on (seen under load in CI).
BATCH_BYTES = 192 * 1024


@dataclass
class UploadReport:
    sent: int = 0
    rejected: int = 0
    pending: int = 0
    errors: list[str] = field(default_factory=list)
    # The pass reached its deadline: what is left waits for the next one.
    deferred: bool = False

    @property
    def ok(self) -> bool:
        return self.pending == 0 and self.rejected == 0


def _batches(recs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``recs`` in order, in batches of at most BATCH records and, but for a
    record that is alone too large, BATCH_BYTES of compact JSON (the body
    goes with json's default separators, a few percent more: inside the
    quarter of the cap left free)."""
    out: list[list[dict[str, Any]]] = []
    size = 0
    for rec in recs:
        n = len(json.dumps(rec["record"], separators=(",", ":"))) + 1
        if not out or len(out[-1]) >= BATCH or size + n > BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(rec)
        size += n
    return out


class _Deadline(Exception):
    """The pass's deadline came: stop sending."""


class Uploader:
    def __init__(self, server_url: str, runner_token: str, spool: Spool, timeout_s: float = 10.0):
        self.base = server_url.rstrip("/") + "/api/v1/trials"
        # Requests are signed with a key derived from the token; the token
        # itself never leaves this host (kickass_core.signing).
        self.name = signing.runner_name(runner_token)
        self.key = signing.key_from_secret(runner_token)
        self.spool = spool
        self.timeout_s = timeout_s
        self._deadline: float | None = None

    def _call(self, method: str, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        timeout = self.timeout_s
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise _Deadline
            timeout = min(timeout, left)
        try:
            return signing.signed_json(self.key, self.name, method, url, body, timeout_s=timeout)
        except OSError:
            # A timeout (raw, or in urllib's URLError) cut short by the deadline.
            if self._deadline is not None and time.monotonic() >= self._deadline - 0.01:
                raise _Deadline from None
            raise

    def flush(self, deadline: float | None = None) -> UploadReport:
        """One pass over the spool, until ``deadline`` (monotonic) if given;
        never raises for network or server trouble."""
        report = UploadReport()
        self._deadline = deadline
        try:
            for rec in self.spool.pending("trial"):
                status, body = self._call("PUT", f"{self.base}/{rec['id']}", rec["record"])
                self._settle(report, "trial", [rec], status, body, [rec["id"]])
            by_trial: dict[str, list[dict[str, Any]]] = {}
            for rec in self.spool.pending("flow"):
                by_trial.setdefault(rec["record"]["trial_id"], []).append(rec)
            for trial_id, recs in by_trial.items():
                for chunk in _batches(recs):
                    self._send_flows(report, trial_id, chunk)
        except _Deadline:
            report.deferred = True
        except (OSError, ValueError) as exc:
            # Server unreachable or answering garbage: everything stays spooled.
            report.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._deadline = None
        report.pending = self.spool.count()
        return report

    def _send_flows(self, report: UploadReport, trial_id: str, chunk: list[dict[str, Any]]) -> None:
        flows = [{k: v for k, v in r["record"].items() if k != "trial_id"} for r in chunk]
        status, body = self._call("POST", f"{self.base}/{trial_id}/flows", {"flows": flows})
        if status == 413 and len(chunk) > 1:
            # Too large for the server's body cap: halve until it fits.
            half = len(chunk) // 2
            self._send_flows(report, trial_id, chunk[:half])
            self._send_flows(report, trial_id, chunk[half:])
            return
        if status == 404 and body.get("error") == "unknown-trial":
            # The trial's own upload has not landed yet: keep, send later.
            report.errors.append(f"flows of trial {trial_id} wait for their trial")
            return
        if status == 200:
            for refusal in body.get("refused") or []:
                if not isinstance(refusal, dict):
                    continue
                index = refusal.get("index")
                if isinstance(index, int) and 0 <= index < len(chunk):
                    why = f"{refusal.get('error')}: {refusal.get('message')}"
                    self.spool.reject("flow", [chunk[index]["id"]], why)
                    report.rejected += 1
                    report.errors.append(f"flow {chunk[index]['id']} refused: {why}")
        self._settle(report, "flow", chunk, status, body, body.get("stored") or [])

    def _settle(
        self,
        report: UploadReport,
        kind: str,
        recs: list[dict[str, Any]],
        status: int,
        body: dict[str, Any],
        stored: list[str],
    ) -> None:
        if status == 200:
            confirmed = {s for s in stored if isinstance(s, str)}
            self.spool.done(kind, [r["id"] for r in recs if r["id"] in confirmed])
            report.sent += len(confirmed)
        elif 400 <= status < 500 and status not in (401, 408, 429):
            # The server will never accept these: keep them aside, with why.
            reason = str(body.get("message") or body.get("error") or status)
            self.spool.reject(kind, [r["id"] for r in recs], reason)
            report.rejected += len(recs)
            report.errors.append(f"{kind} refused ({status}): {reason}")
        else:
            report.errors.append(f"{kind} upload: HTTP {status} {body.get('error', '')}".strip())
