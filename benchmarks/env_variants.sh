#!/usr/bin/env bash
# Run one benchmark under several environment settings, each in its own process; JSON lines
# labelled with the setting, appended to $OUT/LOG.
# Usage: bash benchmarks/env_variants.sh LOG "A=1 B=2" "A=0" ... -- SCRIPT ARGS...
# A setting of "base" runs SCRIPT under $BASE's sources (see h200_run.sh's ab steps) instead.
set -u
log=$1; shift
settings=()
while [ "$1" != "--" ]; do settings+=("$1"); shift; done
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for setting in "${settings[@]}"; do
  src=$PWD/src
  [ "$setting" = base ] && src=${BASE:?set BASE to the older build}/src
  env $([ "$setting" = base ] || echo "$setting") PYTHONPATH=$src:$PWD/benchmarks \
    python3 "$@" 2>&1 | grep '^{' | sed "s|^{|{\"setting\": \"$setting\", |" | tee -a "$OUT/$log"
done
