"""The volunteer's own page, the one-file client, and the server's front page.

    GET /                             what the study is, and how to run it
    GET /kickass-probe.pyz            the one-file client (``make zipapp``), with its
                                      SHA-256 in ``X-Kickass-SHA256`` and ``Repr-Digest``
    GET /kickass-probe.pyz.sha256     ``HEX  kickass-probe.pyz`` (sha256sum's format)
    GET /results/<session_id>/<key>   the volunteer's page of one session

**The link.** A session id alone does not open the page: it travels in every
probe datagram, unencrypted. The page's ``key`` is derived from the session's
cookie hash (``page_key``), which only the server stores; the client learns the
page's path (``page_path``) in the replies to requests it signs with its
cookie (the session GET once final, ``/end``, ``/report``) and prints the
link as its last line. The link is stable (nothing expires or changes it)
and can be shared; the JSON for scripts stays at ``/api/v1/sessions/<id>``.

**What the page shows.** This session's own numbers (drop rate by size and by
split with Wilson intervals, the verdict), next to the same drop rates
pooled over other volunteers: all of them, those from the same country, and
those from the same network (ASN; from an ip2asn table, ``network_table``,
``kickass_analysis.networks``; without one, no country or network is shown).
Nothing on it can single out another volunteer:

- a group is shown only when at least ``k`` *other clients* are in it, a
  client being an address block: the /24 (IPv4) or /48 (IPv6) its sessions
  were requested from (the SQL function ``client_key`` of migration 0016,
  which the rollups of the durable counts count with too). Never the install
  id, which the client writes itself: five runs from one address with five
  made-up ids are one client, not five. A volunteer cannot mint address
  blocks for free; volunteers behind one NAT, or in one provider's /24,
  count once (their results share a path; their group shows up later);
- each size of a group is shown only when ``k`` other clients measured it;
- two groups shown on one page never differ by fewer than ``k`` clients (``all``
  minus ``country`` would otherwise be whoever is left);
- group numbers are pooled counts, rounded to 0.1 percentage point; client
  counts are rounded down to a multiple of ``k``; no other session's id,
  address or install id is ever on the page, nor anything a browser would
  fetch (inline CSS and SVG, no script; a Content-Security-Policy that allows
  no fetch at all, and no referrer sent when a link is followed).

The viewer's own client (every session from its address block) is left out
of the groups: the comparison is with *other* volunteers. What these rules do not
stop: the same group looked at twice, before and after fewer than ``k`` new
clients joined it (the pooled counts are refreshed every ``cache_s``), and
two groups that differ by ``k`` or more clients overall but by fewer at one
size. Rounding blurs both; a stricter page would publish groups only in
releases of at least ``k`` new clients.

**At scale.** "All other volunteers" is read from the rollups of the
sessions' durable counts the scheduled ``refresh`` keeps (``v_drop_rollup``,
``unit_counts_total``, ``client_sizes``: migration 0020) plus the changes
since, so it costs the same at ten million probe rows as at ten thousand
(bench/dashboards_bench.py); a country or a network is pooled from its
sessions' durable counts, in proportion to its size.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask, Response, current_app, render_template, request
from kickass_analysis import figures, stats
from kickass_analysis.networks import Network, NetworkTable
from kickass_core.states import FINAL_STATES
from sqlalchemy import Connection, text

from .http import ApiError

PYZ_NAME = "kickass-probe.pyz"
DEFAULT_MIN_CLIENTS = 5
_KEY_DOMAIN = b"kickass volunteer page v1\x00"
_SESSION_ID = re.compile(r"[0-9a-f]{16}\Z")
_KEY = re.compile(r"[0-9a-f]{32}\Z")
ROUND_TO = 0.001  # group drop rates: 0.1 percentage point

# No fetch of any kind: styles are inline, figures are inline SVG.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Robots-Tag": "noindex, nofollow",
}


@dataclass(frozen=True)
class PageConfig:
    """Settings of the pages (``kickass server``: --client-dir, --network-table,
    --page-min-clients, --public-url, or their KICKASS_* variables)."""

    # Where ``make zipapp`` puts kickass-probe.pyz: this Python's share/kickass/.
    client_dir: Path = field(default_factory=lambda: Path(sys.prefix) / "share" / "kickass")
    # ip2asn TSV: volunteers' country and network by address (None: not shown).
    network_table: Path | None = None
    # k: a group is shown only with at least this many other clients in it.
    min_clients: int = DEFAULT_MIN_CLIENTS
    # The URL volunteers reach this server at, for the command the pages show
    # (None: the URL the request came in on).
    public_url: str | None = None
    # How long the population and the groups' pooled counts are reused.
    cache_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_clients < 1:
            raise ValueError(f"min_clients must be at least 1, got {self.min_clients}")


def page_key(cookie_hash: bytes) -> str:
    """The page's secret, from the session's stored cookie hash."""
    return hashlib.sha256(_KEY_DOMAIN + cookie_hash).hexdigest()[:32]


def page_path(session_id: str, cookie_hash: bytes) -> str:
    return f"/results/{session_id}/{page_key(cookie_hash)}"


def add_page_path(result: dict[str, Any], store: Any, session_id: str, cookie: str | None) -> None:
    """Put ``page_path`` into a session's JSON when the request carries the
    session's cookie and the session is final (the client prints the page's
    link then). A wrong or missing cookie adds nothing."""
    if not cookie or result.get("state") not in FINAL_STATES:
        return
    try:
        digest = hashlib.sha256(bytes.fromhex(cookie)).digest()
    except ValueError:
        return
    stored = store.cookie_hash(session_id)
    if stored and hmac.compare_digest(digest, bytes(stored)):
        result["page_path"] = page_path(session_id, bytes(stored))


# -- the one-file client ------------------------------------------------------------------


@dataclass(frozen=True)
class _Pyz:
    stamp: tuple[int, int, int]
    data: bytes
    sha256: str


class _State:
    """The pages' settings and caches (``app.extensions["kickass_page"]``)."""

    def __init__(self, config: PageConfig) -> None:
        self.config = config
        self.networks = NetworkTable.load(config.network_table) if config.network_table else None
        self._lock = threading.Lock()
        self._pyz: _Pyz | None = None
        self._cache: dict[Any, tuple[float, Any]] = {}

    def pyz(self) -> _Pyz | None:
        """The client's bytes and digest, read again whenever the file changed
        (the build replaces it atomically: the bytes hashed are the bytes served)."""
        path = self.config.client_dir / PYZ_NAME
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                with self._lock:
                    if self._pyz is not None and self._pyz.stamp == stamp:
                        return self._pyz
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        pyz = _Pyz(stamp, data, hashlib.sha256(data).hexdigest())
        with self._lock:
            self._pyz = pyz
        return pyz

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < self.config.cache_s:
                return hit[1]
        value = make()
        with self._lock:
            self._cache[key] = (now, value)
        return value


