"""Server policy: what a client may ask for, and how hard the server may send.

The probe server sends packets on request, so it must never become a flood
cannon. Three layers keep it honest:

* plan bounds — a session can only ask for a bounded number of probes;
* admission — concurrent and hourly session counts, and hourly bytes, per
  source address and per /24 (the unit one subscriber or one abuser controls);
* pacing — token buckets in packets/s per address, per /24 and globally,
  checked before every probe leaves (pacing.py).

Probes go only to an address that proved return routability (probe_core/);
these limits bound what even a proven address can draw. Everything here is
pure: time is passed in.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, fields

from kickass_core.errors import KickassError
from kickass_core.pacing import prefix_of
from kickass_core.plan import MAX_REPETITIONS, MAX_WINDOW, PHASES, PlanError, ProbePlan
from kickass_core.rate import FULL_PACKET_LEN
from pydantic import ValidationError

from .schemas import PlanRequest, errors_text

# A plan request's ``"window": "auto"``: adaptive, up to ``max_window``.
AUTO_WINDOW = "auto"

HOUR_S = 3600.0


class AdmissionDenied(Exception):
    """The policy refuses a new session (HTTP 429); the message says which limit."""


@dataclass
class Policy:
    max_repetitions: int = 200
    max_window: int = 64
    min_step: int = 8
    sessions_per_address: int = 2  # concurrent
    sessions_per_prefix: int = 8  # concurrent, per /24
    sessions_per_address_hour: int = 20
    sessions_per_prefix_hour: int = 100
    bytes_per_address_hour: int = 200_000_000
    bytes_per_prefix_hour: int = 1_000_000_000
    pps_per_address: float = 5000.0
    pps_per_prefix: float = 20000.0
    pps_global: float = 50000.0
    max_sessions: int = 256  # concurrent, whole server
    handshake_timeout_s: float = 30.0  # HELLO+ECHO must complete within this
    silence_timeout_s: float = 30.0  # probing with no ACK and no owner's poll: client gone
    max_session_s: float = 3 * 3600.0
    max_challenges_per_session: int = 8
    min_timeout_ms: float = 50.0
    max_timeout_ms: float = 3000.0
    # Adaptive plans (window "auto", kickass_server.window): the pacing rate of
    # one run in IP bits/s (the volunteer's access link must not notice it),
    # and the window it starts from.
    adaptive_rate_bps: float = 8_000_000.0
    adaptive_initial_window: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise KickassError(f"policy {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise KickassError(
                    f"policy {f.name} must be a finite number >= 0, got {value!r}",
                    hint=f"check KICKASS_POLICY_{f.name.upper()}",
                )
        for name in (
            "pps_per_address",
            "pps_per_prefix",
            "pps_global",
            "min_timeout_ms",
            "adaptive_rate_bps",
            "adaptive_initial_window",
        ):
            if getattr(self, name) <= 0:
                raise KickassError(
                    f"policy {name} must be above 0", hint=f"check KICKASS_POLICY_{name.upper()}"
                )
        for name, ceiling in (("max_repetitions", MAX_REPETITIONS), ("max_window", MAX_WINDOW)):
            # The request schema refuses more than the ceiling before a policy is asked.
            if getattr(self, name) > ceiling:
                raise KickassError(
                    f"policy {name} {getattr(self, name)} is above {ceiling}, the most any "
                    "server may offer (kickass_core.plan)",
                    hint=f"check KICKASS_POLICY_{name.upper()}",
                )
        if self.min_timeout_ms > self.max_timeout_ms:
            raise KickassError(
                f"policy min_timeout_ms {self.min_timeout_ms} is above max_timeout_ms "
                f"{self.max_timeout_ms}",
                hint="check KICKASS_POLICY_MIN_TIMEOUT_MS and KICKASS_POLICY_MAX_TIMEOUT_MS",
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Policy:
        """Every field as ``KICKASS_POLICY_<FIELD>`` (upper case)."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            name = f"KICKASS_POLICY_{f.name.upper()}"
            raw = env.get(name)
            if raw is None:
                continue
            try:
                kwargs[f.name] = float(raw) if f.type in ("float", float) else int(raw)
            except ValueError:
                raise KickassError(
                    f"bad {name} {raw!r}: not a number", hint="see server/README.md, Policy"
                ) from None
        return cls(**kwargs)  # type: ignore[arg-type]  # each value has its field's type (above); mypy sees object

    def plan_from_request(self, req: PlanRequest | object) -> ProbePlan:
        """The plan a client asked for (a ``schemas.PlanRequest``, or the JSON
        of one), within this server's bounds; PlanError otherwise."""
        if not isinstance(req, PlanRequest):
            try:
                req = PlanRequest.model_validate(req)
            except ValidationError as exc:
                raise PlanError(f"plan: {errors_text(exc)}") from None
        if req.quick:
            return ProbePlan.quick()
        repetitions = _bounded("repetitions", req.repetitions, 1, self.max_repetitions)
        step = _bounded("step", req.step, self.min_step, FULL_PACKET_LEN)
        # No window: the paper's stop-and-wait. "auto": the server adapts the
        # window up to its maximum. A number: exactly that many, always.
        adaptive = req.window == AUTO_WINDOW
        if adaptive:
            window = max(1, int(self.max_window))
        else:
            assert isinstance(req.window, int)
            window = _bounded("window", req.window, 1, self.max_window)
        phases = list(req.phases)
        if len(set(phases)) != len(phases):
            raise PlanError(f"plan.phases must be a non-empty list of distinct names from {PHASES}")
        return ProbePlan.build(
            repetitions=repetitions, step=step, window=window, phases=phases, adaptive=adaptive
        )


