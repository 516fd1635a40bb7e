"""Every documented limit of the HTTP front and the API, at its edge (issue 27 item 5).

The limit itself is accepted, one more is refused. Through the real front
(waitress, ``front.py``) serving the real app (every blueprint) on
PostgreSQL, over loopback sockets, wherever the front is part of the limit;
through the Flask test client where the app alone holds it.

Each limit, where it is documented, and its edge here:

- a body up to 256 KiB, with a Content-Length or chunked (server and docker
  READMEs, front.py): 262,144 bytes served, 262,145 refused (413);
- a request head up to 16 KiB (front.py, server README): 16,384 served,
  16,385 refused (431);
- the study's bodies up to 16 KiB (server README, api.py): 16,384 served,
  16,385 refused (413), through the front and by the app alone;
- a report up to 256 KiB (server README): the same, by the app alone;
- a batch of flows up to 256 KiB and 500 flows (server README, schemas.py);
- JSON nested at most 8 deep (server README): 8 taken, 9 refused (400);
- a signed request within 120 s of the server's clock (server README): 119 s
  either way served, 121 s refused (401);
- 200 connections in all (front.py, docker README): the 201st is served
  only once one of them closes;
- 8 connections per address (front.py, docker README): test_server_front.py
  holds 8 and sees the 9th refused;
- a request complete within 10 s of its first byte (front.py, docker
  README): test_server_front.py sees it closed past the deadline; here, a
  slow request complete just inside it is served;
- every string, list and JSON object of a body (schemas.py): at its limit
  stored (the volunteer's free text cut to its column), one more refused;
- the plan's numbers, admission and pacing (server README):
  test_plan_request_bounds.py and test_policy.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from kickass_core import signing
from kickass_core.plan import ProbePlan
from kickass_core.study_events import RunFinished
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server import schemas
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.front import FrontLimits, FrontServer, create_front
from kickass_server.policy import Policy
from pydantic import ValidationError
from support.trial_records import flow as _flow
from support.trial_records import trial as _trial

KIB = 1024
BODY = FrontLimits().max_body
HEAD = FrontLimits().max_header
STUDY_BODY = ApiConfig().max_body_bytes
DEPTH = ApiConfig().max_json_depth
assert (BODY, HEAD, STUDY_BODY, DEPTH) == (256 * KIB, 16 * KIB, 16 * KIB, 8)  # as documented


@dataclass
class Served:
    app: Flask
    front: FrontServer
    port: int
    study: StudyStore
    trials: TrialStore
    token: str


@pytest.fixture
def served(database_url: str) -> Iterator[Served]:
    study, trials = StudyStore(database_url), TrialStore(database_url)
    policy = Policy(sessions_per_address=100, sessions_per_address_hour=1000)
    engine = ProbeEngine(study, policy, probe_port=9000, server_version="limits")
    app = create_app(engine, study, ApiConfig(), trials=trials)
    front = create_front(app, "127.0.0.1", 0, threads=4)
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    try:
        yield Served(app, front, front.effective_port, study, trials, trials.add_runner("edge"))
    finally:
        front.close()
        front.task_dispatcher.shutdown(timeout=5)
        engine.stop()
        study.close()
        trials.close()


# -- raw HTTP over a socket: exact bytes, chunked or not ------------------------------------


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: limits", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunked(body: bytes, size: int = 16 * KIB) -> bytes:
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    )
    return out + b"0\r\n\r\n"


def _exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Status and body of the answer. A server that refuses a request while
    its body is still arriving may reset the connection: status 0."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        # Refused on its head alone: the answer comes before any body is sent.
        early, _, _ = select.select([s], [], [], 0.2)
        answer = b""
        try:
            if body and not early:
                s.sendall(body)
            while chunk := s.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):
            if not answer.startswith(b"HTTP/"):
                return 0, b""
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _json_of_size(size: int, value: Any) -> bytes:
    """``value`` as JSON of exactly ``size`` bytes: whitespace makes up the rest
    (JSON allows it anywhere between tokens; strict models see the same value)."""
    data = json.dumps(value, separators=(",", ":")).encode()
    assert len(data) <= size and data.endswith(b"}")
    return data[:-1] + b" " * (size - len(data)) + b"}"


def _finished_session(study: StudyStore) -> tuple[str, str]:
    """A finished session and its cookie (the report takes only those)."""
    sid, cookie = secrets.token_hex(8), secrets.token_bytes(16)
    now = datetime.now(UTC)
    study.create_session(
        session_id=sid,
        cookie_hash=hashlib.sha256(cookie).digest(),
        plan=ProbePlan.quick().to_json(),
        source_address="198.51.100.7",
        expires_at=now + timedelta(hours=1),
        server_version="limits",
    )
    assert study.apply(RunFinished(sid, "ended", "inconclusive", "fixture", "ended by the test"))
    return sid, cookie.hex()


# -- bodies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_of_256_kib_is_served_and_one_byte_more_refused(
    served: Served, chunked: bool
) -> None:
    """The largest body (a report) through the front: README's "up to 256 KiB"."""
    sid, cookie = _finished_session(served.study)
    path = f"/api/v1/sessions/{sid}/report"
    for size, want in ((BODY, 200), (BODY + 1, 413)):
        body = _json_of_size(size, {"reassembly": {"after": {"fails": 0}}})
        assert len(body) == size
        headers = {"Content-Type": "application/json", "X-Kickass-Cookie": cookie}
        if chunked:
            headers["Transfer-Encoding"] = "chunked"
            wire = _chunked(body)
        else:
            headers["Content-Length"] = str(size)
            wire = body
        status, answer = _exchange(served.port, _head("POST", path, headers), wire)
        if want == 200:
            assert status == 200, answer[:300]
            assert json.loads(answer)["session_id"] == sid
        else:
            # Refused by the front (a reset while the body still arrives is a refusal too).
            assert status in (413, 0), (status, answer[:300])
    stored = served.study.session_results(sid)
    assert stored["client_metadata"]["reassembly"]["client"] == {"after": {"fails": 0}}


