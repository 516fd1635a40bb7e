"""docker-compose.yml, the images and the reader-role grant: offline, then for real.

Offline: ``docker-compose config`` validates and resolves the file without a
Docker engine, and the resolved file is checked for what the engine would
only find out at ``up`` (missing mounts, services or volumes; a server on a
NAT'd network). The grant script runs for real against the test database.

For real (``test_compose_deployment_runs_for_real``, slow): Docker's daemon
and the base images the compose file names come from
``../shared/oracles/docker/make-base-images.sh`` (Debian packages; no image
registry here), the stack goes up under a project name of its own with free
ports, a volunteer study runs from the host over TLS through the proxy, a
scheduled item runs in the ``schedule`` container and is recorded, and
``down -v`` leaves nothing of the project behind.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kickass_db as db
import psycopg
import pytest
import yaml
from _deployed import (
    AGENT_ADDRESS,
    assert_paired_trial_stored,
    build_deb,
    plug_into_far,
    trial_to_deployed,
    unplug_root,
)
from _deployed import docker_daemon as _docker_daemon
from _deployed import docker_env as _docker_env
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "docker" / "kickass.env.example"
KICKASS = str(ROOT / ".venv" / "bin" / "kickass")
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
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


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
    assert {"postgres", "migrate", "server", "proxy", "schedule", "grafana"} <= set(services)
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
    for name in ("server", "schedule", "grafana"):
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


def test_the_proxy_terminates_tls_in_front_of_the_server(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    server, proxy = services["server"], services["proxy"]
    env = server["environment"]
    # The server's plain HTTP on loopback, trusting X-Forwarded-For from the
    # proxy there (both on the host's network: the proxy sees real addresses).
    assert env["KICKASS_LISTEN"] == "127.0.0.1:8080"
    assert env["KICKASS_TRUST_PROXY"] == "1"
    assert proxy["network_mode"] == "host" and "ports" not in proxy
    assert proxy["cap_drop"] == ["ALL"]
    assert set(proxy["cap_add"]) == {"NET_BIND_SERVICE", "SETUID", "SETGID"}
    penv = proxy["environment"]
    assert penv["KICKASS_HTTP_PORT"] == env["KICKASS_LISTEN"].rsplit(":", 1)[1]
    assert penv["KICKASS_HTTPS_PORT"] == "443"
    assert penv["KICKASS_TLS_HSTS_MAX_AGE"] == "0"  # HSTS off by default
    assert [v.split(":")[:2] for v in proxy["volumes"]] == [["tls", "/etc/kickass/tls"]]
    template = (ROOT / "docker/proxy/nginx.conf.template").read_text()
    # The client's own X-Forwarded-For is replaced, never passed on.
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in template
    assert "$proxy_add_x_forwarded_for" not in template
    assert "proxy_pass http://127.0.0.1:${KICKASS_HTTP_PORT};" in template
    # Every ${KICKASS_*} of the template is one the entrypoint substitutes.
    entrypoint = (ROOT / "docker/proxy/entrypoint.sh").read_text()
    (subst,) = re.findall(r"envsubst '([^']*)'", entrypoint)
    assert set(re.findall(r"\$\{(KICKASS_\w+)\}", template)) == set(
        re.findall(r"\$\{(\w+)\}", subst)
    )
    assert subprocess.run(["sh", "-n", str(ROOT / "docker/proxy/entrypoint.sh")]).returncode == 0


def test_the_schedule_service_runs_the_schedule_unattended(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    sched = services["schedule"]
    assert sched["image"] == services["server"]["image"]
    assert sched["build"] == services["server"]["build"]
    command = sched["command"]
    assert command[:4] == ["schedule", "run", "/etc/kickass/schedule.toml", "--loop"]
    assert "--metrics-port=9108" in command
    assert sched["init"] is True and sched["restart"] == "unless-stopped"
    assert "@postgres:5432/" in sched["environment"]["KICKASS_DATABASE_URL"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in sched["volumes"]}
    assert Path(mounts["/etc/kickass/schedule.toml"]) == ROOT / "docker" / "schedule.toml"
    assert mounts["/var/lib/kickass/journal"] == "server-journal"
    # The server knows the same schedule (who may claim what): without it
    # every runner's claim is refused (403 no-schedule).
    server = services["server"]
    server_mounts = {m.split(":")[1]: m.split(":")[0] for m in server["volumes"]}
    assert server_mounts["/etc/kickass/schedule.toml"] == mounts["/etc/kickass/schedule.toml"]
    assert server["environment"]["KICKASS_SCHEDULE_FILE"] == "/etc/kickass/schedule.toml"
    # Metrics published on loopback only.
    (port,) = sched["ports"]
    host_ip = port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]
    assert host_ip == "127.0.0.1", port
    # The default schedule is valid (checked by the real command).
    out = subprocess.run(
        [
            str(ROOT / ".venv/bin/kickass"),
            "schedule",
            "check",
            "--json",
            str(ROOT / "docker/schedule.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    checked = json.loads(out.stdout)
    assert {i["name"]: i["kind"] for i in checked["items"]} == {
        "refresh": "refresh",
        "housekeeping": "housekeeping",
    }


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
    sources = re.findall(r"^COPY\s+(?!--from)(\S+)\s", dockerfile, re.M)
    for source in sources:
        assert (ROOT / source).exists(), source
    # Every package the image runs, operations (`kickass schedule`) and
    # analysis (its `refresh` item) included, and what BuildKit's context keeps.
    keep = (ROOT / "docker" / "server.Dockerfile.dockerignore").read_text().split()
    for package in ("core", "db", "server", "atlas", "analysis", "operations"):
        assert f"{package}/" in sources and f"./{package}" in dockerfile, package
        assert f"!{package}/" in keep, package
    for source in sources:
        if source.startswith("docker/"):
            assert f"!{source}" in keep, source
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


# -- the deployment, for real -----------------------------------------------------------

PROBE = ROOT / ".venv" / "bin" / "kickass-probe"
# Grafana is left out: there is no Grafana image or Debian package here
# (../shared/oracles/docker/README.md); its provisioning is tested offline above.
LIVE_SERVICES = ("postgres", "migrate", "server", "schedule", "proxy")
PROJECT_LABEL = "com.docker.compose.project"
# A schedule of its own: both items due every minute, so the first pass runs them.
TEST_SCHEDULE = """\
[schedule]
name = "compose-test"
heartbeat_s = 5
stale_s = 20

