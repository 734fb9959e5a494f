#!/usr/bin/env bash
# The quick suite (python -m pytest -q -m "not heavy"; HEAVY=1 for the whole suite) on the releases a user can
# install today, each in a fresh virtual environment under ${MATRIX_DIR:-${TMPDIR:-/tmp}/bcg-matrix}/<entry>.
# Prints one line per entry (its packages and pytest's last line) and keeps each log beside its environment.
#
#   bash scripts/test_matrix.sh                 # every entry
#   bash scripts/test_matrix.sh torch-2.14 floors
#
# Entries:
#   torch-2.13  torch 2.13.0 (its CPU build), Triton 3.6.0, the newest transformers and diffusers: what CI runs
#   torch-2.14  torch 2.14.1 (it brings Triton 3.8.0)
#   torch-2.15  torch 2.15.0, the newest on the package index (it brings Triton 3.9.0); pip's own configuration
#               is ignored for it (PIP_CONFIG_FILE=/dev/null), so a machine whose pip caps torch's version at
#               the releases on its disk still gets it from the index
#   floors      torch 2.13.0 with the lowest transformers (5.0.0) and diffusers (0.42.0) that pyproject.toml admits
#
# docs/versions.md records what each entry gave, and which versions ran on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
root="${MATRIX_DIR:-${TMPDIR:-/tmp}/bcg-matrix}"
mkdir -p "$root"
marker=(-m "not heavy")
[ "${HEAVY:-0}" = 1 ] && marker=()
entries=("$@")
[ ${#entries[@]} -gt 0 ] || entries=(torch-2.13 torch-2.14 torch-2.15 floors)

install() {  # install ENTRY's packages into the environment whose pip is $pip
  case "$1" in
    torch-2.13) $pip install -q "torch==2.13.0" && $pip install -q -e ".[test,dev]" "torchao==0.17.0" "triton==3.6.0" ;;
    torch-2.14) $pip install -q "torch==2.14.1" && $pip install -q -e ".[test,dev]" "torchao==0.17.0" ;;
    torch-2.15) PIP_CONFIG_FILE=/dev/null $pip install -q "torch==2.15.0" -e ".[test,dev]" "torchao==0.17.0" ;;
    floors) $pip install -q "torch==2.13.0" && $pip install -q -e ".[test,dev]" "torchao==0.17.0" "triton==3.6.0" \
      "transformers==5.0.0" "diffusers==0.42.0" ;;
    *) echo "unknown entry $1 (torch-2.13, torch-2.14, torch-2.15, floors)" >&2; return 2 ;;
  esac
}

status=0
for entry in "${entries[@]}"; do
  venv="$root/$entry"
  rm -rf "$venv"
  python3 -m venv "$venv"
  pip="$venv/bin/python -m pip"
  $pip install -q --upgrade pip >/dev/null
  if ! install "$entry" >"$venv.install.log" 2>&1; then
    echo "$entry: install failed (see $venv.install.log)"
    status=1
    continue
  fi
  packages=$($venv/bin/python -m pip list 2>/dev/null | awk '$1 ~ /^(torch|triton|transformers|diffusers)$/ {printf "%s %s, ", $1, $2}')
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "${marker[@]}" --deselect tests/test_browser.py >"$venv.log" 2>&1
  code=$?
  [ $code -eq 0 ] || status=1
  echo "$entry: ${packages%, }: $(grep -E '(passed|failed)' "$venv.log" | tail -1) (exit $code; log $venv.log)"
done
exit $status
