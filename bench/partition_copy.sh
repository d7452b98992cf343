#!/usr/bin/env bash
# Issue 12's partition copy: every partition of a loaded store exported and ingested into
# an empty one, in process, on 1 and 2 threads (`shoal bench copy`), and `dd` writing the
# same number of bytes sequentially with an fsync, on the same disk, in the same run.
# Needs a release build. Usage: bench/partition_copy.sh [runs] [docs] [extra bench-copy flags]
set -euo pipefail
runs=${1:-3}
docs=${2:-1500000}
shift $(( $# > 2 ? 2 : $# ))
. "$(dirname "$0")/lib.sh"
mb=$(( docs * 1060 / 1000000 ))
for i in $(seq "$runs"); do
  echo "--- run $i"
  echo "\$ shoal bench copy --dir $work --docs $docs $*"
  RUST_LOG=warn "$shoal" bench copy --dir "$work" --docs "$docs" "$@" 2>/dev/null
  echo "\$ dd if=/dev/zero of=$work/dd.bin bs=1M count=$mb conv=fsync"
  dd if=/dev/zero of="$work/dd.bin" bs=1M count="$mb" conv=fsync 2>&1 | tail -1
  rm -f "$work/dd.bin"
done