[[item]]
name = "housekeeping-test"
kind = "housekeeping"
cron = "* * * * *"
journals = ["/var/lib/kickass/journal"]

[[item]]
name = "refresh-test"
kind = "refresh"
cron = "* * * * *"
"""


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, psycopg.Error) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:g} s (last: {last!r})")


def _https(
    port: int, path: str, ctx: ssl.SSLContext, *, method: str = "GET", body: Any = None,
    headers: dict[str, str] | None = None, source: str = "127.0.0.1",
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    conn = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ctx, timeout=10, source_address=(source, 0)
    )
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.machine  # Docker adds bridges and veths to the root namespace
# The first run builds the images (their Python dependencies: minutes); later
# runs rebuild only the layers of changed sources.
@pytest.mark.timeout(1800)
def test_compose_deployment_runs_for_real(tmp_path: Path) -> None:
    docker_host = _docker_daemon()
    denv = _docker_env(docker_host)
    project = f"kickasstest{secrets.token_hex(4)}"
    ports = {
        "KICKASS_DB_PORT": _free_port(),
        "KICKASS_HTTP_PORT": _free_port(),
        "KICKASS_PROBE_PORT": _free_port(socket.SOCK_DGRAM),
        "KICKASS_HTTPS_PORT": _free_port(),
        "KICKASS_SCHEDULE_METRICS_PORT": _free_port(),
    }
    schedule_file = tmp_path / "schedule.toml"
    schedule_file.write_text(TEST_SCHEDULE)
    schedule_file.chmod(0o644)
    tmp_path.chmod(0o755)
    password = secrets.token_hex(12)
    settings = {
        **{k: str(v) for k, v in ports.items()},
        "KICKASS_DB_PASSWORD": password,
        "KICKASS_GRAFANA_DB_PASSWORD": secrets.token_hex(12),
        "KICKASS_GRAFANA_ADMIN_PASSWORD": secrets.token_hex(12),
        # Loopback only: the test's traffic never leaves this machine.
        "KICKASS_PROBE_BIND": "127.0.0.1",
        "KICKASS_HTTPS_BIND": "127.0.0.1",
        "KICKASS_TLS_NAMES": "IP:127.0.0.1",
        "KICKASS_SCHEDULE_FILE": str(schedule_file),
    }
    env_file = tmp_path / "kickass.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    # The daemon here has no default bridge: builds use the host's network.
    # The PostgreSQL image built here is 15 (the file pins 16.4 for real use).
    server_build = {
        "context": str(ROOT),
        "dockerfile": "docker/server.Dockerfile",
        "network": "host",
    }
    override: dict[str, Any] = {
        "services": {
            "migrate": {"build": server_build},
            "server": {"build": server_build},
            "schedule": {"build": server_build},
            "proxy": {
                "build": {
                    "context": str(ROOT / "docker" / "proxy"),
                    "dockerfile": "Dockerfile",
                    "network": "host",
                }
            },
        }
    }
    pinned = yaml.safe_load(COMPOSE.read_text())["services"]["postgres"]["image"]
    have = subprocess.run(["docker", "image", "inspect", pinned], env=denv, capture_output=True)
    if have.returncode != 0:
        override["services"]["postgres"] = {"image": "postgres:15-bookworm"}
    override_file = tmp_path / "override.yml"
    override_file.write_text(yaml.safe_dump(override))

    def dc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker-compose", "--project-directory", str(ROOT), "-p", project,
             "-f", str(COMPOSE), "-f", str(override_file), "--env-file", str(env_file), *args],
            env=denv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )  # fmt: skip

    def docker(*args: str) -> list[str]:
        out = subprocess.run(
            ["docker", *args], env=denv, capture_output=True, text=True, timeout=60, check=True
        )
        return out.stdout.split()

    def leftovers() -> dict[str, list[str]]:
        label = f"label={PROJECT_LABEL}={project}"
        return {
            "containers": docker("ps", "-a", "-q", "--filter", label),
            "volumes": docker("volume", "ls", "-q", "--filter", label)
            + docker("volume", "ls", "-q", "--filter", f"name={project}_"),
            "networks": docker("network", "ls", "-q", "--filter", label),
        }

    db_url = f"postgresql://kickass:{password}@127.0.0.1:{ports['KICKASS_DB_PORT']}/kickass"
    https_port = ports["KICKASS_HTTPS_PORT"]
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    built = False
    try:
        up = dc("up", "-d", "--build", *LIVE_SERVICES, timeout=1700)
        assert up.returncode == 0, up.stderr[-4000:]
        built = True
        timings["up"] = time.monotonic() - t0
        running = leftovers()
        # Positive control of the final check: the label finds what the project made.
        assert len(running["containers"]) == len(LIVE_SERVICES), running
        assert running["networks"] and len(set(running["volumes"])) >= 3, running

        # The proxy made a self-signed certificate into its volume at its first start.
        ca_file = tmp_path / "ca.pem"

        def read_ca() -> bool:
            got = dc("exec", "-T", "proxy", "cat", "/etc/kickass/tls/ca.pem")
            if got.returncode == 0 and "BEGIN CERTIFICATE" in got.stdout:
                ca_file.write_text(got.stdout)
                return True
            return False

        _wait("the proxy's CA certificate", read_ca, 120)
        ctx = ssl.create_default_context(cafile=str(ca_file))
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # as Python 3.13's default context

        def healthy() -> bool:
            status, headers, body = _https(https_port, "/api/v1/health", ctx)
            assert "strict-transport-security" not in headers  # HSTS off by default
            return status == 200 and json.loads(body).get("status") == "ok"

        _wait("the server's health through the proxy (TLS)", healthy, 180)
        timings["healthy"] = time.monotonic() - t0

        # A volunteer study from the host: HTTP over TLS through the proxy, the
        # probes straight from the server. The client's default TLS context
        # reads its trust store from SSL_CERT_FILE (OpenSSL's variable).
        server = f"https://127.0.0.1:{https_port}"
        cmd = [str(PROBE), "--server", server, "--quick", "--yes", "--json", "--timeout", "5"]
        base_env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
        untrusted = subprocess.run(cmd, env=base_env, capture_output=True, text=True, timeout=60)
        assert untrusted.returncode == 1, untrusted.stderr
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
        study = subprocess.run(
            cmd, env={**base_env, "SSL_CERT_FILE": str(ca_file)},
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert study.returncode == 0, study.stderr[-3000:]
        result = json.loads(study.stdout)
        assert result["state"] == "complete" and result["server"] == server, result
        assert result["pooled"]["whole"]["sent"] > 0 and result["pooled"]["split"]["sent"] > 0
        timings["study"] = time.monotonic() - t0

        # The server takes the client's address from the proxy's X-Forwarded-For,
        # never from the client's own: a client on 127.0.0.5 that claims another.
        status, _, body = _https(
            https_port, "/api/v1/sessions", ctx, method="POST", source="127.0.0.5",
            headers={"X-Forwarded-For": "198.51.100.7"},
            body={"plan": {"quick": True}, "client_version": "compose-test",
                  "platform": "test", "install_id": None},
        )  # fmt: skip
        assert status == 201, body
        created = json.loads(body)
        status, _, body = _https(
            https_port, f"/api/v1/sessions/{created['session_id']}/end", ctx, method="POST",
            body={}, headers={"X-Kickass-Cookie": created["cookie"]},
        )  # fmt: skip
        assert status == 200, body
        with psycopg.connect(db_url, connect_timeout=10) as conn:
            rows: dict[str, str] = dict(
                conn.execute(
                    "SELECT session_id, host(source_address) FROM sessions "
                    "WHERE session_id = ANY(%s)",
                    ([result["session_id"], created["session_id"]],),
                ).fetchall()
            )
        assert rows == {result["session_id"]: "127.0.0.1", created["session_id"]: "127.0.0.5"}

        # The scheduled items ran in the schedule container and are recorded.
        def recorded() -> dict[str, tuple[str, str, str | None]] | None:
            with psycopg.connect(db_url, connect_timeout=5) as conn:
                got = {
                    r[0]: (r[1], r[2], r[3])
                    for r in conn.execute(
                        "SELECT item, outcome, host, reason FROM item_runs "
                        "WHERE outcome <> 'running' ORDER BY finished_at"
                    )
                }
            return got if {"housekeeping-test", "refresh-test"} <= set(got) else None

        runs = _wait("the scheduled items' runs in item_runs", recorded, 150, every=2)
        for item in ("housekeeping-test", "refresh-test"):
            assert runs[item][:2] == ("ok", "compose-schedule"), runs
        timings["scheduled"] = time.monotonic() - t0

        # Its metrics, published on 127.0.0.1 only.
        metrics_url = f"http://127.0.0.1:{ports['KICKASS_SCHEDULE_METRICS_PORT']}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        assert re.search(
            r'^kickass_schedule_item_runs\{item="housekeeping-test",kind="housekeeping",'
            r'outcome="ok"\} [1-9]',
            text,
            re.M,
        ), text[:2000]

        # SIGTERM: the loop stops at once and says so; exit 0 (no item failed).
        (cid,) = docker(
            "ps", "-q", "--filter", f"label={PROJECT_LABEL}={project}",
            "--filter", "label=com.docker.compose.service=schedule",
        )  # fmt: skip
        t_stop = time.monotonic()
        stopped = dc("stop", "-t", "30", "schedule", timeout=60)
        stop_s = time.monotonic() - t_stop
        assert stopped.returncode == 0, stopped.stderr
        assert stop_s < 15, f"schedule took {stop_s:.1f} s to stop"
        assert docker("inspect", "-f", "{{.State.ExitCode}}", cid) == ["0"]
        logs = dc("logs", "--no-color", "schedule").stdout
        assert '"event":"stopping"' in logs and '"signal":"SIGTERM"' in logs, logs[-2000:]
        timings["checks"] = time.monotonic() - t0
    except BaseException:
        print(dc("ps").stdout)
        print(dc("logs", "--no-color", "--tail", "60").stdout[-20000:])
        raise
    finally:
        down = dc("down", "-v", "--remove-orphans", "-t", "20", timeout=300)
        if built:
            # Images this build replaced (untagged now) go; the tagged ones stay as
            # the next run's cache (an interrupted build's layers stay too).
            subprocess.run(
                ["docker", "image", "prune", "-f", "--filter", "label=org.kickass.image"],
                env=denv, capture_output=True, timeout=300,
            )  # fmt: skip
    timings["down"] = time.monotonic() - t0
    print("compose test timings (s since start):", {k: round(v, 1) for k, v in timings.items()})
    assert down.returncode == 0, down.stderr
    assert leftovers() == {"containers": [], "volumes": [], "networks": []}


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.machine  # the agent on this machine's network, a veth from the testbed to it
@pytest.mark.timeout(1800)
def test_compose_agent_profile_serves_a_paired_trial(database_url: str, tmp_path: Path) -> None:
    """`make agent-deb`, then the compose file's `agent` profile as an operator
    brings it up (host networking, CAP_NET_RAW only, the secret from the env
    file): registered with the runner in one command, it receives a paired
    Kick-Ass/TCP trial from the testbed's sender through ka-router and the
    emulated WAN, which reaches this machine's network through a veth."""
    docker_host = _docker_daemon()
    denv = _docker_env(docker_host)
    build_deb(ROOT / "build" / "agent")  # what `make agent-deb` does
    project = f"kickasstest{secrets.token_hex(4)}"
    secret = secrets.token_hex(32)
    control = _free_port()
    settings = {
        **SECRETS,
        "KICKASS_AGENT_SECRET": secret,
        "KICKASS_AGENT_BIND": AGENT_ADDRESS,
        "KICKASS_AGENT_PORT": str(control),
        "KICKASS_AGENT_TCP_PORT": str(_free_port()),
        "KICKASS_AGENT_KICKASS_PORT": str(_free_port(socket.SOCK_DGRAM)),
        "KICKASS_AGENT_NAME": "far-compose",
    }
    env_file = tmp_path / "kickass.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    override_file = tmp_path / "override.yml"
    override_file.write_text(
        yaml.safe_dump(
            {
                "services": {
                    "agent": {
                        "build": {
                            "context": str(ROOT),
                            "dockerfile": "docker/agent.Dockerfile",
                            "network": "host",
                        }
                    }
                }
            }
        )
    )

    def dc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker-compose", "--project-directory", str(ROOT), "-p", project,
             "-f", str(COMPOSE), "-f", str(override_file), "--env-file", str(env_file),
             "--profile", "agent", *args],
            env=denv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )  # fmt: skip

    def started(tb: Any) -> None:
        # The agent binds the veth's address: the veth first, then `up`.
        plug_into_far(tb, None)
        up = dc("up", "-d", "--build", "agent", timeout=1200)
        assert up.returncode == 0, up.stderr[-4000:]

    t0 = time.monotonic()
    try:
        outcome, said = trial_to_deployed(
            database_url, tmp_path / "trial", "far-compose", plug=started,
            secret=lambda: secret, url=f"http://{AGENT_ADDRESS}:{control}",
        )  # fmt: skip
        assert "far-compose" in said and "ok  agent 0.1.0, ka-agent-recv 0.1.0" in said, said
        figures = assert_paired_trial_stored(outcome, "far-compose")
        inspect = subprocess.run(
            ["docker", "inspect", "-f", "{{.HostConfig.CapDrop}} {{.HostConfig.CapAdd}} "
             "{{.HostConfig.NetworkMode}}", f"{project}_agent_1"],
            env=denv, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert inspect == ["[ALL]", "[NET_RAW]", "host"], inspect
    except BaseException:
        print(dc("logs", "--no-color", "--tail", "60", "agent").stdout[-6000:])
        raise
    finally:
        unplug_root()
        down = dc("down", "-v", "--remove-orphans", "-t", "10", timeout=300)
        # The agent image a new package replaced (untagged now) goes; vfs keeps
        # a whole copy of the file system per layer.
        subprocess.run(
            ["docker", "image", "prune", "-f", "--filter", "label=org.kickass.image=kickass-agent"],
            env=denv, capture_output=True, timeout=300,
        )  # fmt: skip
    print("compose agent:", {**figures, "s": round(time.monotonic() - t0, 1)})
    assert down.returncode == 0, down.stderr
    left = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"label={PROJECT_LABEL}={project}"],
        env=denv, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert left == []
