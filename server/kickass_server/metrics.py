"""``GET /metrics``: the server's counters in the Prometheus text format.

Read when scraped, from what the server keeps anyway (the probe engine's
counters and gauges, its database writer's backlog) and from the database
(scheduled runs by item and outcome), so nothing is counted twice. Only
addresses in ``ApiConfig.metrics_from`` may read it (loopback by default: a
Prometheus on the same host, or the reverse proxy's allow-list); others get
a 404, as if it did not exist.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, current_app, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .http import ApiError

bp = Blueprint("metrics", __name__)

# What the probe engine's counters mean, for HELP lines (the rest are named well enough).
HELP = {
    "probes_sent": "Probe datagrams sent (whole and split)",
    "admission_denied": "Sessions refused by the abuse limits (per address, prefix, global)",
    "paced": "Probes held back by the pacing token buckets",
    "malformed": "Datagrams that did not parse",
    "bad_cookie": "Datagrams with a wrong session cookie",
    "packets_sent": "Raw packets written to the socket",
    "bytes_sent": "Bytes written to the raw socket",
    "send_errors": "Raw socket send errors",
}
GAUGES = ("sessions_live", "sessions_probing", "sessions_remembered", "db_write_backlog")


class ServerCollector(Collector):
    def __init__(self, services: Any) -> None:
        self.services = services

    def collect(self) -> Iterator[Metric]:
        stats = self.services.engine.stats()
        for name, value in sorted(stats.get("counters", {}).items()):
            fam = CounterMetricFamily(
                f"kickass_server_{name}", HELP.get(name, f"Probe engine counter {name}")
            )
            fam.add_metric([], float(value))
            yield fam
        for name in GAUGES:
            if name in stats:
                g = GaugeMetricFamily(f"kickass_server_{name}", f"Probe engine: {name}")
                g.add_metric([], float(stats[name]))
                yield g
        for name in ("db_write_failures", "db_writes_dropped"):
            if name in stats:
                c = CounterMetricFamily(f"kickass_server_{name}", f"Database writer: {name}")
                c.add_metric([], float(stats[name]))
                yield c
        schedule = self.services.schedule
        if schedule is not None:
            runs = GaugeMetricFamily(
                "kickass_schedule_item_runs",
                "Scheduled runs recorded in item_runs, by item, kind and outcome",
                labels=["item", "kind", "outcome"],
            )
            try:
                for r in schedule.outcome_counts(None):
                    runs.add_metric([r["item"], r["kind"], r["outcome"]], float(r["runs"]))
            except Exception:  # noqa: BLE001 - a scrape during a database outage still answers
                pass
            yield runs


def allowed(remote: str | None, networks: tuple[str, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in ipaddress.ip_network(n, strict=False) for n in networks)


@bp.get("/metrics")
def metrics() -> Response:
    svc = current_app.extensions["kickass"]
    if not allowed(request.remote_addr, svc.config.metrics_from):
        raise ApiError(404, "not-found", "not found")
    registry = current_app.extensions.get("kickass.metrics")
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServerCollector(svc))
        current_app.extensions["kickass.metrics"] = registry
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