def test_the_apps_own_caps_at_their_edges(served: Served) -> None:
    """The app holds the study's bodies to 16 KiB and a report to 256 KiB
    itself (behind another front, or none)."""
    client = served.app.test_client()
    sid, cookie = _finished_session(served.study)
    env = {"REMOTE_ADDR": "198.51.100.9"}
    for size, want in ((STUDY_BODY, 201), (STUDY_BODY + 1, 413)):
        body = _json_of_size(size, {"plan": {"quick": True}, "client_version": "t"})
        r = client.post(
            "/api/v1/sessions", data=body, content_type="application/json", environ_base=env
        )
        assert r.status_code == want, r.get_json()
    for size, want in ((BODY, 200), (BODY + 1, 413)):
        body = _json_of_size(size, {"reassembly": {}})
        r = client.post(
            f"/api/v1/sessions/{sid}/report",
            data=body,
            content_type="application/json",
            headers={"X-Kickass-Cookie": cookie},
        )
        assert r.status_code == want, r.get_json()
        assert r.is_json


def test_the_study_bodies_of_16_kib_through_the_front(served: Served) -> None:
    for size, want in ((STUDY_BODY, 201), (STUDY_BODY + 1, 413)):
        body = _json_of_size(size, {"plan": {"quick": True}})
        headers = {"Content-Type": "application/json", "Content-Length": str(size)}
        status, answer = _exchange(served.port, _head("POST", "/api/v1/sessions", headers), body)
        assert status == want, answer[:300]
        assert json.loads(answer)  # the app's JSON answer, either way


def test_a_request_head_of_16_kib_is_served_and_one_byte_more_refused(served: Served) -> None:
    for size, want in ((HEAD, 200), (HEAD + 1, 431)):
        bare = _head("GET", "/api/v1/health", {"X-Pad": ""})
        head = _head("GET", "/api/v1/health", {"X-Pad": "x" * (size - len(bare))})
        assert len(head) == size
        status, answer = _exchange(served.port, head)
        assert status == want, answer[:300]


