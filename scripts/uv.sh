# Sourced by scripts/setup.sh and scripts/side_env.sh (with $python set): the pinned uv, and `uv_sources`,
# the package sources both install from. uv installs the same pins as pip in a fraction of the time: it resolves in
# parallel and links packages from one shared cache (~/.cache/uv) instead of unpacking a copy per environment.
uv_version=0.13.9
uv="${XDG_CACHE_HOME:-$HOME/.cache}/agent_loop/uv-$uv_version/bin/uv"
if [[ ! -x $uv ]]; then
  # pip --target into a fresh folder, moved into place whole: an interrupted install leaves no half uv
  tmp="${uv%/bin/uv}.tmp.$$"
  "$python" -m pip install --quiet --disable-pip-version-check --target "$tmp" "uv==$uv_version"
  mv "$tmp" "${uv%/bin/uv}" 2>/dev/null || rm -rf "$tmp"  # another set-up may have moved its copy first
fi

# uv reads no pip.conf: hand it pip's own index, find-links and constraint settings, so both install from the
# same places under the same caps (here the local CPU torch wheel and its cap). pip merges all its indexes and
# takes the best version anywhere; unsafe-best-match is uv's name for that.
uv_sources=(--index-strategy unsafe-best-match)
while IFS= read -r setting; do
  key=${setting%%=*} value=${setting#*=}
  value=${value#\'} value=${value%\'}
  case ${key##*.} in
    index-url) flag=--index-url ;;
    extra-index-url) flag=--extra-index-url ;;
    find-links) flag=--find-links ;;
    constraint) flag=--constraint ;;
    *) continue ;;
  esac
  for item in $value; do uv_sources+=("$flag" "$item"); done
done < <("$python" -m pip config list 2>/dev/null | sort -u -t= -k2)
