"""The volunteer's page, the one-file client served, and the front page.

With the real server (tests/support/live_server.py) and the real client: the
client's last line is its page; the page shows the session's own numbers
beside groups of *other* volunteers only when at least k other clients are
in them, and none of the neighbours seeded around it (known session ids,
addresses, install ids) appears in the page or in anything it fetches (it
fetches nothing: rendered in Chromium, the only request is the page). The
grouping rules on their own (distinct clients, not sessions; per size; no
two groups differing by fewer than k) run on the Flask app over a real
database, and so does the JSON side (``page_path`` only for the cookie).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from kickass_core.plan import ProbePlan
from kickass_core.study_events import (
    ClockAnchor,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_core.verdict import decide
from kickass_db.study_store import StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from kickass_server.volunteer_page import PYZ_NAME, PageConfig, page_path
from support import chromium
from support.live_server import free_port, server

PROBE = str(Path(sys.executable).parent / "kickass-probe")
K = 5
PUBLIC_URL = "http://measure.example"
SVG = "{http://www.w3.org/2000/svg}"
QUICK = ProbePlan.quick()
# ip2asn rows: loopback (the real client's address) and the /16s around the
# documentation prefixes (RFC 5737) of the seeded neighbours: a group counts
# address blocks (/24s), so its neighbours sit in blocks of their own.
NETWORK_TABLE = (
    "127.0.0.0\t127.255.255.255\t64500\tXA\tTEST-NET-HOME\n"
    "192.0.0.0\t192.0.255.255\t64500\tXA\tTEST-NET-HOME\n"
    "198.51.0.0\t198.51.255.255\t64501\tXA\tTEST-NET-OTHER\n"
    "203.0.0.0\t203.0.255.255\t64502\tXB\tTEST-NET-ABROAD\n"
)


@dataclass(frozen=True)
class Neighbour:
    session_id: str
    address: str
    install_id: str | None


def seed_session(
    store: StudyStore,
    address: str,
    install_id: str | None,
    *,
    plan: ProbePlan = QUICK,
    loss_every: int = 0,
    split_loss_every: int = 0,
    rng: secrets.SystemRandom | None = None,
) -> Neighbour:
    """One finished session through the real StudyStore: every probe acked,
    but every ``loss_every``-th whole and ``split_loss_every``-th split lost."""
    sid = secrets.token_hex(8)
    now = datetime.now(UTC) - timedelta(hours=1)
    store.create_session(
        session_id=sid,
        cookie_hash=hashlib.sha256(secrets.token_bytes(16)).digest(),
        plan=plan.to_json(),
        source_address=address,
        expires_at=now + timedelta(hours=3),
        server_version="0.1.0",
        install_id=install_id,
    )
    store.apply(RunProbing(sid, address, 40000, 20.0))
    outcomes = []
    for seq in range(plan.total_probes):
        p = plan.probe(seq)
        every = loss_every if p.phase == "whole" else split_loss_every
        lost = bool(every) and seq % every == 0
        sent = 0.002 * seq  # seconds after ``now``, the batch's anchor
        outcomes.append(
            OutcomeEntry(seq, p.phase, p.ip_len, "lost", sent, None, 0, None, None)
            if lost
            else OutcomeEntry(
                seq, p.phase, p.ip_len, "acked", sent, sent + 0.020, 1, p.udp_payload_len, None
            )
        )
    store.apply(OutcomeBatch(sid, tuple(outcomes), ClockAnchor(now.timestamp(), 0.0)))
    count = {
        ph: (
            sum(o.phase == ph for o in outcomes),
            sum(o.phase == ph and o.outcome == "acked" for o in outcomes),
        )
        for ph in ("whole", "split")
    }
    v = decide(*count["whole"], *count["split"])
    store.apply(RunFinished(sid, "complete", v.verdict, v.reason, None))
    return Neighbour(sid, address, install_id)


def seed_neighbours(store: StudyStore) -> list[Neighbour]:
    """Around a client on 127.0.0.1 (AS64500, country XA), with k = 5:

    - its network AS64500: 3 other address blocks (/24s) over 7 sessions,
      from 192.0.x.7: fewer than k blocks, however many sessions: not shown;
    - its country XA: those 3 and 6 more from AS64501 (198.51.x.y, one of
      them anonymous, running 3 sessions from one address: one block): 9
      other blocks: shown;
    - XB (AS64502, 203.0.x.7): 6 blocks; all volunteers: 15 others: shown,
      and it differs from the country group by 6 >= k blocks.
    """
    out = []
    for i in range(3):
        install = f"home-{i}-{secrets.token_hex(4)}"
        for _ in range(1 if i else 5):  # the first one runs 5 sessions
            out.append(
                seed_session(
                    store,
                    f"192.0.{10 + i}.7",
                    install,
                    loss_every=7 + i,
                    split_loss_every=5,
                )
            )
    for i in range(5):
        out.append(
            seed_session(
                store,
                f"198.51.{20 + i}.7",
                f"other-{i}-{secrets.token_hex(4)}",
                loss_every=9,
                split_loss_every=4 + i,
            )
        )
    for _ in range(3):  # anonymous: no install id; one address, one client
        out.append(seed_session(store, "198.51.99.99", None, loss_every=11, split_loss_every=6))
    for i in range(6):
        out.append(
            seed_session(
                store,
                f"203.0.{30 + i}.7",
                f"abroad-{i}-{secrets.token_hex(4)}",
                loss_every=13,
                split_loss_every=3,
            )
        )
    return out


def marks(page: str) -> dict[str, dict[str, int]]:
    """Per figure and series, the marks drawn (kickass_analysis.figures): a
    point is a <use> in its tagged group. Read from the SVG itself."""
    out: dict[str, dict[str, int]] = {}
    for svg in re.findall(r"<svg .*?</svg>", page, flags=re.S):
        root = ET.fromstring(svg)
        fig: dict[str, int] = {}
        for el in root.iter():
            if el.get("class") == "ka-mark":
                uses = sum(1 for u in el.iter(f"{SVG}use"))
                fig[el.get("data-series", "")] = fig.get(el.get("data-series", ""), 0) + (uses or 1)
        out[root.get("data-figure", "")] = fig
    return out


def assert_no_neighbour(page: str, neighbours: list[Neighbour]) -> None:
    for n in neighbours:
        assert n.session_id not in page
        assert n.address not in page
        assert not n.install_id or n.install_id not in page
    assert "127.0.0.1" not in page  # the client's own address is not shown either


# -- the real server and the real client -----------------------------------------------


@pytest.fixture
def live(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.skip("the real server's probe engine needs a raw socket (root)")
    client_dir = tmp_path / "share"
    client_dir.mkdir()
    pyz = client_dir / PYZ_NAME
    pyz.write_bytes(b"#!/usr/bin/env python3\nPK" + secrets.token_bytes(3000))
    table = tmp_path / "ip2asn.tsv"
    table.write_text(NETWORK_TABLE)
    # The server takes its settings from the environment too (flag > env > file).
    monkeypatch.setenv("KICKASS_CLIENT_DIR", str(client_dir))
    monkeypatch.setenv("KICKASS_NETWORK_TABLE", str(table))
    monkeypatch.setenv("KICKASS_PAGE_MIN_CLIENTS", str(K))
    monkeypatch.setenv("KICKASS_PUBLIC_URL", PUBLIC_URL)
    store = StudyStore(database_url)
    try:
        neighbours = seed_neighbours(store)
        probe_port, http_port = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
        with server(database_url, probe_port, http_port):
            yield {
                "url": f"http://127.0.0.1:{http_port}",
                "pyz": pyz,
                "neighbours": neighbours,
                "store": store,
            }
    finally:
        store.close()


def fetch(url: str) -> tuple[int, Message, bytes]:
    """Status, headers (case-insensitive, as HTTP's are) and body."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.mark.skipif(not chromium.available(), reason="needs chromium")
def test_the_clients_last_line_is_its_page(live: dict[str, Any], tmp_path: Path) -> None:
    proc = subprocess.run(
        [PROBE, "--server", live["url"], "--quick", "--yes"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    m = re.search(r"(http://127\.0\.0\.1:\d+/results/([0-9a-f]{16})/[0-9a-f]{32})$", last)
    assert m, last
    url, sid = m.group(1), m.group(2)
    # The JSON for scripts is still there, and the summary names it.
    assert f"{live['url']}/api/v1/sessions/{sid}" in proc.stdout
    status, _, body = fetch(f"{live['url']}/api/v1/sessions/{sid}")
    assert status == 200 and b'"state":"complete"' in body.replace(b" ", b"")
    stored = live["store"].session_results(sid)

    shown = chromium.render(url, evaluate={"marks": chromium.COUNT_MARKS})
    assert shown.errors == []
    assert shown.requests == [url]  # the page fetches nothing at all
    assert chromium.png_colours(shown.screenshot) > 20
    page = shown.dom
    status, headers, raw = fetch(url)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["Referrer-Policy"] == "no-referrer"
    for html in (page, raw.decode()):
        assert_no_neighbour(html, live["neighbours"])
        assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html)
    # Its own numbers: the pooled counts of each phase, and one point per size.
    whole_sent = sum(r["sent"] for r in stored["whole"])
    whole_acked = sum(r["acked"] for r in stored["whole"])
    row = re.search(r'<tr data-phase="whole">(.*?)</tr>', page, flags=re.S)
    assert row and f"<td>{whole_sent:,}</td>" in row.group(1)
    assert f"<td>{whole_acked:,}</td>" in row.group(1)
    drawn = shown.values["marks"]
    assert drawn == marks(raw.decode())  # the browser drew what was served
    n_whole, n_split = len(QUICK.whole), len(QUICK.split)
    # All volunteers (15 others) and the country (9) are beside it; the
    # network (3 other clients over 7 sessions) is not.
    assert drawn["session-by-size"] == {
        "this-session": n_whole,
        "all-other-volunteers": n_whole,
        "your-country-xa": n_whole,
    }
    assert drawn["session-by-split"] == {
        "this-session": n_split,
        "all-other-volunteers": n_split,
        "your-country-xa": n_split,
    }
    assert re.search(
        r"your network \(AS64500\): not shown, fewer than 5 other address blocks", page
    )
    # Block counts, rounded down to a multiple of k: 15 for all, 9 -> 5 for the country.
    assert "15 or more other address blocks" in page and "5 or more other address blocks" in page
    assert "9 or more" not in page
    # How to run it, with the server's public address and the file's digest.
    assert f"python3 {PYZ_NAME} --server {PUBLIC_URL}" in page
    assert hashlib.sha256(live["pyz"].read_bytes()).hexdigest() in page
    # Another session's page cannot be opened by its id, nor with a made-up key.
    other = live["neighbours"][0].session_id
    for bad in (f"/results/{other}/{'0' * 32}", f"/results/{sid}/{'0' * 32}", f"/results/{sid}"):
        status, _, body = fetch(live["url"] + bad)
        assert status == 404, bad
        assert other.encode() not in body
    # --json: unchanged but for the page's URL beside the JSON's.
    proc = subprocess.run(
        [PROBE, "--server", live["url"], "--quick", "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["session_url"] == f"{live['url']}/api/v1/sessions/{out['session_id']}"
    assert re.fullmatch(
        rf"{live['url']}/results/{out['session_id']}/[0-9a-f]{{32}}", out["page_url"]
    )
    assert fetch(out["page_url"])[0] == 200


def test_the_one_file_client_is_served_with_its_digest(live: dict[str, Any]) -> None:
    want = live["pyz"].read_bytes()
    digest = hashlib.sha256(want).hexdigest()
    status, headers, body = fetch(f"{live['url']}/{PYZ_NAME}")
    assert status == 200 and body == want
    assert headers["X-Kickass-SHA256"] == digest
    assert headers["Content-Type"] == "application/octet-stream"
    assert f'filename="{PYZ_NAME}"' in headers["Content-Disposition"]
    status, _, body = fetch(f"{live['url']}/{PYZ_NAME}.sha256")
    assert status == 200 and body.decode() == f"{digest}  {PYZ_NAME}\n"
    # A rebuild (an atomic replace) is served at once, with its own digest.
    new = b"#!/usr/bin/env python3\nPK" + secrets.token_bytes(5000)
    tmp = live["pyz"].with_suffix(".tmp")
    tmp.write_bytes(new)
    tmp.replace(live["pyz"])
    status, headers, body = fetch(f"{live['url']}/{PYZ_NAME}")
    assert body == new and headers["X-Kickass-SHA256"] == hashlib.sha256(new).hexdigest()
    # The front page says how to run it.
    status, headers, body = fetch(f"{live['url']}/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert f"python3 {PYZ_NAME} --server {PUBLIC_URL}" in page
    assert hashlib.sha256(new).hexdigest() in page and f'href="/{PYZ_NAME}"' in page
    # Not built: a 404 that says what to do.
    live["pyz"].unlink()
    status, headers, body = fetch(f"{live['url']}/{PYZ_NAME}")
    assert status == 404 and b"not built" in body and b"make zipapp" in body
    status, _, body = fetch(f"{live['url']}/{PYZ_NAME}.sha256")
    assert status == 404
    status, _, body = fetch(f"{live['url']}/")
    assert status == 200 and b"not available on this server yet" in body


# -- the grouping rules on the app ---------------------------------------------------------


App = tuple[FlaskClient, StudyStore, ProbeEngine]


@pytest.fixture
def app_client(database_url: str, tmp_path: Path) -> Iterator[App]:
    table = tmp_path / "ip2asn.tsv"
    table.write_text(NETWORK_TABLE)
    store = StudyStore(database_url)
    engine = ProbeEngine(store, Policy(), probe_port=9000, server_version="test")
    page = PageConfig(client_dir=tmp_path / "empty", network_table=table, min_clients=K, cache_s=0)
    app = create_app(engine, store, ApiConfig(probe_host="probe.example"), page=page)
    try:
        yield app.test_client(), store, engine
    finally:
        engine.stop()
        store.close()


def _page_of(client: FlaskClient, store: StudyStore, sid: str) -> str:
    cookie_hash = store.cookie_hash(sid)
    assert cookie_hash is not None
    r = client.get(page_path(sid, cookie_hash))
    assert r.status_code == 200
    return r.get_data(as_text=True)


def test_groups_count_clients_per_size_and_never_differ_by_fewer_than_k(
    app_client: App,
) -> None:
    client, store, _ = app_client
    me = seed_session(store, "192.0.2.1", "me-install", loss_every=5)
    neighbours = []
    # The network AS64500: 5 other clients, the country XA one more (AS64501):
    # both have k others, but they differ by one client, who could be told
    # apart; the narrower group gives way.
    for i in range(5):
        neighbours.append(seed_session(store, f"192.0.{20 + i}.1", f"n-{i}", loss_every=3))
    neighbours.append(seed_session(store, "198.51.7.1", "lonely", loss_every=2))
    # One more client with a plan of other sizes: those sizes have one client.
    coarse = ProbePlan.build(repetitions=2, step=200, window=8)
    neighbours.append(seed_session(store, "198.51.8.1", "coarse", plan=coarse))
    # My own second session is not another volunteer, nor is a session from
    # my address block under another install id (a housemate behind my NAT).
    seed_session(store, "192.0.2.1", "me-install", loss_every=9)
    neighbours.append(seed_session(store, "192.0.2.77", "housemate", loss_every=4))
    page = _page_of(client, store, me.session_id)
    assert_no_neighbour(page, neighbours)
    drawn = marks(page)["session-by-size"]
    # All other volunteers: 7 clients; per size, 6 measured the quick plan's
    # sizes, and the coarse plan's own sizes had one client: left out.
    assert drawn == {
        "this-session": len(QUICK.whole),
        "all-other-volunteers": len(QUICK.whole),
        "your-country-xa": len(QUICK.whole),
    }
    assert re.search(
        r"your network \(AS64500\): not shown, it differs from all other volunteers "
        r"by fewer than 5 address blocks",
        page,
    )
    # Pooled over the others only (my sessions out), rounded to 0.1 point:
    # the whole drop of all others per size is not mine (every 5th lost).
    r = client.get("/results/" + me.session_id + "/" + "f" * 32)
    assert r.status_code == 404 and b"No such page" in r.data


def test_the_all_group_from_the_rollups_is_the_same_page(
    app_client: App, database_url: str
) -> None:
    """ "All other volunteers" pools every finished session: from the rollups
    (kickass_analysis.rollups.refresh) the page is byte for byte the page
    computed from the outcomes, and a session finished after the refresh is in
    it at once."""
    from kickass_analysis import rollups

    client, store, _ = app_client
    me = seed_session(store, "192.0.2.1", "me-install", loss_every=5)
    neighbours = [
        seed_session(store, f"192.0.{20 + i}.1", f"n-{i}", loss_every=3) for i in range(6)
    ]
    coarse = ProbePlan.build(repetitions=2, step=200, window=8)  # sizes with one client
    neighbours.append(seed_session(store, "198.51.8.1", "coarse", plan=coarse))
    before = _page_of(client, store, me.session_id)
    assert marks(before)["session-by-size"]["all-other-volunteers"] == len(QUICK.whole)
    rollups.refresh(database_url)
    with store.engine.connect() as conn:
        rolled = conn.exec_driver_sql("SELECT count(*) FROM unit_counts_total").scalar_one()
    assert rolled > 0
    after = _page_of(client, store, me.session_id)
    assert after == before
    # Finished after the refresh, losing every other whole packet: counted live.
    neighbours.append(seed_session(store, "192.0.40.1", "n-late", loss_every=2))
    later = _page_of(client, store, me.session_id)
    assert_no_neighbour(later, neighbours)
    assert marks(later) == marks(before) and later != before


def _group_lines(page: str) -> list[str]:
    """The page's list of groups, as text."""
    items = re.findall(r"<li data-group=.*?</li>", page, flags=re.S)
    return [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", li)).strip() for li in items]


def test_made_up_install_ids_make_no_group(app_client: App) -> None:
    """Issue 27 item 3, the attack: five runs from one address, each with an
    install id of its own, beside two real volunteers of the same network (one
    of them a victim whose path drops every fragment). A group counts address
    blocks, which a volunteer cannot mint: the attacker's page shows neither
    its country nor its network, only "all other volunteers" (7 real blocks)."""
    client, store, _ = app_client
    victim = seed_session(store, "198.51.100.10", "victim", split_loss_every=1)
    honest = seed_session(store, "198.51.101.10", "honest", loss_every=9)
    abroad = [
        seed_session(store, f"203.0.{30 + i}.7", f"abroad-{i}", loss_every=13) for i in range(5)
    ]
    sybils = [
        seed_session(store, "198.51.200.66", f"sybil-{i}-{secrets.token_hex(4)}") for i in range(5)
    ]
    page = _page_of(client, store, sybils[0].session_id)
    assert_no_neighbour(page, [victim, honest, *abroad, *sybils[1:]])
    drawn = marks(page)
    assert set(drawn["session-by-size"]) == {"this-session", "all-other-volunteers"}
    assert set(drawn["session-by-split"]) == {"this-session", "all-other-volunteers"}
    assert _group_lines(page) == [
        "all other volunteers: volunteers from 5 or more other address blocks, drawn beside yours",
        "your country (XA): not shown, fewer than 5 other address blocks measured from it yet",
        "your network (AS64501): not shown, fewer than 5 other address blocks measured from it yet",
    ]
    # What k counts is on the page.
    assert "/24" in page and "address block" in page


def test_five_addresses_in_one_block_are_one_client(app_client: App, database_url: str) -> None:
    """Five volunteers (or one with five addresses) in one /24 count as one
    address block, in the groups and in the rollup of distinct clients
    (unit_counts_total, through the one SQL function client_key)."""
    from kickass_analysis import rollups

    client, store, _ = app_client
    me = seed_session(store, "192.0.2.1", "me-install", loss_every=5)
    block = [
        seed_session(store, f"198.51.100.{21 + i}", f"block-{i}", loss_every=3) for i in range(5)
    ]
    page = _page_of(client, store, me.session_id)
    assert_no_neighbour(page, block)
    assert marks(page)["session-by-size"] == {"this-session": len(QUICK.whole)}
    assert _group_lines(page)[0] == (
        "all other volunteers: not shown, fewer than 5 other address blocks measured from it yet"
    )
    rollups.refresh(database_url)
    with store.engine.connect() as conn:
        clients = conn.exec_driver_sql("SELECT DISTINCT clients FROM unit_counts_total").scalars()
        assert set(clients) == {2}  # me and the block
        keys = conn.exec_driver_sql(
            "SELECT client_key('198.51.100.7'), client_key('198.51.100.255'), "
            "client_key('2001:db8:1:2::1'), client_key('2001:db8:1:ffff::2'), client_key(NULL)"
        ).one()
    assert tuple(keys) == (
        "198.51.100.0/24",
        "198.51.100.0/24",
        "2001:db8:1::/48",
        "2001:db8:1::/48",
        None,
    )
    assert _page_of(client, store, me.session_id) == page  # from the rollup: the same
    # Four more blocks make five: now the group is shown.
    more = [seed_session(store, f"198.51.{i}.9", f"more-{i}", loss_every=3) for i in range(1, 5)]
    # (Refreshed: the rollup's blocks and those finished since are not merged
    # exactly, only as a lower bound of their union.)
    rollups.refresh(database_url)
    page = _page_of(client, store, me.session_id)
    assert_no_neighbour(page, block + more)
    assert marks(page)["session-by-size"]["all-other-volunteers"] == len(QUICK.whole)
    assert "5 or more other address blocks" in page


def test_page_path_only_with_the_cookie(app_client: App) -> None:
    client, _, engine = app_client
    r = client.post(
        "/api/v1/sessions",
        json={"plan": {"repetitions": 1, "step": 512, "window": 1}, "client_version": "t"},
        environ_base={"REMOTE_ADDR": "198.51.100.70"},
    )
    assert r.status_code == 201
    s = r.get_json()
    sid, cookie = s["session_id"], s["cookie"]
    # While it runs: no page path, cookie or not.
    assert "page_path" not in client.get(f"/api/v1/sessions/{sid}").get_json()
    r = client.post(f"/api/v1/sessions/{sid}/end", headers={"X-Kickass-Cookie": cookie})
    assert r.status_code == 200
    engine.tick()  # the loop's turn: the run ends
    engine.writer_sync()
    r = client.get(f"/api/v1/sessions/{sid}", headers={"X-Kickass-Cookie": cookie})
    assert r.get_json()["state"] == "ended"
    path = r.get_json()["page_path"]
    assert re.fullmatch(rf"/results/{sid}/[0-9a-f]{{32}}", path)
    # Ending it again (a retry after a lost answer) says the same.
    r = client.post(f"/api/v1/sessions/{sid}/end", headers={"X-Kickass-Cookie": cookie})
    assert r.status_code == 200 and r.get_json()["page_path"] == path
    # By id alone (what travels in the probes) or with a wrong cookie: none.
    assert "page_path" not in client.get(f"/api/v1/sessions/{sid}").get_json()
    bad = client.get(f"/api/v1/sessions/{sid}", headers={"X-Kickass-Cookie": "00" * 16})
    assert "page_path" not in bad.get_json()
    page = client.get(path)
    assert page.status_code == 200 and b"Your fragment viability result" in page.data
    # Nothing built here: the client's 404 says what to do, the page says it is missing.
    r = client.get(f"/{PYZ_NAME}")
    assert r.status_code == 404 and "make zipapp" in r.get_json()["message"]
    assert b"not available on this server yet" in page.data