def _state() -> _State:
    state: _State = current_app.extensions["kickass_page"]
    return state


def install_page_state(app: Flask, config: PageConfig | None) -> None:
    """The pages' settings on ``app`` (create_app also registers ``volunteer_pages``)."""
    app.extensions["kickass_page"] = _State(config or PageConfig())


volunteer_pages = Blueprint("volunteer_page", __name__, template_folder="templates")


@volunteer_pages.after_request
def _headers(resp: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        resp.headers.setdefault(name, value)
    return resp


def _not_built() -> ApiError:
    where = _state().config.client_dir / PYZ_NAME
    return ApiError(
        404,
        "not-built",
        f"{PYZ_NAME} is not built on this server (no {where}): run `make zipapp` (it writes "
        f".venv/share/kickass/{PYZ_NAME}), or set the server's client_dir (--client-dir, "
        "KICKASS_CLIENT_DIR) to the folder that holds it",
    )


@volunteer_pages.get(f"/{PYZ_NAME}")
def get_pyz() -> Response:
    pyz = _state().pyz()
    if pyz is None:
        raise _not_built()
    resp = Response(pyz.data, mimetype="application/octet-stream")
    resp.headers["Content-Disposition"] = f'attachment; filename="{PYZ_NAME}"'
    resp.headers["X-Kickass-SHA256"] = pyz.sha256
    digest = base64.b64encode(bytes.fromhex(pyz.sha256)).decode()
    resp.headers["Repr-Digest"] = f"sha-256=:{digest}:"
    resp.headers["Cache-Control"] = "no-cache"
    resp.set_etag(pyz.sha256)
    resp.make_conditional(request)  # a 304 for a client that has these bytes
    return resp


@volunteer_pages.get(f"/{PYZ_NAME}.sha256")
def get_pyz_sha256() -> Response:
    pyz = _state().pyz()
    if pyz is None:
        raise _not_built()
    resp = Response(f"{pyz.sha256}  {PYZ_NAME}\n", mimetype="text/plain")
    resp.headers["Cache-Control"] = "no-cache"
    return resp


def _server_url() -> str:
    public = _state().config.public_url
    return (public or request.url_root).rstrip("/")


def _client_info() -> dict[str, Any]:
    pyz = _state().pyz()
    return {
        "server_url": _server_url(),
        "pyz_name": PYZ_NAME,
        "pyz_sha256": None if pyz is None else pyz.sha256,
        "pyz_kb": None if pyz is None else math.ceil(len(pyz.data) / 1024),
    }


@volunteer_pages.get("/")
def index() -> Response:
    return _html(render_template("index.html", **_client_info()))


# -- the volunteer's page ------------------------------------------------------------------

_SESSION = text("""
SELECT s.session_id, s.state, s.verdict, s.verdict_reason, s.created_at, s.finished_at,
       s.cookie_hash, host(s.source_address) AS address, client_key(s.source_address) AS who
FROM sessions s
WHERE s.session_id = :sid
""")
# Every finished session: which client ran it (client_key: its address
# block) and from where. A session with no address is nobody's: not counted.
_POPULATION = text(f"""
SELECT s.session_id, host(s.source_address) AS address, client_key(s.source_address) AS who
FROM sessions s
WHERE s.state IN {tuple(FINAL_STATES)} AND s.source_address IS NOT NULL
""")
_OWN = {
    "whole": text(
        "SELECT ip_len AS size, sent, acked FROM v_whole_drop "
        "WHERE session_id = :sid ORDER BY ip_len"
    ),
    "split": text(
        "SELECT leading_ip_len AS size, sent, acked FROM v_split_drop "
        "WHERE session_id = :sid ORDER BY leading_ip_len"
    ),
}
# Per size: pooled counts of some sessions (a group's; or the viewer's own
# in it, to leave them out) and how many distinct clients measured it. A
# group's counts are the same for every viewer: cached (PageConfig.cache_s).
_POOLED = {
    phase: text(f"""
WITH m AS (
    SELECT s.session_id, client_key(s.source_address) AS who
    FROM sessions s
    WHERE s.session_id = ANY(:ids))
SELECT d.{size} AS size, sum(d.sent) AS sent, sum(d.acked) AS acked,
       count(DISTINCT m.who) AS clients
FROM {view} d JOIN m ON m.session_id = d.session_id
GROUP BY d.{size}
""")
    for phase, size, view in (
        ("whole", "ip_len", "v_whole_drop"),
        ("split", "leading_ip_len", "v_split_drop"),
    )
}


# The "all other volunteers" group is every finished session, from the
# rollups of their durable counts (migration 0020), never from raw rows: its
# sums from the day rollup (v_drop_rollup: the folded changes plus those not
# folded yet), its distinct clients per size from unit_counts_total plus the
# clients of the changes not folded yet that client_sizes does not know of at
# that size. Exact: a client is counted once however many sessions it ran.
_POOLED_ALL = text("""
WITH sums AS (
    SELECT ip_len AS size, sum(sent)::bigint AS sent, sum(acked)::bigint AS acked
    FROM v_drop_rollup WHERE source = 'volunteer' AND phase = :phase
    GROUP BY ip_len
), new AS (
    SELECT x.ip_len AS size, count(DISTINCT c.client_key) AS clients
    FROM unit_count_changes c
    CROSS JOIN LATERAL unnest(c.ip_lens, c.units_by_size) AS x(ip_len, units)
    WHERE c.source = 'volunteer' AND c.phase = :phase AND c.client_key IS NOT NULL
      AND x.units > 0
      AND NOT EXISTS (SELECT 1 FROM client_sizes k
                      WHERE k.source = c.source AND k.client_key = c.client_key
                        AND k.phase = c.phase AND x.ip_len = ANY (k.ip_lens))
    GROUP BY x.ip_len
)
SELECT sums.size, sums.sent, sums.acked,
       coalesce(t.clients, 0) + coalesce(new.clients, 0) AS clients
FROM sums
LEFT JOIN unit_counts_total t
    ON t.source = 'volunteer' AND t.phase = :phase AND t.ip_len = sums.size
LEFT JOIN new ON new.size = sums.size
""")


@dataclass(frozen=True)
class Group:
    key: str  # all | country | network
    label: str
    others: frozenset[str]  # the other clients (client_key) in it
    shown: bool
    why: str  # why it is not shown
    rates: dict[str, list[stats.SizeRate]] = field(default_factory=dict)  # phase -> rates


def _rounded(x: float) -> float:
    return round(x / ROUND_TO) * ROUND_TO


Pooled = dict[int, tuple[int, int, int]]  # size -> (sent, acked, clients)


def _pooled(conn: Connection, phase: str, ids: list[str] | None) -> Pooled:
    """Per size (sent, acked, clients) of sessions ``ids``; None: every
    finished session (from the rollups)."""
    if ids is None:
        rows = conn.execute(_POOLED_ALL, {"phase": phase}).mappings()
    elif not ids:
        return {}
    else:
        rows = conn.execute(_POOLED[phase], {"ids": ids}).mappings()
    return {int(r["size"]): (int(r["sent"]), int(r["acked"]), int(r["clients"])) for r in rows}


def _group_rates(group: Pooled, own: Pooled, k: int) -> list[stats.SizeRate]:
    """The group's drop rate per size over the *other* clients (``own``: the
    viewer's sessions in it), where at least ``k`` of them measured that
    size; rounded."""
    out = []
    for size, (g_sent, g_acked, clients) in group.items():
        o_sent, o_acked, o_clients = own.get(size, (0, 0, 0))
        others = clients - (1 if o_clients else 0)
        sent, acked = g_sent - o_sent, g_acked - o_acked
        if others < k or sent <= 0:
            continue
        rate = stats.drop(sent, acked)
        out.append(
            stats.SizeRate(
                size,
                others,
                stats.Rate(0, 0, _rounded(rate.rate), _rounded(rate.low), _rounded(rate.high)),
            )
        )
    return sorted(out, key=lambda s: s.size)


@dataclass
class _Snapshot:
    """Every finished session (id, who ran it, its network), and the groups'
    pooled counts computed from exactly these sessions: they expire together,
    so the viewer's own sessions taken out are always among those counted."""

    members: list[tuple[str, str, Network | None]]
    pooled: dict[tuple[str, str, str], Pooled] = field(default_factory=dict)


def _population(conn: Connection, networks: NetworkTable | None) -> _Snapshot:
    rows = conn.execute(_POPULATION).mappings()
    return _Snapshot(
        [
            (r["session_id"], r["who"], networks.lookup(r["address"]) if networks else None)
            for r in rows
        ]
    )


def _groups(conn: Connection, state: _State, me: str | None, net: Network | None) -> list[Group]:
    """The groups beside the viewer's session; ``me``: the viewer's client
    (client_key), whose sessions are left out."""
    k = state.config.min_clients
    snapshot: _Snapshot = state.cached(("population",), lambda: _population(conn, state.networks))
    population = snapshot.members
    candidates: list[tuple[str, str, Callable[[Network | None], bool] | None]] = [
        ("all", "all other volunteers", lambda n: True),
    ]
    if state.networks is None:
        no_table = "this server has no table of networks and countries"
        candidates += [("country", "your country", None), ("network", "your network", None)]
    else:
        no_table = ""
        if net is not None and net.country:
            country = net.country
            candidates.append(
                (
                    "country",
                    f"your country ({country})",
                    lambda n: n is not None and n.country == country,
                )
            )
        else:
            candidates.append(("country", "your country", None))
        if net is not None:
            asn = net.asn
            candidates.append(
                ("network", f"your network (AS{asn})", lambda n: n is not None and n.asn == asn)
            )
        else:
            candidates.append(("network", "your network", None))
    shown: list[Group] = []
    out: list[Group] = []
    for key, label, member in candidates:
        if member is None:
            why = no_table or "your address is in no network this server knows"
            out.append(Group(key, label, frozenset(), False, why))
            continue
        ids = [sid for sid, who, n in population if member(n)]
        others = frozenset(who for sid, who, n in population if member(n) and who != me)
        if len(others) < k:
            why = f"fewer than {k} other address blocks measured from it yet"
            out.append(Group(key, label, others, False, why))
            continue
        clash = next(
            (g for g in shown if 0 < len(g.others - others) < k or 0 < len(others - g.others) < k),
            None,
        )
        if clash is not None:
            why = (
                f"it differs from {clash.label} by fewer than {k} address blocks, "
                "whose volunteers could be told apart"
            )
            out.append(Group(key, label, others, False, why))
            continue
        mine = [sid for sid, who, n in population if member(n) and who == me]
        rates = {}
        for phase in ("whole", "split"):
            pooled = snapshot.pooled.get((key, label, phase))
            if pooled is None:  # two requests may both compute it: the same numbers
                every = None if key == "all" else ids  # every finished session: the rollups
                pooled = snapshot.pooled[(key, label, phase)] = _pooled(conn, phase, every)
            rates[phase] = _group_rates(pooled, _pooled(conn, phase, mine), k)
        g = Group(key, label, others, True, "", rates)
        shown.append(g)
        out.append(g)
    return out


def _html(body: str, status: int = 200) -> Response:
    resp = Response(body, status=status, mimetype="text/html")
    resp.headers["Cache-Control"] = "private, no-cache"
    return resp


def _not_found() -> Response:
    return _html(render_template("not_found.html", **_client_info()), 404)


@volunteer_pages.get("/results/<session_id>/<key>")
def volunteer_page(session_id: str, key: str) -> Response:
    if not _SESSION_ID.match(session_id) or not _KEY.match(key):
        return _not_found()
    state = _state()
    store = current_app.extensions["kickass"].store

    def work(conn: Connection) -> dict[str, Any] | None:
        row = conn.execute(_SESSION, {"sid": session_id}).mappings().first()
        if row is None or not row["cookie_hash"]:
            return None
        if not hmac.compare_digest(page_key(bytes(row["cookie_hash"])), key):
            return None
        me = row["who"]
        net = state.networks.lookup(row["address"]) if state.networks else None
        own = {
            phase: stats.drop_by_size(
                [dict(r) for r in conn.execute(q, {"sid": session_id}).mappings()], "size"
            )
            for phase, q in _OWN.items()
        }
        return {"row": dict(row), "own": own, "groups": _groups(conn, state, me, net)}

    found = store.run(work, isolation="REPEATABLE READ")
    if found is None:
        return _not_found()
    return _html(render_template("volunteer.html", **_page_context(found, state)))


def _page_context(found: Mapping[str, Any], state: _State) -> dict[str, Any]:
    row, own, groups = found["row"], found["own"], found["groups"]
    k = state.config.min_clients
    colours = {
        "all": figures.COLOURS["all"],
        "country": figures.COLOURS["country"],
        "network": figures.COLOURS["network"],
    }
    lines = [figures.DropLine("this session", own, figures.COLOURS["session"])]
    lines += [
        figures.DropLine(g.label, g.rates, colours[g.key], line=True) for g in groups if g.shown
    ]
    titles = {"whole": "Drop rate against packet size", "split": "Drop rate against the split"}
    figs = figures.drop_by_phase("session", titles, lines)
    pooled = {}
    for phase in ("whole", "split"):
        sent = sum(p.rate.sent for p in own[phase])
        lost = sum(p.rate.lost for p in own[phase])
        pooled[phase] = stats.drop(sent, sent - lost) if sent else None
    return {
        **_client_info(),
        "session_id": row["session_id"],
        "state": row["state"],
        "verdict": row["verdict"],
        "verdict_reason": row["verdict_reason"],
        "day": (row["finished_at"] or row["created_at"]).strftime("%Y-%m-%d"),
        "pooled": pooled,
        "figures": figs,
        "groups": [
            {
                "label": g.label,
                "shown": g.shown,
                "why": g.why,
                "clients": (len(g.others) // k) * k,
            }
            for g in groups
        ],
        "k": k,
        "json_path": f"/api/v1/sessions/{row['session_id']}",
        "paper": stats.PAPER,
        "pct": _pct,
    }


def _pct(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{100 * x:.1f}%"
