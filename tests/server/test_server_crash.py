"""The server killed at random points, database up and down: nothing measured vanishes.

A real `kickass server` (its own PostgreSQL, a journal directory) runs a study
for the real `kickass-probe` on loopback; at a random moment of probing the
server gets SIGTERM or SIGKILL, with the database running or stopped. The
server is then started again on the same journal and database. What the
client received — and so acknowledged — is compared with what is stored:

* SIGTERM, database up or down: every probe the client received is stored
  (the outcomes the database could not take at shutdown waited in the
  journal and were stored at the restart); all but the at most W whose ACKs
  were still in flight when the engine stopped are stored as `acked` (those
  few as lost: the server never got their ACK), and the session ends
  `incomplete`.
* SIGKILL: the journal is written before the database is tried, so what is
  lost is bounded by the probe engine's outcome flush interval
  (probe_core.FLUSH_INTERVAL_S = 0.5 s) at the pacing cap; the session ends
  `incomplete` and the restarted server says how many writes it replayed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kickass_db as db
import pytest
from kickass_server.probe_core import FLUSH_INTERVAL_S
from kickass_testbed.pg import EmbeddedPostgres
from sqlalchemy import create_engine, text
from support.live_server import free_port as _free_port

BIN = Path(sys.executable).parent
PPS = 300  # the per-address pacing cap the server runs with here
WINDOW = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the probe engine needs a raw socket"),
]


class Server:
    def __init__(self, url: str, journal: Path, logs: Path) -> None:
        self.url, self.journal, self.logs = url, journal, logs
        self.http, self.probe = _free_port(socket.SOCK_STREAM), _free_port(socket.SOCK_DGRAM)
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    def start(self) -> None:
        self.runs += 1
        log = (self.logs / f"server-{self.runs}.log").open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "kickass"), "server", "--listen", f"127.0.0.1:{self.http}",
             "--probe-bind", "127.0.0.1", "--probe-port", str(self.probe),
             "--database-url", self.url, "--journal-dir", str(self.journal),
             "--log-level", "info"],
            env={**os.environ, "KICKASS_POLICY_PPS_PER_ADDRESS": str(PPS)},
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while "listening http" not in self.log(self.runs):
            assert self.proc.poll() is None, self.log(self.runs)
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)

    def log(self, run: int) -> str:
        return (self.logs / f"server-{run}.log").read_text()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)


def _stored(url: str, session_id: str) -> tuple[str | None, int, int]:
    engine = create_engine(db.sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            state = conn.execute(
                text("SELECT state FROM sessions WHERE session_id = :s"), {"s": session_id}
            ).scalar()
            rows, acked = conn.execute(
                text(
                    "SELECT count(*), count(*) FILTER (WHERE o.outcome = 'acked') "
                    "FROM probe_outcomes o JOIN sessions s ON s.id = o.session_pk "
                    "WHERE s.session_id = :s"
                ),
                {"s": session_id},
            ).one()
        return state, rows, acked
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("sig", "db_down", "seed"),
    [
        (signal.SIGTERM, False, 1),
        (signal.SIGTERM, True, 2),
        (signal.SIGKILL, False, 3),
        (signal.SIGKILL, True, 4),
    ],
    ids=["sigterm-db-up", "sigterm-db-down", "sigkill-db-up", "sigkill-db-down"],
)
def test_acknowledged_probes_are_stored_or_bounded(
    tmp_path: Path, sig: int, db_down: bool, seed: int
) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    server = Server(url, tmp_path / "journal", tmp_path)
    client = None
    try:
        db.upgrade(url)
        server.start()
        client = subprocess.Popen(
            [str(BIN / "kickass-probe"), "--server", f"http://127.0.0.1:{server.http}",
             "--repetitions", "12", "--step", "16", "--window", str(WINDOW),
             "--timeout", "3", "--yes", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # Somewhere in the middle of probing (the plan takes ~7 s at the cap).
        time.sleep(random.Random(seed).uniform(1.5, 4.0))
        if db_down:
            pg.stop()
            # Probing goes on for a few outcome flushes the database cannot take.
            time.sleep(3 * FLUSH_INTERVAL_S)
        server.signal(sig)
        out, err = client.communicate(timeout=120)
        result = json.loads(out)
        session_id = result["session_id"]
        received = result["local"]["received"]
        assert received > 100, err  # it was killed mid-probing, not before
        if db_down:
            pg.start()
        server.start()  # replays the journal, then ends its own orphans
        server.signal(signal.SIGTERM)
        state, rows, stored = _stored(url, session_id)
        assert state == "incomplete"
        restart_log = server.log(2)
        print(
            f"\n{sig!r} db_down={db_down}: client received {received}, "
            f"stored {rows} outcomes, {stored} acked"
        )
        if sig == signal.SIGTERM:
            assert rows >= received and 0 <= received - stored <= WINDOW, restart_log
            if db_down:
                assert "kept in" in server.log(1)
                assert "stored" in restart_log and "earlier run had journaled" in restart_log
        else:
            bound = int(PPS * FLUSH_INTERVAL_S) + WINDOW
            assert 0 <= received - stored <= bound, (received, stored, restart_log)
            if db_down:  # with the database up, the journal had nothing left to replay
                assert "earlier run had journaled" in restart_log
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
        pg.stop()
