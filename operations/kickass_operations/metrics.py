"""Prometheus metrics of scheduled work (prometheus_client, text format).

Read when scraped (``schedule run --loop --metrics-port``) or written once
per run for node_exporter's textfile collector (``--metrics-file``). Where
the database is at hand the figures are the database's (every host's runs,
and every host's refused claims); a trial runner host reports its own runs
and its upload backlog (records still spooled for the server). Item labels
come from the schedule's items only (``run_families``, which the server's
``/metrics`` shares): a name nobody scheduled adds no series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .schedule_file import Schedule


class ScheduleCollector(Collector):
    def __init__(self, schedule: Schedule, base_dir: Path, store: Any | None) -> None:
        self.schedule = schedule
        self.base_dir = base_dir
        self.store = store
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._backlog()
            if self.store is not None:
                yield from self._from_database()

    def _backlog(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "kickass_schedule_upload_backlog_records",
            "Trial records spooled on this host and not yet accepted by the server",
            labels=["item"],
        )
        for item in self.schedule.item:
            if item.kind != "trials" or not item.trials:
                continue
            spool_dir = item.trials.get("spool_dir", ".kickass/spool")
            path = Path(spool_dir)
            path = path if path.is_absolute() else self.base_dir / path
            fam.add_metric([item.name], float(_spooled(path)))
        yield fam

    def _from_database(self) -> Iterator[Metric]:
        from .status import collect

        assert self.store is not None
        yield from run_families(self.store, [i.name for i in self.schedule.item])
        st = collect(self.schedule, self.store)
        overdue = GaugeMetricFamily(
            "kickass_schedule_item_overdue",
            "1 if the item's latest due time has no live run after its grace time",
            labels=["item"],
        )
        for i in st.items:
            overdue.add_metric([i.name], 1.0 if i.overdue else 0.0)
        credits = GaugeMetricFamily(
            "kickass_schedule_atlas_credits_today",
            "RIPE Atlas credits spent today (UTC) by the schedule's atlas items",
        )
        credits.add_metric([], float(st.atlas_credits_today))
        yield from (overdue, credits)


def run_families(store: Any, names: Sequence[str]) -> list[Metric]:
    """Runs by item, kind and outcome, the newest finish of each, and the
    claims refused by host, item and reason, from ``store`` (a
    ``kickass_db.schedule_store.ScheduleStore``), for the items ``names``
    only: item labels come from a schedule, never from what a claimer sent
    (a refusal of a name the schedule does not have is labelled item="")."""
    runs = GaugeMetricFamily(
        "kickass_schedule_item_runs",
        "Runs recorded in item_runs, by item, kind and outcome (every host's)",
        labels=["item", "kind", "outcome"],
    )
    last = GaugeMetricFamily(
        "kickass_schedule_item_last_finished_timestamp_seconds",
        "When the newest run of each outcome finished",
        labels=["item", "outcome"],
    )
    for r in store.outcome_counts(list(names)):
        runs.add_metric([r["item"], r["kind"], r["outcome"]], float(r["runs"]))
        if r["last_finished"] is not None:
            last.add_metric([r["item"], r["outcome"]], r["last_finished"].timestamp())
    refused = CounterMetricFamily(
        "kickass_schedule_claims_refused",
        "Claims of scheduled runs the schedule did not allow (nothing stored), by claiming "
        "host, item (empty: not in the schedule) and reason",
        labels=["host", "item", "reason"],
    )
    for r in store.refusals(list(names)):
        refused.add_metric([r["host"], r["item"], r["reason"]], float(r["refusals"]))
    return [runs, last, refused]


def _spooled(path: Path) -> int:
    if not path.is_dir():
        return 0
    try:
        from kickass_wan.trials.spool import Spool
    except ImportError:
        return 0
    return Spool(path).count()


class Metrics:
    """This process's counters plus the collector above, in one registry."""

    def __init__(self, schedule: Schedule, base_dir: Path, store: Any | None) -> None:
        self.registry = CollectorRegistry()
        self.runs = Counter(
            "kickass_schedule_runs",
            "Item runs this process carried out, by item and outcome",
            ["item", "outcome"],
            registry=self.registry,
        )
        self.registry.register(ScheduleCollector(schedule, base_dir, store))

    def record(self, ran: list[dict[str, Any]]) -> None:
        for r in ran:
            self.runs.labels(r["item"], r["outcome"]).inc()

    def write(self, path: Path) -> None:
        write_to_textfile(str(path), self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
