#!/usr/bin/env bash
# Installs every operating-system package that the demo, the tests and the
# benchmarks run, and nothing else. `make install`, `make demo`, `make test`
# and .ci/run all go through it, so a fresh Debian machine needs no manual step.
#
#   tools/setup-system.sh           install what is missing (idempotent)
#   tools/setup-system.sh --check   list what is missing, install nothing (exit 1 if any)
#   tools/setup-system.sh --list    print the whole program -> package table
#
# The table below is the single list of external programs the project starts:
# add a line in the same commit as the code or test that runs a new program.
set -euo pipefail

# program-or-path  debian-package  who runs it
TABLE='
ip                                   iproute2        namespaces, veths, routes (testbed, demo, tests)
tc                                   iproute2        qdiscs in the testbed
ss                                   iproute2        the congestion control the kernel reports for a socket (tests)
nft                                  nftables        ka-router --datapath packet (its LAN guard table); middleboxes: fragment filters, loss, NAT (demo, tests)
ethtool                              ethtool         offloads off on veths (testbed)
tcpdump                              tcpdump         ground-truth captures (tests)
ping                                 iputils-ping    link-emulator delay test, Atlas-style echo requests
sysctl                               procps          reassembly and forwarding knobs in namespaces
setpriv                              util-linux      unprivileged runs in tests (router errors)
unshare                              util-linux      a private network namespace for one process (tests: the TCP metrics cache), and stream B of make test in a mount namespace of its own
mount                                mount           stream B of make test: its own /run/netns (tools/run-tests.sh)
iperf3                               iperf3          router benchmark sender
docker-compose                       docker-compose  offline check of docker-compose.yml (tests)
docker                               docker.io       the compose deployment run for real (tests)
dockerd                              docker.io       the Docker daemon, started by ../shared/oracles/docker/make-base-images.sh (tests)
debootstrap                          debootstrap     base images of the compose test, from Debian packages (make-base-images.sh)
/usr/lib/postgresql/*/bin/postgres   postgresql      the real PostgreSQL the tests run against
pypy3                                pypy3           a Python 3.9: the one-file client kickass-probe.pyz run on its oldest Python (tests)
crontab                              cron            `kickass schedule crontab --install` and the line it writes, run as cron would (tests)
systemd-analyze                      systemd         the timer units of `kickass schedule crontab --systemd` and the unit of the agent package, verified (tests)
dpkg-shlibdeps                       dpkg-dev        the Debian package of the agent: the libraries ka-agent-recv needs (make agent-deb)
nsenter                              util-linux      the container of a deployed receiver plugged into the testbed (tests)
chromium                             chromium        rendering tests: the report and the volunteer page
/usr/lib/jvm/java-17-openjdk-*/bin/java  openjdk-17-jre-headless  the JVM of Spark: kickass archive analyze --engine spark (tests)
'

mode=install
case "${1:-}" in
  --check) mode=check ;;
  --list) mode=list ;;
  "") ;;
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "ERROR: unknown option $1 (try --help)" >&2; exit 2 ;;
esac

# SETUP_SYSROOT prefixes the absolute paths above (tests point it at an empty
# folder to play a fresh machine; PATH does the same for the programs).
present() {
  case "$1" in
    /*) compgen -G "${SETUP_SYSROOT:-}$1" >/dev/null ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}

missing=()
while read -r prog pkg _; do
  [ -n "${prog:-}" ] || continue
  if [ "$mode" = list ]; then printf '%-36s %s\n' "$prog" "$pkg"; continue; fi
  present "$prog" && continue
  [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
done <<<"$TABLE"
[ "$mode" = list ] && exit 0

if [ ${#missing[@]} -eq 0 ]; then
  [ "$mode" = check ] && echo "setup: every system package is present"
  exit 0
fi
if [ "$mode" = check ]; then
  echo "setup: missing system packages: ${missing[*]}"
  exit 1
fi

if [ "$(id -u)" != 0 ]; then
  echo "ERROR: system packages are missing and installing them needs root: ${missing[*]}" >&2
  echo "hint: run as root, or: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ERROR: not a Debian system (no apt-get); install these packages yourself: ${missing[*]}" >&2
  exit 1
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "ERROR: apt-get could not install: ${missing[*]}" >&2
  exit 1
fi
