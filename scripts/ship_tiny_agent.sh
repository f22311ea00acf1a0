#!/usr/bin/env bash
# Pack a tiny-agent build from the cache into agent_loop/tiny/weights/ (deterministic tar, xz) and print
# the sha256 to put in agent_loop/tiny/build.py's SHIPPED_SHA256:
#   bash scripts/ship_tiny_agent.sh tiny-agent-v9          # after `agent-loop tiny --force` built it here
#   bash scripts/ship_tiny_agent.sh tiny-agent-v9-chain
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: ship_tiny_agent.sh CACHE_FOLDER_NAME}
cache=${AGENT_LOOP_CACHE:-$HOME/.cache/agent_loop}
[[ -f $cache/$name/build.json ]] || { echo "no build at $cache/$name" >&2; exit 2; }
mkdir -p agent_loop/tiny/weights
tar -C "$cache" -cf - --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 \
  "$name/final" "$name/mid" "$name/build.json" | xz -9e -T1 > "agent_loop/tiny/weights/$name.tar.xz"
sha256sum "agent_loop/tiny/weights/$name.tar.xz"
