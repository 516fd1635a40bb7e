#!/usr/bin/env bash
# One command on a plain Debian host (as root), from a checkout of this repository:
#   wan-agents/deploy/install-agent.sh
# Installs the agent into /opt/kickass-agent, builds the Kick-Ass receiver if a
# Rust toolchain is present, writes a secret and a config once, and starts the
# systemd unit. Re-running it upgrades in place and keeps the secret.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
[ "$(id -u)" = 0 ] || { echo "ERROR: run as root (it installs a systemd unit)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "ERROR: not a Debian system: install python3-venv yourself" >&2; exit 1; }
python3 -c 'import venv, ensurepip' 2>/dev/null || {
  echo "install: python3-venv"; apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null; }

echo "install: agent into /opt/kickass-agent"
python3 -m venv /opt/kickass-agent
/opt/kickass-agent/bin/pip install --quiet "$repo/core" "$repo/wan-agents"
if command -v cargo >/dev/null; then
  echo "install: Kick-Ass receiver (ka-agent-recv)"
  cargo build --quiet --release --manifest-path "$repo/Cargo.toml" -p ka-transport
  install -m 755 "$repo/target/release/ka-agent-recv" /opt/kickass-agent/bin/ || true
fi

install -d -m 755 /etc/kickass-agent
if [ ! -s /etc/kickass-agent/secret ]; then
  python3 -c 'import secrets; print(secrets.token_hex(32))' > /etc/kickass-agent/secret
  chmod 600 /etc/kickass-agent/secret
  echo "install: new agent secret in /etc/kickass-agent/secret (give it to the trial runner)"
fi
[ -f /etc/kickass-agent/agent.toml ] || cat > /etc/kickass-agent/agent.toml <<TOML
[agent]
listen = "0.0.0.0:8700"
tcp_port = 8701
kickass_port = 8702
TOML
install -m 644 "$repo/wan-agents/deploy/kickass-agent.service" /etc/systemd/system/
systemctl daemon-reload
systemctl enable --now kickass-agent
systemctl --no-pager status kickass-agent | head -5
