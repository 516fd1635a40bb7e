"""ka-linkem in real namespaces: the one-way delay, loss and rate are what
was configured (bounds stated per test). Topology (a spec built by
kickass_testbed.topology): a (198.18.3.1) -- lk (ka-linkem bridging la/lb at
layer 2) -- b (198.18.3.2); static ARP so a lossy link cannot eat the
neighbour resolution.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kickass_testbed.binaries import rust_binary
from kickass_testbed.edge import ka_linkem
from kickass_testbed.netns import Netns
from kickass_testbed.topology import End, Host, Link, Neighbor, Process, Topology, build

pytestmark = [
    pytest.mark.netns,
    # Python sender threads and sub-millisecond timing: alone on the machine.
    pytest.mark.quiet,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

A, B = "198.18.3.1", "198.18.3.2"
# Fixed (locally administered) MACs, so the static ARP entries are plain data.
MAC_A, MAC_B = "02:00:00:00:03:01", "02:00:00:00:03:02"


def emulated_path_spec(linkem: Process) -> Topology:
    return Topology(
        name="kr",
        hosts=(Host("a"), Host("lk"), Host("b")),
        links=(
            Link(End("a", "e0", (f"{A}/24",), mac=MAC_A), End("lk", "la", ipv6=False)),
            Link(End("lk", "lb", ipv6=False), End("b", "e0", (f"{B}/24",), mac=MAC_B)),
        ),
        neighbors=(Neighbor("a", "e0", B, MAC_B), Neighbor("b", "e0", A, MAC_A)),
        processes=(linkem,),
    )


@contextlib.contextmanager
def emulated_path(*linkem_args: str, stats: Path | None = None) -> Iterator[tuple[Netns, Netns]]:
    args = [*linkem_args] + (["--stats", str(stats)] if stats else [])
    with build(emulated_path_spec(ka_linkem(*args))) as net:
        try:
            yield net["a"], net["b"]
        finally:
            code, err = net.stop("ka-linkem")
            assert code == 0, err


def blast(a: Netns, b: Netns, *send_args: str, recv_s: float = 10) -> dict:
    """ka-blast from a to b; returns the receiver's JSON report."""
    exe = str(rust_binary("ka-blast"))
    rx = b.popen(
        [exe, "recv", "--bind", f"{B}:7000", "--duration", f"{recv_s}s", "--idle", "1s"],
        stdout=subprocess.PIPE,
    )
    time.sleep(0.2)
    a.run([exe, "send", "--dst", f"{B}:7000", *send_args], timeout=60)
    out, _ = rx.communicate(timeout=recv_s + 10)
    return json.loads(out)


def _steal_ticks() -> int:
    """CPU time the hypervisor took from this VM so far (/proc/stat, in ticks)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def test_delay_is_accurate_with_sub_ms_jitter(tmp_path: Path) -> None:
    """20 ms one-way delay at low load (200 pps), measured with CLOCK_MONOTONIC
    timestamps from sender to receiver (same clock in every namespace), against
    the same path with no delay in the same test (this VM's own scheduling
    noise shows up in both): no packet is early, the median is at most 0.3 ms
    above 20 ms plus the no-delay median, p90 is within 0.5 ms of the
    median. The tail is judged by the emulator's own release error (its
    stats, paired frame by frame): under 1 ms for 99% of frames, 100 us mean.
    End to end, the p99 only has to stay within 5 ms: the two runs are not
    paired, and on this 2-vCPU VM a scheduling hiccup in the sender or
    receiver during one of them moved the end-to-end p99 by ~1.8 ms while the
    emulator's own lateness stayed within bounds."""
    with emulated_path("--delay", "0") as (a, b):
        base = blast(a, b, "--payload", "64", "--pps", "200", "--duration", "3s")["latency_us"]
    stolen = _steal_ticks()
    with emulated_path("--delay", "20ms", stats=tmp_path / "lk.ndjson") as (a, b):
        r = blast(a, b, "--payload", "64", "--pps", "200", "--duration", "3s")
    stolen = _steal_ticks() - stolen
    lat = r["latency_us"]
    print(f"one-way latency us: base {base} delayed {lat}")
    assert r["received"] >= 590 and r["missing"] == 0 and r["reordered"] == 0
    assert lat["min"] >= 20_000
    assert lat["p50"] - 20_000 <= base["p50"] + 300, (base, lat)
    own = json.loads((tmp_path / "lk.ndjson").read_text().splitlines()[-1])["ab"]
    print(f"emulator release lateness: max {own['late_max_ns'] / 1e3:.0f} us")
    assert own["delivered"] >= 590, own
    # Over 99% of frames leave within 1 ms of due, on average within 100 us
    # (a rare VM hiccup may still delay one frame by a millisecond or two).
    # That needs the CPU: when the hypervisor took it from this VM during the
    # run (steal time in /proc/stat; seen here at 13+ ticks with 3-44 ms
    # releases, for old and new binaries alike), no userspace emulator can
    # keep the bound, and the test says so instead of judging the emulator.
    print(f"steal during the delayed run: {stolen} ticks")
    if stolen <= 5:
        assert lat["p90"] - lat["p50"] < 500, lat
        assert own["late_over_1ms"] <= own["delivered"] // 100, own
        assert own["late_total_ns"] / own["delivered"] < 100_000, own
        assert lat["p99"] - 20_000 <= max(base["p99"], 0) + 5_000, (base, lat)
    else:
        assert own["late_over_1ms"] <= own["delivered"] // 10, (stolen, own)


def test_asymmetric_delay() -> None:
    with emulated_path("--delay-ab", "5ms", "--delay-ba", "30ms") as (a, b):
        fwd = blast(a, b, "--payload", "64", "--pps", "100", "--duration", "1s")
        rtt = a.run(["ping", "-c", "5", "-i", "0.2", "-q", B]).stdout
    assert 5_000 <= fwd["latency_us"]["p50"] <= 5_500
    avg = float(rtt.rsplit("=", 1)[1].split("/")[1])
    assert 35.0 <= avg <= 36.5, rtt


def test_loss_rate_is_as_configured() -> None:
    """10% random loss on 4000 packets: the delivered fraction is 0.90 +-
    0.025 (about 5 standard deviations of a binomial)."""
    with emulated_path("--loss", "0.1", "--seed", "7") as (a, b):
        r = blast(a, b, "--payload", "64", "--pps", "2000", "--count", "4000", "--duration", "10s")
    delivered = r["received"] / 4000
    print(f"delivered fraction {delivered}")
    assert abs(delivered - 0.90) < 0.025


def test_rate_limit_and_queue() -> None:
    """A 20 Mbit/s link offered 40 Mbit/s delivers 20 Mbit/s of frames
    (within 5%) and drops the excess at its queue."""
    with emulated_path("--rate", "20mbit", "--queue", "100p") as (a, b):
        r = blast(a, b, "--payload", "1472", "--pps", "3333", "--duration", "2s")
    # Frame bytes per datagram: 1472 UDP + 28 IP/UDP + 14 Ethernet.
    frame_bps = r["pps"] * 1514 * 8
    print(f"delivered {frame_bps / 1e6:.2f} Mbit/s of frames")
    assert abs(frame_bps / 20e6 - 1) < 0.05
    assert r["missing"] > 1000
