#!/usr/bin/env bash
# The weekly fuzz job: builds every target in fuzz/fuzz_targets and runs each in turn.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]      (default: 60 s, every target)
#
# Installs a nightly toolchain and cargo-fuzz when they are missing. Without nightly (rustup's
# server unreachable) it builds on stable with RUSTC_BOOTSTRAP=1 and no sanitizer: libFuzzer
# still runs and panics are still found, but memory errors in unsafe code go unseen.
# Stops at the first crash, leak, slow unit (FUZZ_UNIT_TIMEOUT_SECS, default 10) or
# out-of-memory with exit 1, printing the input's path and the command that replays it.
# Builds go to FUZZ_TARGET_DIR (default ~/.cache/shoal-fuzz-target), never to the workspace's
# target dir; corpora grow in fuzz/corpus/<target>, findings land in fuzz/artifacts/<target>.
set -euo pipefail
cd "$(dirname "$0")"

secs="${1:-${FUZZ_SECONDS:-60}}"
[ $# -gt 0 ] && shift
case "$secs" in
    '' | *[!0-9]*)
        echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2
        exit 2
        ;;
esac
unit_timeout="${FUZZ_UNIT_TIMEOUT_SECS:-10}"
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$HOME/.cache/shoal-fuzz-target}"
export CARGO_TERM_COLOR=never

toolchain=(+nightly)
build_flags=(--debug-assertions)
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "== installing a nightly toolchain"
    if ! rustup toolchain install nightly --profile minimal; then
        echo "== no nightly toolchain to be had: building on stable with RUSTC_BOOTSTRAP=1 and no sanitizer" >&2
        toolchain=()
        build_flags+=(--sanitizer none)
        export RUSTC_BOOTSTRAP=1
    fi
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi
# The fuzz crate is outside the workspace; start from the workspace's versions so that it
# fuzzes the dependencies the node ships with.
[ -f Cargo.lock ] || cp ../Cargo.lock Cargo.lock

if [ $# -gt 0 ]; then
    targets=("$@")
else
    targets=()
    for f in fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi
for t in "${targets[@]}"; do
    [ -f "fuzz_targets/$t.rs" ] || { echo "no fuzz target $t (see fuzz/fuzz_targets)" >&2; exit 2; }
done

echo "== $(cargo "${toolchain[@]}" --version); $(cargo fuzz --version); building ${#targets[@]} targets (${build_flags[*]})"
for t in "${targets[@]}"; do
    cargo "${toolchain[@]}" fuzz build "${build_flags[@]}" "$t"
done

logs="$CARGO_TARGET_DIR/fuzz-logs"
mkdir -p "$logs"
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    log="$logs/$t.log"
    echo "== $t: ${secs} s (log: $log)"
    set +e
    cargo "${toolchain[@]}" fuzz run "${build_flags[@]}" "$t" -- \
        -max_total_time="$secs" -timeout="$unit_timeout" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    if [ "$rc" -ne 0 ]; then
        tail -n 60 "$log"
        crash="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)"
        [ -n "$crash" ] || crash="$(ls -t "artifacts/$t"/* 2>/dev/null | head -n 1 || true)"
        if [ -n "$crash" ]; then
            crash="$(cd "$(dirname "$crash")" && pwd)/$(basename "$crash")"
            echo "== FAILED: $t found a crash: $crash" >&2
            echo "== replay: (cd $(pwd) && ${RUSTC_BOOTSTRAP:+RUSTC_BOOTSTRAP=1 }cargo ${toolchain[*]} fuzz run ${build_flags[*]} $t $crash)" >&2
        else
            echo "== FAILED: $t exited with $rc and left no input (see $log)" >&2
        fi
        exit 1
    fi
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)|^Done ' "$log" | tr '\n' ' '
    echo
done
echo "== every target ran ${secs} s without a crash"