def test_json_nested_8_deep_is_taken_and_9_refused(served: Served) -> None:
    client = served.app.test_client()
    for depth, want in ((DEPTH, 201), (DEPTH + 1, 400)):
        # The body is one level; its "pad" the rest.
        pad = "[" * (depth - 1) + "]" * (depth - 1)
        body = '{"plan": {"quick": true}, "pad": ' + pad + "}"
        r = client.post(
            "/api/v1/sessions",
            data=body,
            content_type="application/json",
            environ_base={"REMOTE_ADDR": "198.51.100.10"},
        )
        assert r.status_code == want, r.get_json()
        if want == 400:
            assert f"deeper than {DEPTH}" in r.get_json()["message"]


# -- a trial runner's uploads ---------------------------------------------------------------


def _signed(token: str, method: str, path: str, data: bytes, now: float | None = None) -> dict:
    key, name = signing.key_from_secret(token), signing.runner_name(token)
    return {"Content-Type": "application/json"} | signing.sign(
        key, name, method, path, data, now=now
    )


def test_500_flows_per_call_and_256_kib_per_batch(served: Served) -> None:
    client = served.app.test_client()
    tid = secrets.token_hex(16)
    path = f"/api/v1/trials/{tid}"
    data = json.dumps(_trial(tid)).encode()
    assert (
        client.put(path, data=data, headers=_signed(served.token, "PUT", path, data)).status_code
        == 200
    )
    flows = [_flow(tid, i, "tcp", 5, 10.0 + i, None) for i in range(schemas.MAX_FLOWS_PER_CALL + 1)]
    for n, want in ((schemas.MAX_FLOWS_PER_CALL + 1, 400), (schemas.MAX_FLOWS_PER_CALL, 200)):
        data = json.dumps({"flows": flows[:n]}).encode()
        assert len(data) < BODY  # the count is the limit here, not the size
        r = client.post(
            f"{path}/flows", data=data, headers=_signed(served.token, "POST", f"{path}/flows", data)
        )
        assert r.status_code == want, r.get_json()
        if want == 400:
            assert "flows" in r.get_json()["message"]
        else:
            assert len(r.get_json()["stored"]) == n
    # A batch of exactly 256 KiB through the front: stored; one byte more: refused.
    batch = [_flow(tid, 1000 + i, "tcp", 5, 10.0, None) for i in range(10)]
    for size, want in ((BODY, 200), (BODY + 1, 413)):
        data = _json_of_size(size, {"flows": batch})
        headers = _signed(served.token, "POST", f"{path}/flows", data)
        headers["Content-Length"] = str(size)
        status, answer = _exchange(served.port, _head("POST", f"{path}/flows", headers), data)
        if want == 200:
            assert status == 200, answer[:300]
            assert json.loads(answer)["stored"] == [f["flow_id"] for f in batch]
        else:
            assert status == 413, answer[:300]


@pytest.mark.parametrize(("offset_s", "want"), [(-121, 401), (-119, 200), (119, 200), (121, 401)])
def test_signed_requests_within_120_s_of_the_servers_clock(
    served: Served, offset_s: int, want: int
) -> None:
    """A request's time is whole seconds: ``offset_s`` from this clock, rounded
    away from it when refused and towards it when accepted (the server reads
    its clock a moment later)."""
    client = served.app.test_client()
    tid = secrets.token_hex(16)
    path = f"/api/v1/trials/{tid}"
    data = json.dumps(_trial(tid)).encode()
    now = time.time()
    inward = (offset_s > 0) == (want == 200)
    t = (math.floor(now) if inward else math.ceil(now)) + offset_s
    r = client.put(path, data=data, headers=_signed(served.token, "PUT", path, data, t))
    assert r.status_code == want, r.get_json()
    if want == 401:
        assert "clock" in r.get_json()["message"]


