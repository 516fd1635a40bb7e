"""The schedule file and the crontab, on simulated time (no database, no processes
beyond ``systemd-analyze``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kickass_core.errors import KickassError
from kickass_operations import crontab as cron
from kickass_operations.items import round_seed
from kickass_operations.schedule_file import MAX_FILE_BYTES, STALE_FACTOR, Item, load, parse

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)


def item(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "refresh", "kind": "refresh", "cron": "*/15 * * * *"}
    d.update(over)
    return d


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"item": [item(cron="61 * * * *")]}, "item 'refresh': cron"),
        ({"item": [item(cron="* * * *")]}, "not a cron expression with 5 fields"),
        ({"item": [item(kind="Mining!")]}, "item 'refresh': kind"),
        ({"item": [item(kind="atlas")]}, "needs 'campaign'"),
        ({"item": [item(kind="export", directory="x")]}, "needs 'views'"),
        ({"item": [item(), item()]}, "item names must be unique"),
        ({"item": [item(colour="red")]}, "colour"),
        ({"item": [item(name="../etc")]}, "item '../etc': name"),
        ({"schedule": {"stale_s": 23, "heartbeat_s": 6}}, "must be at least 4 heartbeats"),
        ({"item": [item(host=[])]}, "item 'refresh': host"),
        ({"item": [item(host=["edge-1", "edge-1"])]}, "distinct host names"),
        ({"item": [item(host=["edge-1", "../x"])]}, "not a host name: '../x'"),
        ({"item": [item(host=[f"h{i}" for i in range(65)])]}, "1 to 64 host names"),
        ({"item": [item(slip_s=-1)]}, "slip_s"),
        ({"item": [item(slip_s=900)]}, "must be shorter than the time between due times (900 s)"),
        ({"item": [item(timeout_s="1h")]}, "timeout_s"),
    ],
)
def test_bad_schedules_are_refused_naming_the_item_and_field(
    data: dict[str, Any], says: str
) -> None:
    with pytest.raises(KickassError) as exc:
        parse(data, "s.toml")
    assert says in exc.value.message and exc.value.message.startswith("s.toml: ")
    assert exc.value.hint and "example-schedule.toml" in exc.value.hint


def test_a_file_that_is_not_toml_or_not_there_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KickassError, match="no schedule file"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[schedule\nname = 1")
    with pytest.raises(KickassError, match="is not TOML"):
        load(bad)


def test_a_schedule_file_is_at_most_max_file_bytes(tmp_path: Path) -> None:
    """The limit's edges: exactly MAX_FILE_BYTES is read, one byte more is
    refused (a 10 MB file was accepted before), with the size in the error."""
    body = (
        '[schedule]\nname = "big"\n\n[[item]]\nname = "r"\nkind = "refresh"\ncron = "* * * * *"\n'
    )
    at_limit = tmp_path / "at-limit.toml"
    padding = MAX_FILE_BYTES - len(body) - 1
    at_limit.write_bytes(body.encode() + b"#" + b"x" * (padding - 1) + b"\n")
    assert at_limit.stat().st_size == MAX_FILE_BYTES
    schedule, _ = load(at_limit)
    assert [i.name for i in schedule.item] == ["r"]
    over = tmp_path / "over.toml"
    over.write_bytes(at_limit.read_bytes() + b"\n")
    with pytest.raises(KickassError, match=f"larger than {MAX_FILE_BYTES:,} bytes") as exc:
        load(over)
    assert exc.value.hint
    ten_mb = tmp_path / "ten-mb.toml"
    ten_mb.write_bytes(body.encode() + b"#" + b"x" * 10_000_000 + b"\n")
    with pytest.raises(KickassError, match="larger than"):
        load(ten_mb)


def test_a_schedule_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    """One Latin-1 byte in a comment was a UnicodeDecodeError traceback."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[schedule]\nname = "x"\n# caf\xe9 on the corner\n')
    with pytest.raises(KickassError) as exc:
        load(bad)
    assert exc.value.message == f"{bad} is not UTF-8: byte 0xe9 at line 3, column 6"
    assert exc.value.hint and "UTF-8" in exc.value.hint
    folder = tmp_path / "a-folder.toml"
    folder.mkdir()
    with pytest.raises(KickassError, match="cannot read the schedule file"):
        load(folder)


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (b"# caf\xe9\n", "is not UTF-8: byte 0xe9 at line 3, column 6"),
        (b"#" + b"x" * MAX_FILE_BYTES + b"\n", "larger than"),
    ],
)
def test_schedule_check_says_what_is_wrong_without_a_traceback(
    tmp_path: Path, extra: bytes, error: str
) -> None:
    path = tmp_path / "s.toml"
    path.write_bytes(b'[schedule]\nname = "x"\n' + extra)
    kickass = Path(sys.executable).with_name("kickass")
    proc = subprocess.run(
        [str(kickass), "schedule", "check", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("ERROR: ") and error in proc.stderr, proc.stderr


def test_owners_cron_times_and_the_stale_limit() -> None:
    one = Item.model_validate({"name": "a", "kind": "trials", "cron": "40 */3 * * *",
                               "trials": {}, "host": "edge-1"})  # fmt: skip
    many = one.model_copy(update={"host": ["edge-1", "edge-2"]})
    anyone = one.model_copy(update={"host": None})
    assert one.owners == ("edge-1",) and many.owners == ("edge-1", "edge-2")
    assert one.may_run("edge-1") and not one.may_run("edge-2") and many.may_run("edge-2")
    assert anyone.owners is None and anyone.may_run("whoever")
    due = datetime(2026, 11, 25, 3, 40, tzinfo=UTC)
    assert one.on_cron(due) and one.on_cron(due + timedelta(hours=3))
    for off in (
        timedelta(minutes=1),
        timedelta(hours=1),
        timedelta(seconds=1),
        timedelta(microseconds=1),
        timedelta(days=365 * 73) + timedelta(minutes=7),
    ):
        assert not one.on_cron(due + off), off  # fmt: skip
    settings = parse({"schedule": {"heartbeat_s": 5}}).schedule
    assert settings.stale_after_s == 5 * STALE_FACTOR
    assert parse({"schedule": {"heartbeat_s": 5, "stale_s": 60}}).schedule.stale_after_s == 60


def test_the_example_schedule_is_valid() -> None:
    schedule, base = load(REPO / "operations" / "example-schedule.toml")
    assert {i.kind for i in schedule.item} == {"atlas", "trials", "refresh", "export",
                                               "housekeeping"}  # fmt: skip
    assert base == REPO / "operations"


PERIODS = {"*/5 * * * *": 300, "17 * * * *": 3600, "0 3 * * *": 86400, "40 */3 * * 1-5": 10800}


@settings(max_examples=200, deadline=None)
@given(
    minutes=st.integers(0, 60 * 24 * 60),
    fraction=st.floats(0, 0.999),
    cron_expr=st.sampled_from(sorted(PERIODS)),
)
def test_due_times_and_slips_on_simulated_time(
    minutes: int, fraction: float, cron_expr: str
) -> None:
    slip = fraction * PERIODS[cron_expr]
    it = Item.model_validate(
        {"name": "x", "kind": "refresh", "cron": cron_expr, "slip_s": slip}, strict=False
    )
    now = T0 + timedelta(minutes=minutes, seconds=7)
    due = it.due_now(now)
    assert due is not None  # every expression fires within three of its periods
    # The slip is the same for a due time on every host, inside [0, slip_s).
    s = it.slip(due)
    assert s == it.slip(due) and timedelta(0) <= s <= timedelta(seconds=slip)
    # The due time run now has started; no later due time has.
    assert due + s <= now
    nxt = it.next_start(now)
    assert nxt > now
    later = [d for d in it.previous_dues(nxt + timedelta(seconds=1), 3) if d > due]
    assert all(d + it.slip(d) > now for d in later)


def test_slips_spread_due_times_and_seeds_differ_per_round() -> None:
    it = Item.model_validate({"name": "a", "kind": "refresh", "cron": "0 * * * *",
                              "slip_s": 900.0})  # fmt: skip
    dues = [T0 + timedelta(hours=h) for h in range(200)]
    slips = [it.slip(d).total_seconds() for d in dues]
    assert len(set(slips)) == len(slips) and 350 < sum(slips) / len(slips) < 550
    assert len({round_seed("a", d) for d in dues}) == len(dues)
    assert round_seed("a", T0) == round_seed("a", T0) != round_seed("b", T0)


def test_cron_line_and_its_block_in_an_existing_crontab(tmp_path: Path) -> None:
    schedule = tmp_path / "my schedule.toml"
    schedule.write_text("")
    cmd = cron.command(
        schedule, log_file=tmp_path / "log", config=tmp_path / "kickass.toml",
        kickass=Path("/opt/kickass/bin/kickass"),
    )  # fmt: skip
    assert cmd.startswith(f"KICKASS_CONFIG={tmp_path}/kickass.toml /opt/kickass/bin/kickass ")
    assert f"'{tmp_path}/my schedule.toml'" in cmd  # quoted for /bin/sh
    lines = cron.cron_lines("wide-area", cmd + " --x=5%")
    assert lines[1].startswith("* * * * * ") and lines[1].endswith(r"--x=5\%")
    existing = "MAILTO=ops@example.org\n0 1 * * * backup\n"
    once = cron.merged(existing, "wide-area", lines)
    twice = cron.merged(once, "wide-area", lines)
    assert once == twice  # installing again replaces its own block
    assert once.startswith(existing) and once.count("* * * * * ") == 1
    other = cron.merged(once, "other", cron.cron_lines("other", "/bin/true"))
    assert other.count("BEGIN kickass schedule") == 2
    assert cron.merged(other, "wide-area", []).count("BEGIN") == 1  # removal keeps the rest


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_systemd_units_verify(tmp_path: Path) -> None:
    cmd = cron.command(tmp_path / "s.toml", log_file=None, config=None,
                       kickass=Path("/usr/bin/true"))  # fmt: skip
    units = cron.systemd_units("wide-area", cmd, working_dir=tmp_path)
    paths = cron.install_units(units, tmp_path / "units")
    assert sorted(p.name for p in paths) == [
        "kickass-schedule-wide-area.service", "kickass-schedule-wide-area.timer",
    ]  # fmt: skip
    proc = subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Without systemd as PID 1 it may still note that it cannot reach the
    # manager; what it must not find is anything wrong with the units.
    complaints = [
        line for line in proc.stderr.splitlines()
        if "kickass-schedule" in line or "Unknown" in line or "Failed to parse" in line
    ]  # fmt: skip
    assert proc.returncode == 0 and not complaints, proc.stderr
