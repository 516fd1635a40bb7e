"""Whatever a server sends, the client answers with a result or a ProbeError.

Property tests (hypothesis) over the client's parsing of every HTTP reply it
handles (create, poll, end, error bodies and Retry-After) and of every UDP
datagram (ProbeSession.on_datagram with arbitrary bytes). A reply that is
accepted must then go through everything downstream (the runner's end of
run, the summary, the JSON) without an exception: "accepted" has to mean
"safe to use", not only "parsed".
"""

from __future__ import annotations

import email.message
import io
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_probe import api
from kickass_probe.api import ApiClient, parse_plan, printable
from kickass_probe.errors import ProbeError
from kickass_probe.output import format_summary, result_json
from kickass_probe.runner import Runner, _Ctx
from kickass_probe.session import MAX_PLAN_PROBES, LocalCounts, Phase, ProbeSession

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SID = "0123456789abcdef"
COOKIE = "00112233445566778899aabbccddeeff"
TAG = bytes.fromhex(SID)
PLAN = ProbePlan.build(repetitions=2, step=256, window=4)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _created() -> dict[str, Any]:
    return {
        "session_id": SID,
        "cookie": COOKIE,
        "probe_host": None,
        "probe_port": 9000,
        "plan": PLAN.to_json(),
        "total_probes": PLAN.total_probes,
        "expires_in_s": 30,
    }


def _result() -> dict[str, Any]:
    return {
        "session_id": SID,
        "state": "complete",
        "verdict": "fragments-ok",
        "verdict_reason": "fine",
        "end_reason": "plan-finished",
        "sent": 4,
        "acked": 3,
        "total_probes": PLAN.total_probes,
        "plan": PLAN.to_json(),
        "server_version": "x",
        "whole": [{"ip_len": 44, "sent": 2, "acked": 1, "late": 0, "drop_rate": 0.5}],
        "split": [
            {"leading_ip_len": 44, "sent": 2, "acked": 2, "drop_rate": None, "frag_observed": 0}
        ],
    }


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A valid reply with a few fields (also nested ones) replaced or removed."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        target = doc
        # Walk into a nested object or a row now and then.
        for _depth in range(draw(st.integers(0, 2))):
            children = [
                v
                for v in target.values()
                if isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict))
            ]
            if not children:
                break
            child = draw(st.sampled_from(children))
            target = child if isinstance(child, dict) else child[0]
        keys = sorted(target) + ["extra"]
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(json_values)
    return doc


def body_for(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        mutated(base).map(lambda v: json.dumps(v).encode()),
        # What Python's json would accept but JSON does not, and a nesting
        # deep enough to exhaust the parser.
        st.sampled_from(
            [
                b'{"state": NaN}',
                b'{"state": "complete", "sent": Infinity}',
                b"[" * 100_000,
                b'{"total_probes": ' + b"9" * 5000 + b"}",
            ]
        ),
    )


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    def read(self, n: int = -1) -> bytes:
        return self._body

    def __enter__(self) -> _Resp:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def serve(monkeypatch: pytest.MonkeyPatch, *outcomes: Any) -> None:
    queue = list(outcomes)

    def fake_urlopen(req: Any, timeout: float) -> Any:
        out = queue.pop(0) if queue else _Resp(200, b'{"state": "ended"}')
        if isinstance(out, BaseException):
            raise out
        return out

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)


def client() -> ApiClient:
    return ApiClient("http://measure.test", timeout=1, sleep=lambda _s: None)


class _Shell:
    def __init__(self) -> None:
        self.counts = LocalCounts()

    def snapshot(self) -> tuple[Phase, None, LocalCounts]:
        return Phase.DONE, None, self.counts.copy()

    def reassembly_summary(self) -> None:
        return None

    def invalid_ranges(self) -> list[tuple[int, int]]:
        return []

    def observation(self) -> None:
        return None


class _Progress:
    def update(self, done: int, total: int, description: str) -> None: ...
    def note(self, text: str) -> None: ...
    def close(self) -> None: ...


def downstream(res: dict[str, Any], plan: ProbePlan = PLAN) -> None:
    """Everything the client does with an accepted session reply."""
    runner = Runner(
        client(),
        {},
        timeout=1.0,
        platform_name="Linux",
        progress=_Progress(),
        log=lambda _t: None,
    )
    ctx = _Ctx(SID, COOKIE, plan, plan.total_probes, ("127.0.0.1", 9000), _Shell())  # type: ignore[arg-type]
    result = runner._finished(ctx, res)
    json.dumps(result_json(result), allow_nan=False)
    for verbose in (False, True):
        text = format_summary(result, verbose=verbose)
        assert "\x1b" not in text


# -- HTTP ---------------------------------------------------------------------------------