# -- connections ------------------------------------------------------------------------------


def _open_slow(port: int, source: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: limits\r\n")  # the head never ends
    return s


def test_200_connections_in_all_and_the_201st_waits_for_one_to_close(served: Served) -> None:
    total, per = FrontLimits().total, FrontLimits().per_address
    assert total == 200
    slow = [
        _open_slow(served.port, f"127.0.3.{1 + i // per}") for i in range(total)
    ]  # 25 addresses, 8 each: none over its own cap
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(served.front.active_channels) < total:
            time.sleep(0.05)
        assert len(served.front.active_channels) == total
        late = socket.create_connection(
            ("127.0.0.1", served.port), timeout=5, source_address=("127.0.4.1", 0)
        )
        with late:
            late.sendall(_head("GET", "/api/v1/health", {}))
            waited, _, _ = select.select([late], [], [], 1.0)
            assert not waited, "a connection past the total cap was served"
            slow.pop().close()
            late.settimeout(5)
            assert late.recv(12) == b"HTTP/1.1 200"
    finally:
        for s in slow:
            s.close()


def test_a_slow_request_complete_inside_the_deadline_is_served(database_url: str) -> None:
    limits = FrontLimits(request_timeout=4.0)
    study = StudyStore(database_url)
    engine = ProbeEngine(study, probe_port=9000, server_version="limits")
    front = create_front(create_app(engine, study), "127.0.0.1", 0, limits=limits)
    threading.Thread(target=front.run, daemon=True).start()
    try:
        head = _head("GET", "/api/v1/health", {})
        with socket.create_connection(("127.0.0.1", front.effective_port), timeout=10) as s:
            t0 = time.monotonic()
            # The head in 5 pieces over 2 s, half the deadline: a slow client
            # (or a busy machine) is not cut off while its request arrives.
            for i in range(5):
                s.sendall(head[i * len(head) // 5 : (i + 1) * len(head) // 5])
                time.sleep(0.4)
            s.sendall(head[len(head) // 5 * 5 :])
            assert s.recv(12) == b"HTTP/1.1 200"
            assert time.monotonic() - t0 < limits.request_timeout
    finally:
        front.close()
        front.task_dispatcher.shutdown(timeout=5)
        engine.stop()
        study.close()


# -- every string, list and object of a body ---------------------------------------------------


def _object_of_bytes(n: int) -> dict[str, str]:
    """A JSON object of exactly ``n`` bytes of compact JSON, within strictjson's
    bounds on each value (200 characters) and key."""

    def size(o: dict[str, str]) -> int:
        return len(json.dumps(o, separators=(",", ":")))

    out: dict[str, str] = {}
    while True:
        key = f"k{len(out):05d}"
        room = n - size({**out, key: ""})
        if room <= 200:
            out[key] = "x" * room
            assert room >= 0 and size(out) == n
            return out
        # Leave more than one entry's overhead for the last one.
        out[key] = "x" * min(200, room - 20)


def _at(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    return {**value, head: _at(value.get(head, {}), rest, new)}


_ARGS = {"trial_id": "0" * 32}
_PERIOD: dict[str, Any] = {
    "index": 0,
    "pair": 0,
    "protocol": "tcp",
    "start_s": 0.0,
    "duration_s": 1.0,
}
# (model, valid example, field, the value at the limit, one more)
FIELD_EDGES: list[tuple[Any, ...]] = [
    (schemas.SessionRequest, schemas.session_example, ("client_version",), "v" * 4096, "v" * 4097),
    (schemas.SessionRequest, schemas.session_example, ("platform",), "p" * 4096, "p" * 4097),
    (schemas.SessionRequest, schemas.session_example, ("install_id",), "i" * 4096, "i" * 4097),
    (
        schemas.ClientReportBody,
        schemas.report_example,
        ("invalid_ranges",),
        [[0, 1]] * schemas.MAX_RANGES,
        [[0, 1]] * (schemas.MAX_RANGES + 1),
    ),
    (
        schemas.ClientReportBody,
        schemas.report_example,
        ("reassembly",),
        _object_of_bytes(schemas.MAX_SUMMARY_BYTES),
        _object_of_bytes(schemas.MAX_SUMMARY_BYTES + 1),
    ),
    (
        schemas.ClientReportBody,
        schemas.report_example,
        ("fragment_observation", "summary"),
        _object_of_bytes(schemas.MAX_SUMMARY_BYTES),
        _object_of_bytes(schemas.MAX_SUMMARY_BYTES + 1),
    ),
    (
        schemas.ClientReportBody,
        schemas.report_example,
        ("fragment_observation", "leading"),
        "A" * schemas.MAX_OBSERVATION_CHARS,
        "A" * (schemas.MAX_OBSERVATION_CHARS + 1),
    ),
    (
        schemas.ClientReportBody,
        schemas.report_example,
        ("fragment_observation", "fragments"),
        "A" * schemas.MAX_OBSERVATION_CHARS,
        "A" * (schemas.MAX_OBSERVATION_CHARS + 1),
    ),
    (schemas.TrialBody, schemas.trial_example, ("destination",), "d" * 255, "d" * 256),
    (schemas.TrialBody, schemas.trial_example, ("router_run_name",), "r" * 128, "r" * 129),
    (
        schemas.TrialBody,
        schemas.trial_example,
        ("parameters",),
        _object_of_bytes(64 * KIB),
        _object_of_bytes(64 * KIB + 1),
    ),
    (
        schemas.TrialBody,
        schemas.trial_example,
        ("versions",),
        _object_of_bytes(16 * KIB),
        _object_of_bytes(16 * KIB + 1),
    ),
    (
        schemas.TrialBody,
        schemas.trial_example,
        ("environment",),
        _object_of_bytes(64 * KIB),
        _object_of_bytes(64 * KIB + 1),
    ),
    (
        schemas.TrialBody,
        schemas.trial_example,
        ("periods",),
        [{**_PERIOD, "index": i} for i in range(schemas.MAX_PERIODS)],
        [{**_PERIOD, "index": i} for i in range(schemas.MAX_PERIODS + 1)],
    ),
    (
        schemas.FlowsBody,
        schemas.flows_example,
        ("flows",),
        [{}] * schemas.MAX_FLOWS_PER_CALL,
        [{}] * (schemas.MAX_FLOWS_PER_CALL + 1),
    ),
]


@pytest.mark.parametrize(
    ("model", "example", "field", "at_limit", "over"),
    FIELD_EDGES,
    ids=[f"{m.__name__}.{'.'.join(f)}" for m, _, f, _, _ in FIELD_EDGES],
)
def test_every_bounded_field_at_its_limit_and_one_past_it(
    model: Any, example: Any, field: tuple[str, ...], at_limit: Any, over: Any
) -> None:
    base = example(_ARGS)
    model.model_validate(_at(base, field, at_limit))
    with pytest.raises(ValidationError) as exc:
        model.model_validate(_at(base, field, over))
    assert ".".join(field) in schemas.errors_text(exc.value)


def test_the_volunteers_free_text_is_cut_to_its_column(served: Served) -> None:
    """client_version, platform and install_id: up to 4096 characters taken and
    stored cut to their column (64, 128, 64); 4097 refused by name."""
    client = served.app.test_client()
    env = {"REMOTE_ADDR": "198.51.100.11"}
    long = {"client_version": "v" * 4096, "platform": "p" * 4096, "install_id": "i" * 4096}
    r = client.post("/api/v1/sessions", json={"plan": {"quick": True}, **long}, environ_base=env)
    assert r.status_code == 201, r.get_json()
    res = served.study.session_results(r.get_json()["session_id"])
    assert res["client_version"] == "v" * 64
    for name in long:
        r = client.post(
            "/api/v1/sessions",
            json={"plan": {"quick": True}, name: "z" * 4097},
            environ_base=env,
        )
        assert r.status_code == 400 and name in r.get_json()["message"]
