#!/usr/bin/env bash
# The remote receiver as one Debian package: kickass-agent_<version>_amd64.deb.
#
#   wan-agents/deploy/build-deb.sh [OUT_DIR]        (`make agent-deb`; default build/agent)
#
# What the package holds (no toolchain on the receiver host):
#   /opt/kickass-agent/bin/ka-agent-recv     the Kick-Ass receiver, built here (release, stripped)
#   /opt/kickass-agent/bin/kickass-agent     the agent, run by Debian's python3.11 (-I -S: nothing
#                                            of the host's Python but its standard library)
#   /opt/kickass-agent/lib/python/           kickass_core, kickass_wan and their dependencies,
#                                            pinned by hash (wan-agents/deploy/requirements.lock)
#   /lib/systemd/system/kickass-agent.service, /etc/kickass-agent/agent.toml (a conffile)
#   /usr/bin/kickass-agent                   a link to the agent
# The secret is never in the package: the postinst makes one at the first install and
# keeps it at every upgrade, as it keeps the state directory.
#
# Reproducible: the same sources give the same bytes. Every time stamp is
# SOURCE_DATE_EPOCH (default: the commit's time), files are owned by root,
# modes are set, path prefixes are remapped out of the binary, the wheels of the
# dependencies are checked against their hashes and unpacked (no installer
# writes paths or times of this machine). The version is the packages' version
# plus the commit's time and id, so each commit's package upgrades the one before.
# KICKASS_AGENT_VERSION overrides it (tests build an upgrade that way).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$repo/build/agent}" && cd "${1:-$repo/build/agent}" && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
deploy=$repo/wan-agents/deploy
die() { echo "ERROR: $*" >&2; exit 1; }

for tool in cargo dpkg-deb dpkg-shlibdeps; do
  command -v "$tool" >/dev/null || die "$tool is missing (cargo: rustup; dpkg-deb, dpkg-shlibdeps: apt-get install dpkg-dev)"
done
[ -x "$python" ] || die "no $python: run \`make install\` first (or set PYTHON to a Python 3.11 with pip and hatchling)"
[ "$(dpkg --print-architecture)" = amd64 ] || die "this script builds amd64 packages only"

if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null) ||
    die "not a git checkout: set SOURCE_DATE_EPOCH (and KICKASS_AGENT_VERSION)"
fi
export SOURCE_DATE_EPOCH
upstream=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/wan-agents/pyproject.toml")
if [ -z "${KICKASS_AGENT_VERSION:-}" ]; then
  commit=$(git -C "$repo" rev-parse --short=10 HEAD 2>/dev/null) ||
    die "not a git checkout: set KICKASS_AGENT_VERSION"
  KICKASS_AGENT_VERSION="$upstream+git$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y%m%d%H%M%S).$commit"
fi
version=$KICKASS_AGENT_VERSION
deb=$out/kickass-agent_${version}_amd64.deb

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
opt=$root/opt/kickass-agent

# 1. The Kick-Ass receiver. Its own target directory: other flags than the
#    workspace's usual build, which they would otherwise rebuild from scratch.
echo "build-deb: ka-agent-recv (cargo, release)" >&2
CARGO_TARGET_DIR=$repo/target/agent-deb \
RUSTFLAGS="--remap-path-prefix=$repo=/kickass --remap-path-prefix=${CARGO_HOME:-$HOME/.cargo}=/cargo" \
CARGO_PROFILE_RELEASE_STRIP=symbols \
  cargo build --quiet --release --locked --manifest-path "$repo/Cargo.toml" -p ka-agent --bin ka-agent-recv
install -D -m 755 "$repo/target/agent-deb/release/ka-agent-recv" "$opt/bin/ka-agent-recv"

# 2. The Python packages: ours built here (no index), the dependencies from
#    the index, each checked against requirements.lock's hash.
echo "build-deb: python packages" >&2
wheels=$work/wheels
"$python" -m pip wheel --quiet --no-deps --no-index --no-build-isolation -w "$wheels" \
  "$repo/core" "$repo/wan-agents"
"$python" -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
  --platform manylinux2014_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
  -d "$wheels" -r "$deploy/requirements.lock"
