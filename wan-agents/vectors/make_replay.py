"""The flow lists the transport's simulated-time replay runs (ka-transport/tests/replay.rs).

    .venv/bin/python wan-agents/vectors/make_replay.py

Each file holds exactly the flows a trial draws (``kickass_wan.trials.workload.pair_flows``)
for the bench's scenarios (bench/trials_bench.py): per pair and sender, each flow's
start offset (open loop) or off time (closed loop) and its size. The replay pushes
them through the real router core (ka-core) and the real transport (ka-transport)
on simulated time, so a regression in either shows in seconds, not in a two-hour
bench. Regenerate after changing the workload; the test checks the files' sums.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kickass_wan.trials.workload import APP_BYTES_PER_PACKET, Workload, pair_flows

HERE = Path(__file__).resolve().parent / "replay"

# bench/trials_bench.py's scenarios: 8 senders, 100 ms. Heavy: 10 Mbit/s, 1 MB mean,
# 8 s mean gap, 90 s periods, open loop (today's bench) and closed loop (the
# paper's senders); light: 100 Mbit/s, ~100 packets mean, 0.5 s, 40 s periods.
HEAVY = dict(senders=8, pairs=4, period_s=90.0, capacity_bps=10e6, rtt_ms=100.0)
HEAVY_LOAD = Workload(mean_packets=694.0, mean_gap_s=8.0, seed=13)
SCENARIOS = {
    "heavy_open_seed13": dict(workload=HEAVY_LOAD, **HEAVY),
    "heavy_closed_seed13": dict(workload=replace(HEAVY_LOAD, loop="closed"), **HEAVY),
    "light_open_seed11": dict(
        workload=Workload(mean_gap_s=0.5, seed=11),
        senders=8,
        pairs=4,
        period_s=40.0,
        capacity_bps=100e6,
        rtt_ms=100.0,
    ),
}


def scenario(name: str, spec: dict) -> dict:
    w: Workload = spec["workload"]
    pairs = []
    for pair in range(spec["pairs"]):
        senders = []
        for s in range(spec["senders"]):
            senders.append(
                [
                    {
                        "start_s": round(f.start_s, 6),
                        "size_bytes": f.size_packets * APP_BYTES_PER_PACKET,
                    }
                    | ({} if f.off_s is None else {"off_s": round(f.off_s, 6)})
                    for f in pair_flows(w, pair, spec["period_s"], sender_index=s)
                ]
            )
        pairs.append(senders)
    return {
        "version": 1,
        "metadata": {
            "scenario": name,
            "workload": w.to_json(),
            "loop": w.loop,
            "generator": "wan-agents/vectors/make_replay.py",
        },
        "capacity_bps": spec["capacity_bps"],
        "rtt_ms": spec["rtt_ms"],
        "period_s": spec["period_s"],
        "pairs": pairs,
    }


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, spec in SCENARIOS.items():
        doc = scenario(name, spec)
        (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        n = sum(len(s) for p in doc["pairs"] for s in p)
        print(f"{name}: {n} flows")


if __name__ == "__main__":
    main()