def _bounded(name: str, value: int, low: int, high: int) -> int:
    # A huge number is echoed as its size only: error messages go to logs.
    shown = value if abs(value) < 10**12 else f"of {len(str(abs(value)))} digits"
    if value > high:
        raise PlanError(f"{name} {shown} above the server limit {high}")
    if value < low:
        raise PlanError(f"{name} {shown} below the server limit {low}")
    return value


@dataclass(frozen=True, eq=False)
class AdmissionTicket:
    """One admitted session's claim on the limits (identity matters, not value)."""

    address: str
    prefix: str
    admitted_at: float
    nbytes: int


class Admission:
    """Concurrent and hourly accounting per address and per prefix.

    Pure: time is an argument. ``admit`` hands out a ticket; ``release`` ends a
    session (its hourly use stays counted), ``refund`` undoes an admission that
    created nothing (the database refused the session), as if it never was.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.active_by_address: dict[str, int] = {}
        self.active_by_prefix: dict[str, int] = {}
        self.active_total = 0
        # Tickets admitted in the last hour, oldest first, for the hourly windows.
        self.history_by_address: dict[str, deque[AdmissionTicket]] = {}
        self.history_by_prefix: dict[str, deque[AdmissionTicket]] = {}

    def check(self, address: str, nbytes: int, now: float) -> str | None:
        """None when admitted; otherwise the human reason for a 429."""
        p = self.policy
        prefix = prefix_of(address)
        ha = self._recent(self.history_by_address, address, now)
        hp = self._recent(self.history_by_prefix, prefix, now)
        if self.active_total >= p.max_sessions:
            return "the server is running its maximum number of sessions; try again later"
        if self.active_by_address.get(address, 0) >= p.sessions_per_address:
            return f"at most {p.sessions_per_address} concurrent sessions per address"
        if self.active_by_prefix.get(prefix, 0) >= p.sessions_per_prefix:
            return f"at most {p.sessions_per_prefix} concurrent sessions per {prefix}"
        if len(ha) >= p.sessions_per_address_hour:
            return f"at most {p.sessions_per_address_hour} sessions per address per hour"
        if len(hp) >= p.sessions_per_prefix_hour:
            return f"at most {p.sessions_per_prefix_hour} sessions per {prefix} per hour"
        if sum(t.nbytes for t in ha) + nbytes > p.bytes_per_address_hour:
            return f"at most {p.bytes_per_address_hour} probe bytes per address per hour"
        if sum(t.nbytes for t in hp) + nbytes > p.bytes_per_prefix_hour:
            return f"at most {p.bytes_per_prefix_hour} probe bytes per {prefix} per hour"
        return None

    def admit(self, address: str, nbytes: int, now: float) -> AdmissionTicket:
        ticket = AdmissionTicket(address, prefix_of(address), now, nbytes)
        self.active_by_address[address] = self.active_by_address.get(address, 0) + 1
        self.active_by_prefix[ticket.prefix] = self.active_by_prefix.get(ticket.prefix, 0) + 1
        self.active_total += 1
        self.history_by_address.setdefault(address, deque()).append(ticket)
        self.history_by_prefix.setdefault(ticket.prefix, deque()).append(ticket)
        return ticket

    def release(self, ticket: AdmissionTicket) -> None:
        """The session is over: it no longer counts as concurrent."""
        _decrement(self.active_by_address, ticket.address)
        _decrement(self.active_by_prefix, ticket.prefix)
        self.active_total = max(0, self.active_total - 1)

    def refund(self, ticket: AdmissionTicket) -> None:
        """Nothing was created: the ticket counts neither as concurrent nor hourly."""
        self.release(ticket)
        for table, key in (
            (self.history_by_address, ticket.address),
            (self.history_by_prefix, ticket.prefix),
        ):
            q = table.get(key)
            if q is not None:
                # Identity, not equality: two tickets of the same second and
                # size are still two sessions.
                for i, t in enumerate(q):
                    if t is ticket:
                        del q[i]
                        break
                if not q:
                    del table[key]

    def sweep(self, now: float) -> None:
        """Forget hourly windows that emptied (memory stays bounded by the last hour)."""
        for table in (self.history_by_address, self.history_by_prefix):
            for key in list(table):
                self._recent(table, key, now)

    @staticmethod
    def _recent(
        table: dict[str, deque[AdmissionTicket]], key: str, now: float
    ) -> deque[AdmissionTicket]:
        q = table.get(key)
        if q is None:
            return deque()
        while q and q[0].admitted_at <= now - HOUR_S:
            q.popleft()
        if not q:
            del table[key]
        return q


def _decrement(table: dict[str, int], key: str) -> None:
    n = table.get(key, 0) - 1
    if n > 0:
        table[key] = n
    else:
        table.pop(key, None)
