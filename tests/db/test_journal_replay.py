"""A journal with malformed lines, replayed at a server's start as servercli
does (``journal.replay(dir, study_events.from_json, apply)``): good records
are applied, a record that is not a study event is set aside in
``failed-<file>`` with a reason naming its field, a line that is not a
journal entry is logged and skipped, and nothing raises."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from kickass_core import study_events
from kickass_core.study_events import Heartbeat, RunFinished
from kickass_db import journal


def test_malformed_lines_are_set_aside_or_logged_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good: list[study_events.StudyEvent] = [
        Heartbeat("s", 10, 9),
        RunFinished("s", "complete", "tolerant", "all arrived", None),
    ]
    lines: list[Any] = [
        {"seq": 1, "record": study_events.to_json(good[0])},
        {"seq": 2, "record": {"type": "heartbeat", "session_id": "s", "sent": "x", "acked": 1}},
        {"seq": 3, "record": {"type": "nope", "session_id": "s"}},
        {"seq": 4, "record": [1, 2]},
        {"seq": 5, "record": study_events.to_json(Heartbeat("s", 1, 1))},
        {"done": 5},
        5,
        {"seq": "6", "record": {}},
        {"seq": 7, "record": study_events.to_json(good[1])},
    ]
    path = tmp_path / "journal-1-1.ndjson"
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"seq": 8, "rec'  # cut by a crash
    path.write_text(text)

    applied: list[Any] = []
    caplog.set_level(logging.WARNING, logger="kickass.db.journal")
    counts = journal.replay(tmp_path, study_events.from_json, applied.append)

    assert applied == good
    assert counts == {"files": 1, "replayed": 2, "failed": 3}
    assert not path.exists()
    failed = [json.loads(x) for x in (tmp_path / f"failed-{path.name}").read_text().splitlines()]
    assert [f["record"] for f in failed] == [lines[1]["record"], lines[2]["record"], [1, 2]]
    reasons = [f["reason"] for f in failed]
    assert "'heartbeat': sent must be an integer, got 'x'" in reasons[0]
    assert "unknown study event type 'nope'" in reasons[1]
    assert "not a study event: a list" in reasons[2]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3, skipped
    assert any("line 7: not a journal entry" in m for m in skipped)
    assert any("line 8: not a journal entry" in m for m in skipped)
    assert any("line 10: not JSON" in m for m in skipped)
