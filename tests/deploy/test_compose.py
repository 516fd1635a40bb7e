"""docker-compose.yml, the server image and the reader-role grant, checked offline.

There is no Docker engine here: ``docker-compose config`` validates and
resolves the file without one, and the resolved file is checked for what
the engine would only find out at ``up`` (missing mounts, services or
volumes; a server on a NAT'd network). The grant script runs for real.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kickass_db as db
import psycopg
import pytest
import yaml
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "docker" / "kickass.env.example"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "postgres.yaml"
SECRETS = {
    "KICKASS_DB_PASSWORD": "db-secret",
    "KICKASS_GRAFANA_DB_PASSWORD": "reader-secret",
    "KICKASS_GRAFANA_ADMIN_PASSWORD": "admin-secret",
}
# Variables of the images we do not build: their names are the images' own.
FOREIGN_ENV = re.compile(r"^(POSTGRES_|GF_)")

needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose binary not installed (Debian package docker-compose)",
)


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A clean environment: only what the test passes, so a developer's shell
    # or a stray .env cannot make the file look valid.
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(
        ["docker-compose", "--project-directory", str(ROOT), "-f", str(COMPOSE), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose binary not installed (Debian package docker-compose)")
    out = compose("config", env=SECRETS)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@needs_compose
def test_compose_file_validates() -> None:
    out = compose("config", "-q", env=SECRETS)
    assert out.returncode == 0, out.stderr


@needs_compose
def test_compose_refuses_to_run_without_secrets() -> None:
    out = compose("config", "-q")
    assert out.returncode != 0
    assert "KICKASS_DB_PASSWORD" in out.stderr


@needs_compose
def test_example_env_file_is_complete() -> None:
    out = compose("--env-file", str(ENV_EXAMPLE), "config", "-q")
    assert out.returncode == 0, out.stderr


def test_services_volumes_and_dependencies(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert {"postgres", "migrate", "server", "grafana"} <= set(services)
    declared = set(resolved.get("volumes", {}))
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        for mount in svc.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts missing {source}"
                assert Path(source).is_relative_to(ROOT), f"{name} mounts {source} outside the repo"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
        build = svc.get("build")
        if build:
            assert (Path(build["context"]) / build["dockerfile"]).is_file()
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("server", "grafana"):
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully"
        )
    assert "healthcheck" in services["postgres"]


def test_server_can_send_raw_probes_unmangled(resolved: dict[str, Any]) -> None:
    server = resolved["services"]["server"]
    # Host networking: no Docker NAT (conntrack) between the raw socket and the
    # Internet, which would reassemble and re-cut the split probes.
    assert server["network_mode"] == "host"
    assert "ports" not in server
    assert server["cap_add"] == ["NET_RAW"] and server["cap_drop"] == ["ALL"]
    env = server["environment"]
    assert "@127.0.0.1:" in env["KICKASS_DATABASE_URL"]  # postgres is published there
    ports = resolved["services"]["postgres"]["ports"]
    # Short ("127.0.0.1:5432:5432/tcp") or long ({host_ip: ...}) syntax.
    host_ips = [p.get("host_ip") if isinstance(p, dict) else p.split(":")[0] for p in ports]
    assert host_ips == ["127.0.0.1"], ports


def test_everything_is_configured_with_kickass_variables(resolved: dict[str, Any]) -> None:
    for name, svc in resolved["services"].items():
        for key in svc.get("environment", {}):
            assert key.startswith("KICKASS_") or FOREIGN_ENV.match(key), f"{name}: {key}"
    text = COMPOSE.read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    assert used and all(v.startswith("KICKASS_") for v in used), used
    # Every variable the file reads is documented in the example env file.
    documented = set(re.findall(r"^#?\s*(KICKASS_\w+)=", ENV_EXAMPLE.read_text(), re.M))
    assert used <= documented, used - documented


def test_grafana_gets_its_provisioning(resolved: dict[str, Any]) -> None:
    grafana = resolved["services"]["grafana"]
    mounts = {m.split(":")[1]: Path(m.split(":")[0]) for m in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == ROOT / "grafana" / "provisioning"
    assert (provisioning / "datasources" / "postgres.yaml").is_file()
    assert (provisioning / "dashboards" / "dashboards.yaml").is_file()
    # The dashboard provider's path is where the dashboards are mounted.
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())
    (provider,) = providers["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert list(dashboards.glob("*.json"))
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to(provider["options"]["path"])).is_file()
    # Every variable the datasource file reads is set on the container.
    wanted = set(re.findall(r"\$\{?(KICKASS_\w+)", DATASOURCES.read_text()))
    assert wanted and wanted <= set(grafana["environment"]), wanted
    assert grafana["environment"]["KICKASS_GRAFANA_DB_HOST"].split(":")[0] == "postgres"


def test_server_dockerfile_copies_what_exists() -> None:
    dockerfile = (ROOT / "docker" / "server.Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", dockerfile, re.M)
    for source in re.findall(r"^COPY\s+(\S+)\s", dockerfile, re.M):
        assert (ROOT / source).exists(), source
    # The kickass-db wheel carries its migrations: no path variable needed.
    assert "KICKASS_MIGRATIONS_DIR" not in dockerfile
    assert (ROOT / "db" / "migrations" / "env.py").is_file()


# -- the reader role, on a real database ---------------------------------------------


def _grant_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grant_reader", ROOT / "docker/grant_reader.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def reader_role(database_url: str) -> Iterator[tuple[str, str]]:
    role = f"kickass_reader_{secrets.token_hex(4)}"
    url = db.libpq_url(database_url)
    try:
        yield url, role
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_grant_reader_gives_the_views_and_nothing_else(
    reader_role: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, role = reader_role
    grant = _grant_module()
    monkeypatch.setenv("KICKASS_DATABASE_URL", url)
    monkeypatch.setenv("KICKASS_GRAFANA_DB_USER", role)
    monkeypatch.setenv("KICKASS_GRAFANA_DB_PASSWORD", "it's-a-secret")
    assert grant.main() == 0
    assert grant.main() == 0  # every `up` runs it again
    with psycopg.connect(url, autocommit=True) as conn:
        granted = {
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.role_table_grants "
                "WHERE grantee = %s AND privilege_type = 'SELECT'",
                (role,),
            )
        }
        views = {r[0] for r in conn.execute("SELECT viewname FROM pg_views WHERE viewname ~ '^v_'")}
        assert views and granted == views
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        conn.execute("SELECT * FROM v_session_summary LIMIT 1")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM sessions LIMIT 1")


def test_grant_reader_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KICKASS_DATABASE_URL", raising=False)
    monkeypatch.delenv("KICKASS_GRAFANA_DB_USER", raising=False)
    assert _grant_module().main() == 2
