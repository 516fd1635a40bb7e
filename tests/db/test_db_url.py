"""Database URLs: precedence, the forms operators write, and clear errors."""

from __future__ import annotations

import kickass_db as db
import pytest
from kickass_core import cli
from kickass_core.errors import KickassError
from kickass_core.study_events import Heartbeat
from kickass_db.retry import DatabaseUnavailable
from kickass_db.study_store import StudyStore
from sqlalchemy import make_url

# Port 1 on loopback: nothing listens, so the connection is refused at once.
REFUSED_URL = "postgresql://kickass:hunter2@127.0.0.1:1/kickass"


def test_explicit_url_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(db.ENV_DATABASE_URL, "postgresql://env@/envdb")
    assert db.resolve_database_url("postgresql://flag@/flagdb") == "postgresql://flag@/flagdb"
    assert db.resolve_database_url(None) == "postgresql://env@/envdb"


def test_no_url_anywhere_is_an_operator_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(db.ENV_DATABASE_URL, raising=False)
    with pytest.raises(KickassError, match="no database URL") as err:
        db.resolve_database_url(None)
    assert err.value.hint and db.ENV_DATABASE_URL in err.value.hint


@pytest.mark.parametrize(
    ("given", "host", "database", "query"),
    [
        ("postgresql://u:p@db.example:5433/kickass", "db.example", "kickass", {}),
        ("postgres://u@db.example/kickass?sslmode=require", "db.example", "kickass",
         {"sslmode": "require"}),
        ("postgresql+psycopg://u@localhost/kickass", "localhost", "kickass", {}),
        ("postgresql://u@/kickass?host=/run/postgresql", None, "kickass",
         {"host": "/run/postgresql"}),
        ("postgresql://u@%2Frun%2Fpostgresql/kickass", None, "kickass",
         {"host": "/run/postgresql"}),
    ],
)  # fmt: skip
def test_urls_are_rewritten_for_psycopg3(
    given: str, host: str | None, database: str, query: dict[str, str]
) -> None:
    url = db.sqlalchemy_url(given)
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.database, dict(url.query)) == (host, database, query)


@pytest.mark.parametrize(
    "bad",
    ["sqlite:///kickass.db", "mysql://u@h/db", "postgresql+asyncpg://u@h/db", "not a url", ""],
)
def test_non_postgres_urls_are_refused(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(db.ENV_DATABASE_URL, raising=False)
    with pytest.raises(KickassError):
        StudyStore(bad)


def test_messages_never_show_the_password() -> None:
    assert "hunter2" not in db.describe_url(REFUSED_URL)
    assert db.describe_url("postgresql+psycopg://u@/d?host=/run/pg") == (
        "postgresql://u@/d?host=/run/pg"
    )


def test_unix_socket_url_forms_connect(database_url: str) -> None:
    parsed = make_url(database_url)
    socket_dir = parsed.query.get("host")
    if not isinstance(socket_dir, str) or not socket_dir.startswith("/"):
        pytest.skip("the test server is not on a unix socket")
    user, name = parsed.username, parsed.database
    encoded = socket_dir.replace("/", "%2F")
    for url in (
        f"postgresql://{user}@/{name}?host={socket_dir}",
        f"postgresql+psycopg://{user}@/{name}?host={socket_dir}",
        f"postgresql://{user}@{encoded}/{name}",
    ):
        with StudyStore(url) as store:
            store.ping()


def test_unreachable_server_is_a_clear_error() -> None:
    with StudyStore(REFUSED_URL) as store, pytest.raises(DatabaseUnavailable) as err:
        store.ping()
    message = str(err.value)
    assert "cannot reach the database at postgresql://kickass:***@127.0.0.1:1/kickass" in message
    assert "refused" in message
    assert "hunter2" not in message + (err.value.hint or "")
    assert isinstance(err.value, KickassError)


def test_missing_socket_directory_is_a_clear_error() -> None:
    url = "postgresql://kickass@/kickass?host=/nonexistent/kickass"
    with StudyStore(url) as store, pytest.raises(KickassError, match="cannot reach the database"):
        store.ping()


def test_store_calls_on_an_unreachable_database_raise_database_unavailable() -> None:
    with StudyStore(REFUSED_URL) as store:
        with pytest.raises(DatabaseUnavailable, match="database unavailable") as err:
            store.apply(Heartbeat("0123456789abcdef", 1, 1))
        assert "hunter2" not in str(err.value)


def test_missing_database_names_the_problem(pg_server_url: str) -> None:
    url = db.libpq_url(pg_server_url, "no_such_kickass_db")
    with StudyStore(url) as store, pytest.raises(KickassError, match="does not exist"):
        store.ping()


def test_unmigrated_database_tells_the_operator_to_upgrade(empty_database_url: str) -> None:
    with StudyStore(empty_database_url) as store, pytest.raises(KickassError) as err:
        store.ping()
    assert "no kickass schema" in str(err.value)
    assert err.value.hint == "run: kickass db upgrade"


def test_cli_reports_unreachable_database_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["db", "current", "--database-url", REFUSED_URL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: cannot reach the database")
    assert "hint:" in err
    assert "Traceback" not in err
    assert "hunter2" not in err


def test_cli_takes_the_url_from_the_environment(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(db.ENV_DATABASE_URL, database_url)
    assert cli.main(["db", "current"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{db.head_revision()} (head)")


def test_cli_without_any_url_explains(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(db.ENV_DATABASE_URL, raising=False)
    assert cli.main(["db", "current"]) == 2
    assert "ERROR: no database URL given" in capsys.readouterr().err


@pytest.mark.parametrize(
    "query", ["port=nope", "port=5432,x", "port=70000", "port=0", "connect_timeout=soon"]
)
def test_bad_url_parameters_are_errors_not_tracebacks(
    query: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kickass_core import cli

    url = f"postgresql://u:hunter2@127.0.0.1:5432/x?{query}"
    assert cli.main(["db", "upgrade", "--database-url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: bad ") and "\nhint: " in err, err
    assert "hunter2" not in err and "Traceback" not in err
