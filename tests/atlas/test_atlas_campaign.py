"""The campaign file: the example loads and plans, mistakes name their field,
and the plan and its credit cost follow the Atlas rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kickass_atlas.campaign import (
    Campaign,
    CampaignError,
    credits_per_result,
    sample_sizes,
    wire_ip_len,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "atlas/example-campaign.yaml"


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "t",
        "target": {"whole": "192.0.2.10", "split": "192.0.2.11"},
        "probes": {"count": 10, "country": "nl"},
        "duration": 3600,
        "credit_budget": 10**7,
    }
    d.update(over)
    return d


def test_the_example_campaign_loads_and_plans_within_its_budget() -> None:
    c = Campaign.load(EXAMPLE)
    plan = c.plan()
    plan.check_budget()
    assert [m.key for m in plan.measurements] == [
        "split-1500", "whole-60", "whole-780", "whole-1480", "whole-1500",
    ]  # fmt: skip
    assert len(c.splits) == 182 and c.splits[0] == 44 and c.splits[-1] == 1492
    assert c.probes.to_source() == {"type": "area", "value": "WW", "requested": 50}


def test_defaults_and_definitions() -> None:
    c = Campaign.from_dict(base())
    assert (c.packets, c.interval_s, c.packet_interval_ms, c.whole_sample) == (16, 240, 1000, 4)
    # 60: the smallest IP length a 64-bit probe sends (it pads to its 32-byte record).
    assert c.probes.value == "NL" and c.whole_sizes[0] == 60 and 1480 in c.whole_sizes
    split = c.plan().measurements[0]
    assert split.definition("study") == {
        "target": "192.0.2.11", "af": 4, "description": "study [split-1500]", "packets": 16,
        "size": 1472, "interval": 240, "packet_interval": 1000, "resolve_on_probe": False,
    }  # fmt: skip
    assert split.results_per_probe == 15 and split.credits == 16 * 10 * 15


def test_credit_rule_and_the_sample() -> None:
    assert credits_per_result(16, 1472) == 16 and credits_per_result(3, 1500) == 6
    # What the probe puts on the wire (the real evping: -s 0, 24, 31, 32 all
    # send 60 bytes; -s 5000 sends 4096).
    assert [wire_ip_len(s) for s in (0, 24, 31, 32, 33, 1472, 5000)] == [
        60, 60, 60, 60, 61, 1500, 4096,
    ]  # fmt: skip
    assert sample_sizes((52, 100, 500, 1000, 1480, 1500), 4) == (52, 500, 1480, 1500)
    assert sample_sizes((52, 100), 5) == (52, 100)
    ids = Campaign.from_dict(base(probes={"ids": [3, 1, 2]})).probes
    assert (ids.count, ids.to_source()) == (3, {"type": "probes", "value": "1,2,3", "requested": 3})


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"target": {"whole": "example.org", "split": "192.0.2.11"}}, "target.whole"),
        ({"target": {"whole": "2001:db8::1", "split": "192.0.2.11"}}, "target.whole"),
        ({"target": {"whole": "192.0.2.10", "split": "192.0.2.10"}}, "target"),
        ({"probes": {"count": 10, "country": "NL", "asn": 3333}}, "probes"),
        ({"probes": {"count": 10, "area": "Mars"}}, "probes.area"),
        ({"probes": {"ids": []}}, "probes.ids"),
        ({"whole": {"sizes": [44]}}, "whole.sizes"),
        ({"whole": {"sizes": [52]}}, "whole.sizes"),  # arrives as 60: the probe pads
        ({"whole": {"sizes": [1600]}}, "whole.sizes"),
        ({"whole": {"step": 12}}, "whole.step"),
        ({"split": {"leading": [45]}}, "split.leading"),
        ({"split": {"leading": [1500]}}, "split.leading"),
        ({"packets": 17}, "packets"),
        ({"interval": 30}, "interval"),
        ({"packet_interval": 10000, "interval": 60}, "packet_interval"),
        ({"packet_interval": 30001, "packets": 1, "interval": 600}, "packet_interval"),
        ({"probes": {"count": 1001, "area": "WW"}}, "probes.count"),
        ({"probes": {"ids": list(range(1, 1002))}}, "probes.ids"),
        ({"credit_budget": "lots"}, "credit_budget"),
        ({"responder": {"pps_global": 0}}, "responder.pps_global"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_mistakes_name_their_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(CampaignError) as err:
        Campaign.from_dict(base(**over), source="c.yaml")
    assert err.value.message.startswith(f"c.yaml: {field}:"), err.value.message
    assert err.value.hint


def test_a_shared_address_is_fine_without_1500_in_the_whole_sizes() -> None:
    c = Campaign.from_dict(
        base(target={"whole": "192.0.2.10", "split": "192.0.2.10"}, whole={"sizes": [100, 1480]})
    )
    assert c.whole_target == c.split_target


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(CampaignError, match="not found"):
        Campaign.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(CampaignError, match="cannot read"):
        Campaign.load(bad)