"$python" - "$wheels" "$opt/lib/python" "$deploy/requirements.lock" "$repo/wan-agents/pyproject.toml" <<'PY'
# Unpack every wheel into one folder (what pip --target does, minus the
# console scripts, INSTALLER and this machine's paths), after checking that
# the lock file names exactly what wan-agents pins plus their dependencies.
import re, sys, tomllib, zipfile
from pathlib import Path

wheels, target, lock, pyproject = map(Path, sys.argv[1:])
def norm(n): return re.sub(r"[-_.]+", "-", n).lower()
locked = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.M))
locked = {norm(k): v for k, v in locked.items()}
pins = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
for pin in pins:
    name, _, ver = pin.partition("==")
    if norm(name) == "kickass-core":
        continue
    if locked.get(norm(name)) != ver:
        sys.exit(f"ERROR: {lock} has {name} {locked.get(norm(name))}, wan-agents pins {ver}")
found = sorted(wheels.glob("*.whl"))
names = {norm(w.name.split("-")[0]) for w in found}
if names != set(locked) | {"kickass-core", "kickass-wan"}:
    sys.exit(f"ERROR: wheels {sorted(names)} are not the lock file's and ours")
for w in found:
    with zipfile.ZipFile(w) as z:
        for info in z.infolist():
            if ".data/" in info.filename.split("/", 1)[0] + "/":
                sys.exit(f"ERROR: {w.name} has a .data folder: unpacking is not enough")
            if info.is_dir():
                continue
            dest = target / info.filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
PY
install -m 755 "$deploy/kickass-agent.py" "$opt/bin/kickass-agent"

# 3. The unit, the configuration, the link, the maintainer scripts.
install -D -m 644 "$deploy/kickass-agent.service" "$root/lib/systemd/system/kickass-agent.service"
install -D -m 644 "$deploy/agent.toml" "$root/etc/kickass-agent/agent.toml"
mkdir -p "$root/usr/bin"
ln -s ../../opt/kickass-agent/bin/kickass-agent "$root/usr/bin/kickass-agent"
mkdir -p "$root/DEBIAN"
for script in postinst prerm postrm; do
  install -m 755 "$deploy/debian/$script" "$root/DEBIAN/$script"
done
echo /etc/kickass-agent/agent.toml > "$root/DEBIAN/conffiles"

# What the receiver links against, as dpkg-shlibdeps computes it for Debian's
# own packages (it needs a debian/control to run in).
mkdir -p "$work/src/debian"
printf 'Source: kickass-agent\n\nPackage: kickass-agent\nArchitecture: amd64\n' > "$work/src/debian/control"
shlibs=$(cd "$work/src" && dpkg-shlibdeps -O "$opt/bin/ka-agent-recv" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$shlibs" ] || die "dpkg-shlibdeps found no libraries for ka-agent-recv"
installed_kb=$(find "$root" -path "$root/DEBIAN" -prune -o -type f -printf '%s\n' |
  awk '{ kb += int(($1 + 1023) / 1024) } END { print kb }')
cat > "$root/DEBIAN/control" <<CONTROL
Package: kickass-agent
Version: $version
Architecture: amd64
Maintainer: Kick-Ass measurement platform <kickass@localhost>
Installed-Size: $installed_kb
Depends: python3.11, $shlibs, util-linux
Recommends: iproute2, ethtool
Section: net
Priority: optional
Description: Kick-Ass trial agent: a remote receiver of Kick-Ass and TCP flows
 kickass-agent serves the flows of the platform's wide-area trials: TCP flows,
 and Kick-Ass flows through its receiver ka-agent-recv, which reads each
 datagram's leading fragment before reassembly (CAP_NET_RAW, nothing else).
 The trial runner asks its signed control API for flow tokens.
 .
 The first install makes the agent secret (/etc/kickass-agent/secret) and
 starts the systemd unit; give the secret to the runner:
  kickass trials agents add NAME http://ADDRESS:8700 --secret-file -
CONTROL

# 4. Same sources, same bytes.
find "$root" -type d -exec chmod 755 {} +
find "$root" -type f ! -perm -u+x -exec chmod 644 {} +
find "$root" -type f -perm -u+x -exec chmod 755 {} +
find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
rm -f "$out"/kickass-agent_*_amd64.deb "$out"/kickass-agent_*_amd64.deb.sha256
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
(cd "$out" && sha256sum "$(basename "$deb")" > "$(basename "$deb").sha256")
echo "build-deb: $deb ($(stat -c %s "$deb") bytes)" >&2
cat "$deb.sha256"
