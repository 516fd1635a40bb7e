"""The schedule file and the crontab, on simulated time (no database, no processes
beyond ``systemd-analyze``)."""

from __future__ import annotations

import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kickass_core.errors import KickassError
from kickass_operations import crontab as cron
from kickass_operations.items import round_seed
from kickass_operations.schedule_file import Item, load, parse

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
        ({"item": [item(kind="mining")]}, "item 'refresh': kind"),
        ({"item": [item(kind="atlas")]}, "needs 'campaign'"),
        ({"item": [item(kind="export", directory="x")]}, "needs 'views'"),
        ({"item": [item(), item()]}, "item names must be unique"),
        ({"item": [item(colour="red")]}, "colour"),
        ({"item": [item(name="../etc")]}, "item '../etc': name"),
        ({"schedule": {"stale_s": 10, "heartbeat_s": 6}}, "heartbeat_s must be at most half"),
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