@SETTINGS
@given(body=body_for(_created()))
def test_any_create_reply_is_accepted_or_a_probe_error(
    monkeypatch: pytest.MonkeyPatch, body: bytes
) -> None:
    serve(monkeypatch, _Resp(201, body))
    try:
        created = client().create_session({"quick": True}, platform="Linux")
    except ProbeError:
        return
    # Accepted: the runner's uses of it work.
    plan = parse_plan(created["plan"])
    assert 0 < plan.total_probes <= MAX_PLAN_PROBES
    assert 0 < int(created["probe_port"]) < 65536
    session = ProbeSession(bytes.fromhex(created["session_id"]), bytes.fromhex(COOKIE), plan)
    assert session.start(0.0)


@SETTINGS
@given(body=body_for(_result()), end=st.booleans())
def test_any_session_reply_is_accepted_or_a_probe_error(
    monkeypatch: pytest.MonkeyPatch, body: bytes, end: bool
) -> None:
    serve(monkeypatch, _Resp(200, body))
    c = client()
    try:
        res = c.end_session(SID, COOKIE) if end else c.get_session(SID, cookie=COOKIE)
    except ProbeError:
        return
    downstream(res)


@SETTINGS
@given(
    status=st.integers(400, 599),
    body=st.one_of(
        st.binary(max_size=100),
        st.fixed_dictionaries({"error": json_values, "message": json_values}).map(
            lambda v: json.dumps(v).encode()
        ),
    ),
    retry_after=st.none() | st.text(max_size=12) | st.floats().map(str),
)
def test_any_error_reply_is_a_probe_error(
    monkeypatch: pytest.MonkeyPatch, status: int, body: bytes, retry_after: str | None
) -> None:
    msg = email.message.Message()
    if retry_after is not None:
        assume("\n" not in retry_after and "\r" not in retry_after)
        msg["Retry-After"] = retry_after
    err = urllib.error.HTTPError("http://x/", status, "reason\x1b[2J", msg, io.BytesIO(body))
    waits: list[float] = []
    serve(monkeypatch, err, err, err, err)
    c = ApiClient("http://measure.test", timeout=1, sleep=waits.append)
    with pytest.raises(ProbeError) as info:
        c.create_session({"quick": True}, platform="Linux")
    assert all(0 <= w <= api.MAX_RETRY_AFTER_S or w in (0.5, 1.0) for w in waits)
    assert info.value.message.isprintable()


@SETTINGS
@given(value=json_values)
def test_any_plan_is_a_plan_or_a_probe_error(value: Any) -> None:
    try:
        plan = parse_plan(value)
    except ProbeError:
        return
    assert 0 < plan.total_probes <= MAX_PLAN_PROBES


@SETTINGS
@given(text=st.text(max_size=400), limit=st.integers(10, 300))
def test_printable_is_printable_and_bounded(text: str, limit: int) -> None:
    out = printable(text, limit)
    assert out.isprintable() and len(out) <= limit


# -- UDP ----------------------------------------------------------------------------------

_KINDS = st.sampled_from([k.value for k in wire.Kind] + [0, 7, 255])


@st.composite
def datagrams(draw: st.DrawFn) -> bytes:
    """Random bytes, or a well-formed prefix (ours or not) with a random tail."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=2000))
    tag = TAG if draw(st.integers(0, 3)) else draw(st.binary(min_size=8, max_size=8))
    head = b"KA" + bytes([draw(_KINDS), draw(st.sampled_from([1, 1, 1, 2]))]) + tag
    kind = head[2]
    if kind == wire.Kind.PROBE and draw(st.booleans()):
        seq = draw(st.integers(0, 2**32 - 1) | st.integers(0, PLAN.total_probes + 2))
        size = draw(st.integers(16, 1472))
        return wire.probe_payload(tag, seq, size)[: draw(st.integers(12, size))]
    return head + draw(st.binary(max_size=draw(st.sampled_from([4, 16, 70_000]))))


_OVERSIZED_PROBE = b"KA\x04\x01" + TAG + b"\0\0\0\0" + bytes(70_000)


@SETTINGS
@example(steps=[(_OVERSIZED_PROBE, 0, 0.1)])  # its length does not fit the ACK's 16 bits
@example(steps=[(b"KA\x02\x01" + TAG + bytes(16), 0, 0.1), (b"KA\x06\x01" + TAG, 0, 0.1)])
@given(
    steps=st.lists(
        st.tuples(datagrams(), st.integers(0, 2**32 - 1), st.floats(0, 3)),
        max_size=30,
    )
)
def test_any_datagram_sequence_is_handled(steps: list[tuple[bytes, int, float]]) -> None:
    s = ProbeSession(TAG, bytes.fromhex(COOKIE), PLAN, challenge_timeout=5.0)
    now = 0.0
    out = s.start(now)
    for data, frag, dt in steps:
        now += dt
        out += s.on_datagram(data, frag, now)
        out += s.on_timer(now)
    # Everything the client sends is a well-formed message of its own session.
    for d in out:
        msg = wire.decode(d)
        assert isinstance(msg, wire.Hello | wire.Echo | wire.Ack)
        assert msg.session_tag == TAG
    c = s.counts
    assert 0 <= c.received <= PLAN.total_probes
    assert c.highest_seq < PLAN.total_probes
    assert (
        sum(v.received for v in c.whole.values()) + sum(v.received for v in c.split.values())
        == c.received
    )
