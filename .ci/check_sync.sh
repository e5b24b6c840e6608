#!/usr/bin/env bash
# Fails when nbdev-clean or nbdev-export would change any file: the notebooks are the source,
# eformer_nb/ is their export, and both are committed clean. Names every file they touched.
set -euo pipefail
bin=${1:-.venv/bin}
snapshot() { git status --porcelain; git ls-files -m -o --exclude-standard | sort | xargs -r sha1sum; }
before=$(snapshot)
"$bin/nbdev-clean"
"$bin/nbdev-export"
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "ERROR: nbdev-clean/nbdev-export changed files (notebook edited without export, hand-edited"
  echo "eformer_nb/, or an uncleaned notebook). Export and clean, then commit. Files touched:"
  diff <(echo "$before") <(echo "$after") | sed -n 's/^[<>] *\([0-9a-f]\{40\}\)\? *//p' | awk '{print "  " $NF}' | sort -u
  exit 1
fi
echo "notebooks, package and cleaning agree"
