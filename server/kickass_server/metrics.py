"""``GET /metrics``: the server's counters in the Prometheus text format.

Read when scraped, from what the server keeps anyway (the probe engine's
counters and gauges, its database writer's backlog) and from the database
(scheduled runs by item and outcome, refused claims: the schedule's own
``run_families``, labelled only by the items of the server's schedule file),
so nothing is counted twice. Only
addresses in ``ApiConfig.metrics_from`` may read it (loopback by default: a
Prometheus on the same host, or the reverse proxy's allow-list); others get
a 404, as if it did not exist.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, Flask, Response, current_app, request
from kickass_operations.metrics import run_families
from kickass_operations.schedule_file import Schedule
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .http import ApiError
from .schedule_api import server_schedule

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
    def __init__(self, services: Any, schedule: Callable[[], Schedule | None]) -> None:
        self.services = services
        self.schedule = schedule

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
        store = self.services.schedule
        if store is not None:
            # Labels from the schedule file's items, never from item_runs
            # (no schedule: none), so no claimer can add a series.
            schedule = self.schedule()
            names = [] if schedule is None else [i.name for i in schedule.item]
            try:
                families = run_families(store, names)
            except Exception:  # noqa: BLE001 - a scrape during a database outage still answers
                families = []
            yield from families


def _schedule_reader(app: Flask) -> Callable[[], Schedule | None]:
    """The server's schedule as it is at each scrape (the collector runs
    outside the request's app context)."""

    def read() -> Schedule | None:
        with app.app_context():
            return server_schedule()

    return read


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
        registry.register(ServerCollector(svc, _schedule_reader(current_app)))
        current_app.extensions["kickass.metrics"] = registry
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
