"""Migrations on a real PostgreSQL: they run both ways, they match the models,
and the analysis views compute what the paper's figures need."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kickass_db as db
import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from kickass_core import cli
from kickass_core.errors import KickassError
from kickass_core.plan import ProbePlan, expected_max_fragment
from kickass_core.study_events import (
    ClockAnchor,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_db.models import Base
from kickass_db.partitions import is_partition
from kickass_db.study_store import StudyStore
from sqlalchemy import CheckConstraint, Engine, inspect, text

REPO = Path(__file__).resolve().parents[2]
# The newest migration file, read from disk (not from Alembic, which is under test).
_VERSIONS = sorted(p.name.split("_", 1)[0] for p in (REPO / "db/migrations/versions").glob("0*.py"))
HEAD, PREVIOUS = _VERSIONS[-1], _VERSIONS[-2]
STUDY_TABLES = {"clients", "sessions", "probe_outcomes"}
ROUTER_TABLES = {"router_runs", "router_telemetry"}
TRIAL_TABLES = {"runners", "trials", "trial_periods", "flows"}
ATLAS_TABLES = {
    "atlas_campaigns", "atlas_measurements", "atlas_probes", "atlas_reply_log", "atlas_results",
    "atlas_outcomes", "atlas_verdicts",
}  # fmt: skip
SIGNING_TABLES = {"request_nonces"}  # 0008
PAIRED_TABLES = {"trial_speedups"}  # 0010
SCHEDULE_TABLES = {"item_runs"}  # 0011
REFUSAL_TABLES = {"claim_refusals"}  # 0017
QUARANTINE_TABLES = {"quarantine"}  # 0018
ROLLUP_TABLES = {"router_telemetry_1s", "router_telemetry_1m", "rollup_refreshes"}  # 0012
COUNT_TABLES = {  # 0020
    "unit_counts", "unit_count_changes", "unit_counts_daily", "unit_counts_total", "client_sizes",
}  # fmt: skip
EXPERIMENT_TABLES = {"experiment_runs", "experiment_rates"}  # 0021
EXPERIMENT_VIEWS = {"v_experiment_runs", "v_experiment_rates"}  # 0021
ARCHIVE_TABLES = {"archive_partitions", "archive_secrets"}  # 0023
LIVE_COUNT_TABLES = {"live_counts", "live_count_marks"}  # 0029
TABLES = (
    STUDY_TABLES
    | ROUTER_TABLES
    | TRIAL_TABLES
    | ATLAS_TABLES
    | SIGNING_TABLES
    | PAIRED_TABLES
    | SCHEDULE_TABLES
    | ROLLUP_TABLES
    | REFUSAL_TABLES
    | QUARANTINE_TABLES
    | COUNT_TABLES
    | EXPERIMENT_TABLES
    | ARCHIVE_TABLES
    | LIVE_COUNT_TABLES
)
# 0020: what the study views add to the rollups (not for readers: no v_ name).
COUNT_VIEWS = {"unit_counts_pending"}
# 0012: refreshed by kickass_analysis.rollups, read through the v_* views below
# (0020 replaced the study's three by the rollups of the durable counts).
MATVIEWS = {
    "mv_atlas_probe_drop", "mv_flow_summary", "mv_flow_hourly", "mv_report_fct_bins",
    "mv_report_ka_mode",  # 0014
}  # fmt: skip
# 0010 kept one name per view: the non-v_ aliases of 0005 exist only before it.
OLD_TRIAL_ALIASES = {"flow_results", "flow_summary"}
PAIRED_VIEWS = {"v_trial_periods", "v_trial_speedups"}  # 0010
SCHEDULE_VIEWS = {"v_item_runs"}  # 0011
ROLLUP_VIEWS = {
    "v_session_rollup", "v_verdicts_rollup", "v_drop_rollup", "v_flow_summary_rollup",
    "v_flow_hourly", "v_router_runs", "v_router_telemetry_1s", "v_router_telemetry_1m",
    "v_item_health", "v_atlas_campaigns", "v_rollup_status",
} | {"v_flow_count", "v_report_fct_bins", "v_report_ka_mode"}  # fmt: skip  # 0012, 0014
TRIAL_VIEWS = {"v_flow_results", "v_flow_summary"} | PAIRED_VIEWS
ATLAS_VIEWS = {
    "v_atlas_whole_drop", "v_atlas_split_drop", "v_size_drop_by_source",
    "v_split_drop_by_source", "v_verdicts_by_source", "v_atlas_measurements",
}  # fmt: skip
# The contract with dashboards and notebooks: names and order.
VIEW_COLUMNS = {
    "v_session_summary": [
        "session_id", "state", "verdict", "verdict_reason", "created_at", "finished_at",
        "client_version", "server_version", "source_address", "whole_sent", "whole_acked",
        "whole_drop_rate", "split_sent", "split_acked", "split_drop_rate",
        "split_to_whole_ratio",
        # 0007: invalid probes, the excess over the two-fragment bound, fragment
        # observations and the client's reassembly memory (db/README.md)
        "whole_reassembly_invalid", "split_reassembly_invalid", "split_excess_drop",
        "split_excess_low", "split_excess_high", "whole_fragmented_on_arrival",
        "split_largest_fragment_as_sent", "split_fragments_observed", "split_leading_as_sent",
        "split_leading_swapped", "reassembly_refused", "reassembly_max_memory",
        "reassembly_high_thresh",
    ],
    "v_whole_drop": [
        "session_id", "ip_len", "sent", "acked", "late", "drop_rate", "rtt_ms_median",
        "fragmented_on_arrival",
        "reassembly_invalid", "fragments_observed", "fragmented_observed",  # 0007
    ],
    "v_split_drop": [
        "session_id", "leading_ip_len", "sent", "acked", "late", "drop_rate", "frag_observed",
        "arrived_as_sent",
        # 0007
        "reassembly_invalid", "largest_fragment_as_sent", "fragments_observed",
        "leading_as_sent", "leading_swapped",
    ],
    "v_client_verdicts": [
        "client_id", "install_id", "last_address", "sessions", "latest_session_id",
        "latest_verdict", "latest_finished_at",
    ],
    "v_size_drop_all": [
        "ip_len", "sessions", "sent", "acked", "late", "drop_rate", "rtt_ms_median",
        "fragmented_on_arrival",
        "reassembly_invalid", "fragments_observed", "fragmented_observed",  # 0007
    ],
    "v_split_drop_all": [
        "leading_ip_len", "sessions", "sent", "acked", "late", "drop_rate", "frag_observed",
        "arrived_as_sent",
        # 0007
        "reassembly_invalid", "largest_fragment_as_sent", "fragments_observed",
        "leading_as_sent", "leading_swapped",
    ],
    "v_router_telemetry": [
        "run_id", "run_name", "router_mode", "capacity_bps", "recorded_at", "t",
        "advertised_rate_bps", "leading_fragment_len", "input_rate_bps", "output_rate_bps",
        "queue_bytes", "mode", "rtt_ms", "drops", "fragmented", "utilization",
        # 0004: the new names, added at the end (views add, never drop)
        "router_kind", "marking_mode",
    ],
    "v_flow_results": [
        "trial_id", "destination", "protocol", "congestion_control", "access_capacity_bps",
        "size_packets", "fct_ms", "ka_mode_fraction", "mode_switches", "retransmissions",
        "started_at", "flow_id", "period_index", "handshake", "size_bytes", "completed",
        "srtt_ms", "min_rtt_ms", "advertised_rate_last_bps", "error", "size_bucket",
        # 0010: the paired design
        "pair", "arm", "queued_ms", "negotiated_protocol", "ka_mode_ms",
        "advertised_rate_min_bps", "advertised_rate_max_bps", "advertised_rates_seen",
        "handicap_ms", "period_actual_start_s", "router_run_name", "flow_index",
    ],
    "v_flow_summary": [
        "destination", "access_capacity_bps", "protocol", "size_bucket", "flows", "completed",
        "fct_ms_mean", "fct_ms_p50", "fct_ms_p95", "ka_mode_fraction_mean", "speedup",
        "arm", "completion_rate",  # 0010
    ],
    "v_trial_periods": [
        "trial_id", "destination", "router_run_name", "trial_started_at", "period_index",
        "pair", "protocol", "arm", "congestion_control", "handshake", "handicap_ms",
        "start_offset_s", "duration_s", "actual_start_offset_s", "start_deviation_s",
        "period_started_at",
        # 0021: a Kick-Ass arm's TCP mode and TCP share, what the period
        # carried, the workload's loop
        "transport_cc", "tcp_share", "offered_load_bps", "workload_loop",
    ],
    "v_experiment_runs": [
        "run_id", "kind", "started_at", "capacity_bps", "rtt_ms", "router_run_name",
        "parameters", "figures", "created_at",
    ],
    "v_experiment_rates": [
        "run_id", "kind", "flow", "protocol", "t_s", "at", "rate_bps", "ka_mode",
    ],
    "v_item_runs": [
        "id", "item", "kind", "due_at", "host", "attempt", "claimed_at", "heartbeat_at",
        "finished_at", "outcome", "reason", "counts", "duration_s", "dead_attempts",
    ],
    "v_trial_speedups": [
        "scope", "key", "destination", "access_capacity_bps", "arm", "baseline_arm",
        "size_bucket", "pairs", "matched", "speedup", "speedup_low", "speedup_high",
        "completion_arm", "completion_baseline", "workload", "computed_at",
        "clusters",  # 0015
        "sooner", "sooner_low", "sooner_high", "sooner_pairs", "sooner_clusters",  # 0019
    ],
    # 0006: RIPE Atlas beside the volunteers (db/README.md, "RIPE Atlas")
    "v_atlas_whole_drop": [
        "campaign", "prb_id", "ip_len", "sent", "acked", "late", "drop_rate", "rtt_ms_median",
        "unanswered", "asn", "country_code",
    ],
    "v_atlas_split_drop": [
        "campaign", "prb_id", "leading_ip_len", "sent", "acked", "late", "drop_rate",
        "rtt_ms_median", "asn", "country_code",
    ],
    "v_size_drop_by_source": [
        "source", "ip_len", "sessions", "sent", "acked", "late", "drop_rate", "rtt_ms_median",
        "fragmented_on_arrival",
    ],
    "v_split_drop_by_source": [
        "source", "leading_ip_len", "sessions", "sent", "acked", "late", "drop_rate",
        "frag_observed", "arrived_as_sent",
        "largest_fragment_as_sent", "reassembly_invalid",  # 0007
    ],
    "v_verdicts_by_source": [
        "source", "session_id", "verdict", "verdict_reason", "finished_at", "whole_sent",
        "whole_acked", "whole_drop_rate", "split_sent", "split_acked", "split_drop_rate",
        "split_to_whole_ratio", "campaign", "prb_id", "asn", "country_code",
    ],
    "v_atlas_measurements": [
        "campaign", "msm_id", "phase", "target", "ip_len", "size", "packets", "interval_s",
        "probes_requested", "status_id", "status_name", "estimated_credits",
        "credits_per_result", "results_fetched", "credits_spent", "fetched_until",
        "last_fetch_at", "last_error", "created_at", "start_time", "stop_time",
        "results_late", "rechecked_until", "results_invalid",  # 0009
    ],
    # 0012: the dashboards' rollups (db/README.md, "Rollups"); the first two and
    # v_flow_summary_rollup keep the columns of the views they stand for.
    "v_session_rollup": [
        "session_id", "state", "verdict", "verdict_reason", "created_at", "finished_at",
        "client_version", "server_version", "source_address", "whole_sent", "whole_acked",
        "whole_drop_rate", "split_sent", "split_acked", "split_drop_rate",
        "split_to_whole_ratio", "whole_reassembly_invalid", "split_reassembly_invalid",
        "split_excess_drop", "split_excess_low", "split_excess_high",
        "whole_fragmented_on_arrival", "split_largest_fragment_as_sent",
        "split_fragments_observed", "split_leading_as_sent", "split_leading_swapped",
        "reassembly_refused", "reassembly_max_memory", "reassembly_high_thresh",
    ],
    "v_verdicts_rollup": [
        "source", "session_id", "verdict", "verdict_reason", "finished_at", "whole_sent",
        "whole_acked", "whole_drop_rate", "split_sent", "split_acked", "split_drop_rate",
        "split_to_whole_ratio", "campaign", "prb_id", "asn", "country_code",
    ],
    "v_drop_rollup": [
        "source", "day", "campaign", "country_code", "asn", "phase", "ip_len", "sessions",
        "sent", "acked", "late", "drop_rate", "reassembly_invalid", "frag_observed",
        "largest_fragment_as_sent", "fragments_observed", "fragmented_observed",
        "leading_as_sent", "leading_swapped", "unanswered", "rtt_ms_mean", "rtt_ms_sum",
        "rtt_ms_n",
    ],
    "v_flow_summary_rollup": [
        "destination", "access_capacity_bps", "protocol", "size_bucket", "flows", "completed",
        "fct_ms_mean", "fct_ms_p50", "fct_ms_p95", "ka_mode_fraction_mean", "speedup",
        "arm", "completion_rate",
    ],
    "v_flow_hourly": [
        "hour", "destination", "access_capacity_bps", "protocol", "arm", "size_bucket",
        "flows", "completed", "completion_rate", "fct_ms_mean", "ka_mode_fraction_mean",
        "fct_ms_sum", "ka_mode_fraction_sum", "ka_mode_fraction_n", "mode_switches",
        "retransmissions", "fell_back_to_tcp",
    ],
    "v_router_runs": [
        "run_id", "run_name", "label", "router_kind", "capacity_bps", "program_version",
        "started_at", "finished_at", "exit_reason",
    ],
    **{
        f"v_router_telemetry_{res}": [
            "run_id", "run_name", "label", "router_kind", "capacity_bps", "at", "samples",
            "advertised_rate_bps", "advertised_rate_min_bps", "advertised_rate_max_bps",
            "leading_fragment_len", "leading_fragment_len_min", "leading_fragment_len_max",
            "fragmenting_samples", "input_rate_bps", "output_rate_bps", "utilization",
            "queue_bytes", "queue_bytes_max", "ka_mode_share", "kickass_samples",
            "tcp_samples", "rtt_ms", "drops", "fragmented", "mode_switches",
        ]
        for res in ("1s", "1m")
    },
    "v_item_health": [
        "item", "kind", "runs", "ok_runs", "failed_runs", "running", "last_due_at",
        "last_outcome", "last_reason", "last_ok_at", "last_failure_at", "period_s",
        "since_ok_s", "overdue",
    ],
    "v_atlas_campaigns": [
        "campaign", "credit_budget", "created_at", "measurements", "measurements_running",
        "measurements_stopped", "measurements_failed", "estimated_credits", "credits_spent",
        "results_fetched", "last_fetch_at", "measurements_with_errors",
    ],
    "v_rollup_status": ["name", "refreshed_at", "rows", "seconds", "age_s"],
    "v_flow_count": ["flows"],
    "v_report_fct_bins": [
        "rn", "access_capacity_bps", "arm", "protocol", "size_bin", "size_bucket", "flows",
        "completed", "fct_ms_mean", "fct_ms_p50", "fct_ms_p95",
    ],
    "v_report_ka_mode": [
        "rn", "access_capacity_bps", "arm", "flows", "mean", "median", "share_of_time",
        "cdf_x", "cdf_y",
    ],
}  # fmt: skip


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    e = db.make_engine(database_url)
    yield e
    e.dispose()


def schema(url: str) -> tuple[set[str], set[str]]:
    """Tables (a partitioned one once, not each of its days) and views."""
    e = db.make_engine(url)
    try:
        insp = inspect(e)
        tables = {t for t in insp.get_table_names() if not is_partition(t)}
        return tables - {"alembic_version"}, set(insp.get_view_names())
    finally:
        e.dispose()


def matviews(url: str) -> set[str]:
    e = db.make_engine(url)
    try:
        return set(inspect(e).get_materialized_view_names())
    finally:
        e.dispose()


def kickass(*argv: str) -> int:
    return cli.main(list(argv))


def test_upgrade_downgrade_upgrade(empty_database_url: str) -> None:
    url = empty_database_url
    assert kickass("db", "upgrade", "--database-url", url) == 0
    assert schema(url) == (TABLES, set(VIEW_COLUMNS) | COUNT_VIEWS)
    assert matviews(url) == MATVIEWS
    # 0022 partitioned the raw tables: the same tables and views without it.
    assert kickass("db", "downgrade", "0021", "--database-url", url) == 0
    assert schema(url) == (
        TABLES - ARCHIVE_TABLES - LIVE_COUNT_TABLES,
        set(VIEW_COLUMNS) | COUNT_VIEWS,
    )
    assert kickass("db", "downgrade", "0019", "--database-url", url) == 0
    assert schema(url) == (
        TABLES - COUNT_TABLES - EXPERIMENT_TABLES - ARCHIVE_TABLES - LIVE_COUNT_TABLES,
        set(VIEW_COLUMNS) - EXPERIMENT_VIEWS,
    )
    assert matviews(url) == MATVIEWS | {"mv_session_summary", "mv_probe_daily", "mv_size_clients"}
    assert kickass("db", "downgrade", "0011", "--database-url", url) == 0
    views = set(VIEW_COLUMNS) - ROLLUP_VIEWS - EXPERIMENT_VIEWS
    assert schema(url) == (
        TABLES
        - ROLLUP_TABLES
        - REFUSAL_TABLES
        - QUARANTINE_TABLES
        - COUNT_TABLES
        - EXPERIMENT_TABLES
        - ARCHIVE_TABLES
        - LIVE_COUNT_TABLES,
        views,
    )
    assert matviews(url) == set()
    assert kickass("db", "downgrade", "0010", "--database-url", url) == 0
    assert schema(url) == (
        TABLES
        - ROLLUP_TABLES
        - REFUSAL_TABLES
        - QUARANTINE_TABLES
        - COUNT_TABLES
        - EXPERIMENT_TABLES
        - ARCHIVE_TABLES
        - LIVE_COUNT_TABLES
        - SCHEDULE_TABLES,
        views - SCHEDULE_VIEWS,
    )
    before_0010 = views - SCHEDULE_VIEWS - PAIRED_VIEWS | OLD_TRIAL_ALIASES
    newer = (
        PAIRED_TABLES
        | SCHEDULE_TABLES
        | ROLLUP_TABLES
        | REFUSAL_TABLES
        | QUARANTINE_TABLES
        | COUNT_TABLES
        | EXPERIMENT_TABLES
        | ARCHIVE_TABLES
        | LIVE_COUNT_TABLES
    )
    assert kickass("db", "downgrade", "0009", "--database-url", url) == 0
    assert schema(url) == (TABLES - newer, before_0010)
    assert kickass("db", "downgrade", "0007", "--database-url", url) == 0
    assert schema(url) == (TABLES - SIGNING_TABLES - newer, before_0010)
    assert kickass("db", "downgrade", "0005", "--database-url", url) == 0
    assert schema(url) == (
        TABLES - ATLAS_TABLES - SIGNING_TABLES - newer,
        before_0010 - ATLAS_VIEWS,
    )
    assert kickass("db", "downgrade", "0004", "--database-url", url) == 0
    assert schema(url) == (
        STUDY_TABLES | ROUTER_TABLES,
        views - TRIAL_VIEWS - ATLAS_VIEWS - SCHEDULE_VIEWS,
    )
    assert kickass("db", "downgrade", "0002", "--database-url", url) == 0
    assert schema(url) == (
        STUDY_TABLES,
        views - TRIAL_VIEWS - ATLAS_VIEWS - SCHEDULE_VIEWS - {"v_router_telemetry"},
    )
    assert kickass("db", "downgrade", "0001", "--database-url", url) == 0
    assert schema(url) == (STUDY_TABLES, set())
    assert kickass("db", "downgrade", "base", "--database-url", url) == 0
    assert schema(url) == (set(), set())
    assert kickass("db", "upgrade", "head", "--database-url", url) == 0
    assert schema(url) == (TABLES, set(VIEW_COLUMNS) | COUNT_VIEWS)
    assert matviews(url) == MATVIEWS


def test_cli_reports_revisions(empty_database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = empty_database_url
    kickass("db", "current", "--database-url", url)
    assert "no migrations applied" in capsys.readouterr().out
    kickass("db", "upgrade", "0001", "--database-url", url)
    assert capsys.readouterr().out.strip().endswith("base -> 0001")
    kickass("db", "current", "--database-url", url)
    assert f"0001 (head is {HEAD}" in capsys.readouterr().out
    kickass("db", "history")
    out = capsys.readouterr().out
    assert (
        f"{PREVIOUS} -> {HEAD} (head)" in out and "0001 -> 0002" in out and "<base> -> 0001" in out
    )


def test_bad_revision_is_an_operator_error(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kickass("db", "upgrade", "0999", "--database-url", database_url) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: ") and "0999" in err and "Traceback" not in err


def test_a_failed_migration_applies_nothing(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE sessions (x int)")  # in the way of 0001
    assert kickass("db", "upgrade", "--database-url", empty_database_url) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: migration failed:") and "sessions" in err
    assert "Traceback" not in err
    assert schema(empty_database_url) == ({"sessions"}, set())
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT to_regclass('alembic_version')").fetchone() == (None,)


def test_offline_sql_touches_nothing(
    empty_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kickass("db", "upgrade", "--sql", "--database-url", empty_database_url) == 0
    out = capsys.readouterr().out
    assert "CREATE TABLE probe_outcomes" in out and "CREATE VIEW v_session_summary" in out
    assert schema(empty_database_url) == (set(), set())


def test_migrations_found_beside_the_package() -> None:
    # The source tree's db/migrations, with no environment variable; the
    # wheel layout is checked in test_packaging.py.
    assert db.migrations_dir() == REPO / "db" / "migrations"
    assert db.head_revision() == HEAD


def test_migrations_missing_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kickass_db import migrations

    monkeypatch.setattr(migrations, "_CANDIDATES", (tmp_path / "migrations",))
    with pytest.raises(KickassError, match="migrations not found"):
        db.alembic_config()


def test_models_match_migrations(engine: Engine) -> None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                # The day partitions are made at run time (0022), not by the models.
                "include_name": lambda name, type_, _: (
                    not (type_ == "table" and is_partition(name))
                ),
            },
        )
        assert compare_metadata(ctx, Base.metadata) == []
        # autogenerate does not compare CHECK constraints: compare their names.
        insp = inspect(conn)
        for table in Base.metadata.sorted_tables:
            declared = {c.name for c in table.constraints if isinstance(c, CheckConstraint)}
            assert {c["name"] for c in insp.get_check_constraints(table.name)} == declared


def test_view_columns_are_the_documented_contract(engine: Engine) -> None:
    with engine.connect() as conn:
        for view, columns in VIEW_COLUMNS.items():
            got = conn.execute(
                text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = :v ORDER BY ordinal_position"
                ),
                {"v": view},
            ).scalars()
            assert list(got) == columns, view


def test_alembic_ini_works_for_developers(database_url: str) -> None:
    env = {**os.environ, db.ENV_DATABASE_URL: database_url}
    alembic = Path(sys.executable).with_name("alembic")
    out = subprocess.run(
        [str(alembic), "-c", str(REPO / "db" / "alembic.ini"), "current"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f"{HEAD} (head)" in out.stdout


# -- the views on seeded data ------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)
AT_T0 = ClockAnchor(T0.timestamp(), 0.0)  # the batches' monotonic clock reads 0 at T0
LEAD = 44  # leading fragment IP length of the seeded split


def seed_session(
    store: StudyStore, session_id: str, install_id: str | None = "volunteer-1"
) -> None:
    store.create_session(
        session_id=session_id,
        cookie_hash=b"\0" * 32,
        plan=ProbePlan.quick().to_json(),
        source_address="198.51.100.7",
        expires_at=T0 + timedelta(hours=1),
        server_version="0.1.0",
        client_version="0.1.0",
        install_id=install_id,
    )


def outcome(
    seq: int,
    phase: str,
    ip_len: int,
    result: str,
    rtt_ms: float = 20.0,
    observed_frag_size: int | None = None,
) -> OutcomeEntry:
    """Sent at T0; unless lost, acknowledged ``rtt_ms`` later."""
    acked = result != "lost"
    return OutcomeEntry(
        seq=seq,
        phase=phase,
        ip_len=ip_len,
        outcome=result,
        sent_at=0.0,
        acked_at=rtt_ms / 1000 if acked else None,
        ack_count=0,
        received_len=None,
        observed_frag_size=observed_frag_size,
    )


def record(store: StudyStore, session_id: str, entries: list[OutcomeEntry]) -> None:
    store.apply(OutcomeBatch(session_id, tuple(entries), AT_T0))


def seeded(store: StudyStore) -> None:
    """Session A (complete): whole 1500 sent 10, acked 7 (1 late, 2 lost);
    split leading 44 sent 10, acked 5 (3 arrived as sent, 1 re-fragmented by
    a NAT, 1 reassembled). Session B (probing) has one more outcome; session C
    (anonymous, complete) none."""
    seed_session(store, "aaaaaaaaaaaaaaaa")
    rows = [outcome(i, "whole", 1500, "acked", rtt_ms=float(10 + i)) for i in range(7)]
    rows[0] = rows[0]._replace(observed_frag_size=1400)  # a tunnel on the path fragmented it
    rows += [outcome(7, "whole", 1500, "late", rtt_ms=900.0)]
    rows += [outcome(i, "whole", 1500, "lost") for i in (8, 9)]
    frags = [expected_max_fragment(LEAD)] * 3 + [1500 - 8, 0]
    rows += [
        outcome(10 + i, "split", LEAD, "acked", observed_frag_size=f) for i, f in enumerate(frags)
    ]
    rows += [outcome(i, "split", LEAD, "lost") for i in range(15, 20)]
    record(store, "aaaaaaaaaaaaaaaa", rows)
    store.apply(RunFinished("aaaaaaaaaaaaaaaa", "complete", "inconclusive", "seeded", None))

    seed_session(store, "bbbbbbbbbbbbbbbb")
    store.apply(RunProbing("bbbbbbbbbbbbbbbb", "198.51.100.7", 40000, 30.0))
    record(store, "bbbbbbbbbbbbbbbb", [outcome(0, "whole", 1500, "lost")])

    seed_session(store, "cccccccccccccccc", install_id=None)
    store.apply(RunFinished("cccccccccccccccc", "ended", None, None, "client left"))


def rows(engine: Engine, sql: str) -> list[dict[str, object]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(text(sql)).mappings()]


def test_per_session_views(store: StudyStore, engine: Engine) -> None:
    seeded(store)
    whole = rows(engine, "SELECT * FROM v_whole_drop WHERE session_id = 'aaaaaaaaaaaaaaaa'")
    assert whole == [
        {
            "session_id": "aaaaaaaaaaaaaaaa",
            "ip_len": 1500,
            "sent": 10,
            "acked": 7,
            "late": 1,
            "drop_rate": pytest.approx(0.3),
            "rtt_ms_median": pytest.approx(13.0),  # of acked only: the late one is not in
            "fragmented_on_arrival": 1,
            # 0007: nothing invalid, nothing observed before reassembly
            "reassembly_invalid": 0,
            "fragments_observed": 0,
            "fragmented_observed": 0,
        }
    ]
    split = rows(engine, "SELECT * FROM v_split_drop WHERE session_id = 'aaaaaaaaaaaaaaaa'")
    assert split == [
        {
            "session_id": "aaaaaaaaaaaaaaaa",
            "leading_ip_len": LEAD,
            "sent": 10,
            "acked": 5,
            "late": 0,
            "drop_rate": pytest.approx(0.5),
            "frag_observed": 4,
            "arrived_as_sent": 3,
            # 0007: the same number under its honest name; nothing else seeded
            "reassembly_invalid": 0,
            "largest_fragment_as_sent": 3,
            "fragments_observed": 0,
            "leading_as_sent": 0,
            "leading_swapped": 0,
        }
    ]


def test_session_summary(store: StudyStore, engine: Engine) -> None:
    seeded(store)
    by_id = {
        r["session_id"]: r
        for r in rows(engine, "SELECT * FROM v_session_summary ORDER BY session_id")
    }
    a = by_id["aaaaaaaaaaaaaaaa"]
    assert (a["whole_sent"], a["whole_acked"], a["split_sent"], a["split_acked"]) == (10, 7, 10, 5)
    assert a["whole_drop_rate"] == pytest.approx(0.3)
    assert a["split_drop_rate"] == pytest.approx(0.5)
    assert a["split_to_whole_ratio"] == pytest.approx(0.5 / 0.3)
    assert (a["state"], a["verdict"], a["verdict_reason"]) == ("complete", "inconclusive", "seeded")
    assert a["source_address"] is not None and a["finished_at"] is not None
    b = by_id["bbbbbbbbbbbbbbbb"]
    assert (b["whole_drop_rate"], b["split_drop_rate"], b["split_to_whole_ratio"]) == (
        1.0,
        None,
        None,
    )
    c = by_id["cccccccccccccccc"]
    assert (c["whole_sent"], c["whole_drop_rate"], c["split_sent"]) == (0, None, 0)


def test_client_verdicts(store: StudyStore, engine: Engine) -> None:
    seeded(store)
    clients = rows(engine, "SELECT * FROM v_client_verdicts ORDER BY client_id")
    volunteer = [c for c in clients if c["install_id"] == "volunteer-1"]
    assert len(volunteer) == 1
    # B is still probing: the latest *finished* session is A.
    assert volunteer[0]["sessions"] == 2
    assert volunteer[0]["latest_session_id"] == "aaaaaaaaaaaaaaaa"
    assert volunteer[0]["latest_verdict"] == "inconclusive"
    anonymous = [c for c in clients if c["install_id"] is None]
    assert [(c["sessions"], c["latest_session_id"]) for c in anonymous] == [(1, "cccccccccccccccc")]


def test_pooled_views_count_finished_sessions_only(store: StudyStore, engine: Engine) -> None:
    seeded(store)
    seed_session(store, "dddddddddddddddd", install_id="volunteer-2")
    record(
        store,
        "dddddddddddddddd",
        [outcome(i, "whole", 1500, "acked", rtt_ms=50.0) for i in range(10)]
        + [outcome(10 + i, "split", LEAD, "acked") for i in range(10)],
    )
    store.apply(RunFinished("dddddddddddddddd", "complete", "fragments-ok", "seeded", None))
    whole = rows(engine, "SELECT * FROM v_size_drop_all")
    # A (10 sent, 7 acked) + D (10 sent, 10 acked); B is live and left out.
    assert [(r["ip_len"], r["sessions"], r["sent"], r["acked"], r["late"]) for r in whole] == [
        (1500, 2, 20, 17, 1)
    ]
    assert whole[0]["drop_rate"] == pytest.approx(0.15)
    split = rows(engine, "SELECT * FROM v_split_drop_all")
    assert [(r["leading_ip_len"], r["sessions"], r["sent"], r["acked"]) for r in split] == [
        (LEAD, 2, 20, 15)
    ]
    assert split[0]["drop_rate"] == pytest.approx(0.25)
    assert (split[0]["frag_observed"], split[0]["arrived_as_sent"]) == (4, 3)
