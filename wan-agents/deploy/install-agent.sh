#!/usr/bin/env bash
# Installs or upgrades the remote receiver on a Debian host (bookworm or later), as root:
#
#   install-agent.sh kickass-agent_<version>_amd64.deb      (made by `make agent-deb`)
#
# The package is all it needs: no checkout of the repository, no toolchain (the
# Kick-Ass receiver ka-agent-recv comes prebuilt; apt fetches Debian's python3.11
# if the host lacks it). The digest is checked when the .sha256 file `make
# agent-deb` wrote lies beside the package. The package's postinst makes the
# agent secret once (/etc/kickass-agent/secret, kept at every upgrade, as the
# state is), checks that the receiver runs with the unit's privileges (a dynamic
# user with CAP_NET_RAW only) and starts the unit; this script then waits for
# the agent to answer with its receiver up. Any part that cannot be installed
# or does not run ends it with a non-zero status and the reason.
# `apt install ./kickass-agent_<version>_amd64.deb` does the same without the
# digest check and the wait.
set -euo pipefail
die() { echo "ERROR: $*" >&2; exit 1; }
[ $# -eq 1 ] || { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
deb=$(realpath -e "$1" 2>/dev/null) || die "no such package: $1"
[ "$(id -u)" = 0 ] || die "run as root (it installs a package and a systemd unit)"
command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
  die "not a Debian system (no apt-get): the package is for Debian bookworm or later"
package=$(dpkg-deb -f "$deb" Package 2>/dev/null) || die "$deb is not a Debian package"
[ "$package" = kickass-agent ] || die "$deb is $package, not kickass-agent"
version=$(dpkg-deb -f "$deb" Version)
host_arch=$(dpkg --print-architecture)
deb_arch=$(dpkg-deb -f "$deb" Architecture)
[ "$host_arch" = "$deb_arch" ] ||
  die "this host is $host_arch, the package is built for $deb_arch: its Kick-Ass receiver (ka-agent-recv) cannot run here"
if [ -f "$deb.sha256" ]; then
  (cd "$(dirname "$deb")" && sha256sum --check --quiet --status "$deb.sha256") ||
    die "$deb does not match its digest in $deb.sha256 (a damaged or altered copy)"
  echo "install: $(basename "$deb"), digest $(cut -d' ' -f1 "$deb.sha256")"
else
  echo "install: $(basename "$deb") (no $(basename "$deb").sha256 beside it: digest not checked)"
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! dpkg -s python3.11 >/dev/null 2>&1; then
  echo "install: Debian's python3.11 (the agent's interpreter)"
  apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; die "apt-get update failed"; }
fi
# --reinstall: running the script again re-runs the postinst (its check, a restart).
# The operator's agent.toml is kept (confold); the secret and state are never the package's.
if ! apt-get install -y -q --reinstall --no-install-recommends \
    -o Dpkg::Options::=--force-confold "$deb" >"$log" 2>&1; then
  grep -v '^\(Reading\|Building\|Selecting\|Preparing\|Unpacking\|(Reading\)' "$log" | tail -25 >&2
  die "kickass-agent $version could not be installed (the lines above say why)"
fi
grep '^kickass-agent: ' "$log" || true  # the postinst's news (a new secret)

if [ ! -d /run/systemd/system ]; then
  echo "install: kickass-agent $version installed; systemd is not running here, so the agent was not started (its unit: /lib/systemd/system/kickass-agent.service)"
  exit 0
fi
echo "install: waiting for the agent and its Kick-Ass receiver"
health() {
  python3.11 -I - <<'PY'
import json, sys, tomllib, urllib.request
with open("/etc/kickass-agent/agent.toml", "rb") as f:
    listen = tomllib.load(f).get("agent", {}).get("listen", "0.0.0.0:8700")
host, _, port = listen.rpartition(":")
host = "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
try:
    with urllib.request.urlopen(f"http://{host}:{port}/v1/health", timeout=2) as r:
        health = json.load(r)
except OSError as exc:
    print(f"control API http://{host}:{port}: {exc}")
    sys.exit(1)
ka = health["receivers"]["kickass"] or {}
if not ka.get("ready"):
    print(f"Kick-Ass receiver not up: {ka.get('error') or 'not started yet'}")
    sys.exit(1)
tcp = health["receivers"]["tcp"]["port"]
print(f"control API {port}/tcp, TCP flows {tcp}/tcp, Kick-Ass flows {ka['port']}/udp ({ka['version']})")
PY
}
for _ in $(seq 40); do
  if said=$(health); then
    echo "install: kickass-agent $version runs: $said"
    echo "install: open those ports to the trial runner, and hand it the secret (on the runner host):"
    echo "  ssh root@$(hostname -f 2>/dev/null || hostname) cat /etc/kickass-agent/secret | kickass trials agents add NAME http://ADDRESS:PORT --secret-file -"
    exit 0
  fi
  sleep 0.5
done
systemctl --no-pager status kickass-agent >&2 || true
die "kickass-agent $version is installed but does not answer with its receiver up: $said (journalctl -u kickass-agent)"
