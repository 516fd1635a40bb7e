"""The edge router's test path as a spec, and its Rust programs as processes
(used by the router tests and bench/router_bench.py).

    snd (198.18.1.2) ── rtr (198.18.1.1 | 198.18.2.1) ── [lk] ── rcv (198.18.2.2)
          lan0          lan                  wan     la  lb     wan0

With ``linkem=True`` a link-emulator namespace bridges rtr's WAN side and
the receiver at layer 2 (one subnet on both sides of it; no IPv6 on its
ports, so only test traffic crosses the emulator). Addresses only in
198.18.0.0/15, inside the namespaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .binaries import rust_binary
from .topology import End, Host, Link, Process, Route, Topology

SND = "198.18.1.2"
RTR_LAN = "198.18.1.1"
RTR_WAN = "198.18.2.1"
RCV = "198.18.2.2"


def edge_path(*, linkem: bool = False, processes: tuple[Process, ...] = ()) -> Topology:
    wan: tuple[Link, ...]
    if linkem:
        wan = (
            Link(End("rtr", "wan", (f"{RTR_WAN}/24",)), End("lk", "la", ipv6=False)),
            Link(End("lk", "lb", ipv6=False), End("rcv", "wan0", (f"{RCV}/24",))),
        )
    else:
        wan = (Link(End("rtr", "wan", (f"{RTR_WAN}/24",)), End("rcv", "wan0", (f"{RCV}/24",))),)
    return Topology(
        name="kr",
        hosts=(Host("snd"), Host("rtr", router=True), Host("rcv"))
        + ((Host("lk"),) if linkem else ()),
        links=(Link(End("snd", "lan0", (f"{SND}/24",)), End("rtr", "lan", (f"{RTR_LAN}/24",))),)
        + wan,
        routes=(Route("snd", "default", via=RTR_LAN), Route("rcv", "default", via=RTR_WAN)),
        processes=processes,
    )


def ka_router(
    *args: str,
    lan: str = "lan",
    wan: str = "wan",
    telemetry: Path | None = None,
    datapath: str | None = None,
    **process: Any,
) -> Process:
    """ka-router in "rtr" between ``lan`` and ``wan`` (``datapath``: its
    ``--datapath``, "tun" or "packet"; None: its default); ``process`` overrides
    Process fields. With a ``telemetry`` file it is ready once the metadata
    line is out (written after its TUN, route and rule are in place) and its
    stderr is piped (Proc.stop returns it); without, telemetry goes to a
    stdout pipe for the caller to read."""
    argv = [str(rust_binary("ka-router")), "--lan", lan, "--wan", wan]
    if datapath is not None:
        argv += ["--datapath", datapath]
    fields: dict[str, Any] = {"name": "ka-router", "host": "rtr", "stderr": "pipe"}
    if telemetry is not None:
        argv += ["--telemetry", str(telemetry)]
        fields |= {
            "stdout": "inherit",
            "ready_file": telemetry,
            "ready_text": '"metadata"',
            "ready_timeout": 10.0,
        }
    else:
        fields["stdout"] = "pipe"
    return Process(argv=(*argv, *args), **(fields | process))


def ka_linkem(*args: str, a: str = "la", b: str = "lb", **process: Any) -> Process:
    """ka-linkem in "lk" bridging ``a`` and ``b``; it has no readiness signal,
    so it must merely survive its first 0.3 s (bad options, missing ports)."""
    fields: dict[str, Any] = {
        "name": "ka-linkem",
        "host": "lk",
        "stdout": "inherit",
        "stderr": "pipe",
        "settle": 0.3,
    }
    argv = (str(rust_binary("ka-linkem")), "--a", a, "--b", b, *args)
    return Process(argv=argv, **(fields | process))
