#!/usr/bin/env bash
# The CUDA checks of kvcache-rs on a machine with an NVIDIA GPU but no Rust toolchain and no
# network, from the bundle `cargo xtask cuda-bundle` builds (it writes this script beside the
# bundle as target/cuda-bundle/run.sh; its source is xtask/src/cuda/run.sh). From the
# repository root, with target/cuda-bundle/ copied there:
#
#   bash target/cuda-bundle/run.sh
#
# One command runs every piece, under one budget, in the order below: what the device's time
# must not miss first, so that a budget cut short loses the least. Each piece gets a timeout, a
# log and a line in $OUT/summary.tsv (piece, status, seconds, log); groups name them for reruns.
#   engine-kernel      [cache] the models' CUDA paged-attention kernel against the dense reference
#                      (paged_attention's test the_cuda_kernel_on_the_gpu...)
#   stand-ins          [serving] SmolLM2 and Gemma 3 stand-ins in $TMPDIR/kvcache-stand-ins
#                      (tools/stand_in fill): the model files exceed what a device step carries,
#                      so the bundle holds their skeletons (metadata, tokenizer, every tensor's
#                      shape and block type) and this fills them with seeded random weights: same
#                      shapes, same bytes per token, answers are noise
#   e6-e7-cuda         [serving] E6 then E7 (e6_e7_serving --mode both) against kvcache-server
#                      --device cuda on the SmolLM2 stand-in (its default weights there: candle's
#                      quantized kernels)
#   causal-bench-cuda  [cache] the causal bench (W1-W6, W1b, W2c) on the GPU, KVCACHE_BENCH_RUNS=3
#   e8-cuda            [cache] E8 on SmolLM2-135M's shape with random weights on the GPU, f32
#                      storage, paged and dense, KVCACHE_E8_RUNS=3
#   e5s-cuda           [serving] E5s (e5s_serving --mode both) against kvcache-server --device cuda
#                      on the Gemma 3 stand-in
#   causal-tests       [cache] kvcache-causal's test binaries with KVCACHE_DEVICE=cuda, one piece
#                      each (causal-tests/NAME), KVCACHE_BUNDLE_JOBS of them at once
#   e6-e7-cpu          [serving] E6 then E7 on this machine's CPU (--device cpu, its default
#                      weights), the run the GPU's TTFT and tokens/s are read against
#   causal-bench-cpu   [cache] the causal bench on this machine's CPU, for comparison
#   causal-bench-cuda-paged  [cache] the causal bench on the GPU with KVCACHE_BENCH_VIEW=paged:
#                      each op reads the runs a kernel walks (what the engine's passes read on
#                      CUDA), not the dense mask
#
# What comes back from a device step is at most 8 files under $OUT, so $OUT holds four: run.log
# (this script's output), summary.tsv, results.txt (what each serving driver reported) and
# logs.tar.gz (every piece's log, nvidia-smi's and ldd's; rewritten after each piece, so a step
# cut short still brings back what had finished).
#
# Knobs: OUT (a new temporary folder if unset), KVCACHE_BUNDLE_ONLY (pieces or groups to run,
# comma-separated: the names above, `cache`, `serving`; for a rerun of what a budget cut),
# KVCACHE_BUNDLE_BUDGET (seconds for all pieces together, 480: a piece that would start later
# is skipped, one running is cut short; a device step's 600 s less unpacking and margin),
# KVCACHE_BUNDLE_JOBS (test binaries at once, 8), KVCACHE_BUNDLE_DRY_RUN=1 (unpack, check the
# files, print ldd and the commands, run nothing: works without a GPU), KVCACHE_REPO_ROOT (the
# repository, if not two folders above this script or the current directory).
#
# The binaries were built in BUILD_ROOT (bundle manifest) and read fixtures there
# (env!("CARGO_MANIFEST_DIR")): when that path is not this repository, it is made a link to it.
# Exit status: 0 when every piece ran and passed (one the budget skipped fails the run; dry run:
# 0 when every check passed).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${KVCACHE_REPO_ROOT:-}" ]; then
    ROOT="$(cd "$KVCACHE_REPO_ROOT" && pwd)"
elif [ -f "$HERE/../../Cargo.toml" ] && [ -d "$HERE/../../crates/kvcache-causal" ]; then
    ROOT="$(cd "$HERE/../.." && pwd)"
else
    ROOT="$PWD"
fi
DRY="${KVCACHE_BUNDLE_DRY_RUN:-0}"
BUDGET="${KVCACHE_BUNDLE_BUDGET:-480}"
JOBS="${KVCACHE_BUNDLE_JOBS:-8}"
ONLY="${KVCACHE_BUNDLE_ONLY:-}"
if [ -z "${OUT:-}" ]; then
    OUT="$(mktemp -d "${TMPDIR:-/tmp}/kvcache-cuda-out.XXXXXX")"
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.tsv"
# Every log is written here and packed into $OUT/logs.tar.gz (see above).
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/kvcache-cuda-logs.XXXXXX")"
# shellcheck disable=SC2064
trap "rm -rf '$LOGS'" EXIT

# pack_logs: $OUT/logs.tar.gz anew from $LOGS (written aside, then renamed; pieces running at
# once each call it, and a log still being written is packed as far as it goes).
pack_logs() {
    local partial="$OUT/logs.tar.gz.$BASHPID"
    tar -czf "$partial" -C "$LOGS" . 2> /dev/null
    if [ -s "$partial" ]; then mv -f "$partial" "$OUT/logs.tar.gz"; else rm -f "$partial"; fi
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
seconds() { printf '%d.%d' $(( $1 / 1000 )) $(( ($1 % 1000) / 100 )); }
# wanted PIECE GROUP: whether KVCACHE_BUNDLE_ONLY (if set) names the piece or its group.
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]] || [[ ",$ONLY," == *",$2,"* ]]; }

# record PIECE STATUS MILLISECONDS LOG
record() {
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(seconds "$3")" "${4#"$LOGS"/}" >> "$SUMMARY"
    pack_logs
    printf '== %-34s %-16s %6ss\n' "$1" "$2" "$(seconds "$3")"
}

# piece NAME TIMEOUT LOG CRATE [VAR=VALUE...] -- PROGRAM [ARGS...]
# Runs PROGRAM as cargo would run a test or bench of CRATE (in its folder, CARGO_MANIFEST_DIR
# set) with the variables, under `timeout`, output to LOG, and records the result: ok,
# failed(RC), timeout(Ns) or skipped(budget). NEED_PASSED (a number) makes an exit status of 0
# count as ok only when the test harness said at least that many tests passed, and as
# ok-with-skips when a test printed that it skipped.
piece() {
    local name="$1" limit="$2" log="$3" dir="$BUNDLE_BUILD_ROOT/crates/$4"
    shift 4
    local envs=("CARGO_MANIFEST_DIR=$dir")
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
        envs+=("$1")
        shift
    done
    shift
    mkdir -p "$(dirname "$log")"
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 5 ]; then
        echo "skipped: the budget of ${BUDGET}s was spent" > "$log"
        record "$name" "skipped(budget)" 0 "$log"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "\$ cd $dir && timeout ${limit} env ${envs[*]} $*" > "$log"
    if [ "$DRY" = 1 ]; then
        echo "would run: cd $dir && timeout ${limit} env ${envs[*]} $*"
        record "$name" "dry-run" 0 "$log"
        return 0
    fi
    local t0 rc status
    t0="$(now_ms)"
    (cd "$dir" && exec timeout -k 10 "$limit" env "${envs[@]}" "$@") >> "$log" 2>&1
    rc=$?
    case "$rc" in
        0) status=ok ;;
        124 | 137) status="timeout(${limit}s)" ;;
        *) status="failed($rc)" ;;
    esac
    if [ "$rc" = 0 ] && [ -n "${NEED_PASSED:-}" ]; then
        local passed
        passed="$(grep -o 'test result: ok\. [0-9]* passed' "$log" | awk '{s += $4} END {print s + 0}')"
        [ "$passed" -lt "$NEED_PASSED" ] && status="ran-too-few($passed)"
        # A test that returns early says so (e.g. "skipped: KVCACHE_DEVICE is not cuda").
        [ "$status" = ok ] && grep -q '^skipped' "$log" && status="ok-with-skips"
    fi
    record "$name" "$status" "$(( $(now_ms) - t0 ))" "$log"
}

main() {
    local start_ms ok=1
    start_ms="$(now_ms)"
    printf 'piece\tstatus\tseconds\tlog\n' > "$SUMMARY"
    echo "cuda bundle: repository $ROOT, logs in $OUT$([ "$DRY" = 1 ] && echo ', DRY RUN')"

    # 1. Unpack.
    local unpack="${KVCACHE_BUNDLE_UNPACK:-}"
    if [ -z "$unpack" ]; then
        unpack="$(mktemp -d "${TMPDIR:-/tmp}/kvcache-cuda-bundle.XXXXXX")"
        # shellcheck disable=SC2064
        trap "rm -rf '$unpack'" EXIT
    fi
    local t0
    t0="$(now_ms)"
    if command -v xz > /dev/null; then
        xz -dc "$HERE/bundle.tar.xz" | tar -xf - -C "$unpack"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$HERE/bundle.tar.xz" "$unpack"
    fi
    # shellcheck disable=SC2181
    if [ "$?" != 0 ]; then
        echo "error: could not unpack $HERE/bundle.tar.xz into $unpack"
        record unpack "failed" "$(( $(now_ms) - t0 ))" run.log
        return 1
    fi
    record unpack ok "$(( $(now_ms) - t0 ))" run.log
    BIN="$unpack/bin"
    # shellcheck disable=SC1091
    . "$unpack/manifest.sh"
    echo "bundle: built $BUNDLE_BUILT from commit $BUNDLE_COMMIT ($BUNDLE_TREE) in $BUNDLE_BUILD_ROOT;" \
        "nvcc $BUNDLE_NVCC, compute capability $BUNDLE_COMPUTE_CAP"
    cp "$unpack/manifest.sh" "$LOGS/manifest.sh"

    # 2. Files: every binary the manifest lists and every one this script runs, the skeletons,
    #    the runtime.
    local missing=0 name
    for name in $BUNDLE_BINARIES $BUNDLE_SKELETONS lib/libcudart.so.13 bin/models/paged_attention \
        bin/bench/causal bin/bench/e8 bin/server/kvcache-server bin/server/e6_e7_serving \
        bin/server/e5s_serving bin/tools/stand_in models/smollm2.skeleton.gguf \
        models/gemma3.skeleton.gguf; do
        [ -f "$unpack/$name" ] || { echo "error: the bundle lacks $name"; missing=1; }
    done
    ls "$BIN"/causal-tests/* > /dev/null 2>&1 || { echo "error: the bundle has no causal tests"; missing=1; }
    # shellcheck disable=SC2086
    echo "files: $(echo $BUNDLE_BINARIES | wc -w) executables, skeletons $BUNDLE_SKELETONS"

    # 3. The compile-time repository path (fixtures, snapshots) must lead to this tree.
    local build_root="$BUNDLE_BUILD_ROOT"
    if [ "$(cd "$build_root" 2>/dev/null && pwd -P)" = "$(cd "$ROOT" && pwd -P)" ]; then
        echo "paths: $build_root is this repository"
    elif [ -e "$build_root" ] && [ ! -L "$build_root" ]; then
        echo "error: $build_root exists and is another tree: the binaries would read its fixtures"
        missing=1
    elif [ "$DRY" = 1 ]; then
        echo "paths: would link $build_root -> $ROOT (dry run: not done)"
    elif mkdir -p "$(dirname "$build_root")" && ln -sfn "$ROOT" "$build_root"; then
        echo "paths: linked $build_root -> $ROOT"
    else
        echo "error: could not link $build_root -> $ROOT: fixture paths will not resolve"
        missing=1
    fi
    for name in fixtures/causal fixtures/e1_trace.json fixtures/e5_trace.json crates/kvcache-causal/tests/snapshots; do
        [ -e "$ROOT/$name" ] || { echo "error: the repository lacks $name"; missing=1; }
    done
    export INSTA_WORKSPACE_ROOT="$build_root"
    export INSTA_UPDATE=no
    export RUST_BACKTRACE=1

    # 4. Libraries: the bundle's libcudart; the driver's libcuda, and libnvrtc, libcublas,
    #    libcublasLt, libcurand from the machine's CUDA install, looked for where CUDA
    #    usually lives when the loader does not find them.
    export LD_LIBRARY_PATH="$unpack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local probe="$BIN/models/paged_attention" lib dir found
    for lib in $(ldd "$probe" 2>/dev/null | awk '/=> not found/ {print $1}'); do
        ldd "$probe" 2>/dev/null | grep -q "$lib => not found" || continue # found with another's folder
        found=""
        for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
            /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
            /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
            [ -e "$dir/$lib" ] && { found="$dir/$lib"; break; }
        done
        if [ -z "$found" ]; then # e.g. a pip-installed nvidia-cublas in site-packages
            found="$(timeout 15 find /usr /opt -maxdepth 8 -name "$lib" -print -quit 2>/dev/null)"
        fi
        if [ -n "$found" ]; then
            echo "libraries: $lib found in ${found%/*}"
            export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:${found%/*}"
        fi
    done
    {
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        ldd "$probe"
    } > "$LOGS/ldd.log" 2>&1
    echo "ldd $probe:"
    sed 's/^/    /' "$LOGS/ldd.log"
    if grep -q 'not found' "$LOGS/ldd.log"; then
        echo "MISSING LIBRARIES: $(awk '/not found/ {printf "%s ", $1}' "$LOGS/ldd.log")-- the CUDA" \
            "binaries cannot start without them (libcuda.so.1 comes with the NVIDIA driver;" \
            "libnvrtc, libcublas, libcublasLt, libcurand with the CUDA toolkit)"
        [ "$DRY" = 1 ] || ok=0
    fi
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi > "$LOGS/nvidia-smi.log" 2>&1
        nvidia-smi -L 2>&1 | head -4
    else
        echo "nvidia-smi: not on PATH"
    fi
    pack_logs
    if [ "$missing" = 1 ]; then
        echo "error: files are missing (above); running nothing"
        return 1
    fi

    # 5. The pieces, in the order the header gives, under one budget. The stand-in models are
    #    not under $OUT or $LOGS: they are hundreds of MB.
    DEADLINE=$(( $(date +%s) + BUDGET ))
    echo "pieces: budget ${BUDGET}s"
    local models="${TMPDIR:-/tmp}/kvcache-stand-ins"
    local smollm2="$models/smollm2.gguf" gemma3="$models/gemma3.gguf"
    mkdir -p "$models"
    # e6_e7 DEVICE LIMIT: E6 then E7 against kvcache-server --device DEVICE, SmolLM2 stand-in.
    e6_e7() {
        piece "e6-e7-$1" "$2" "$LOGS/e6-e7-$1.log" kvcache-server RUST_LOG=warn KVCACHE_MODEL="$smollm2" -- \
            "$BIN/server/e6_e7_serving" --server-bin "$BIN/server/kvcache-server" --mode both --device "$1"
    }
    # causal_bench NAME LIMIT [VAR=VALUE...]: the causal bench (W1-W6, W1b, W2c), 3 runs.
    causal_bench() {
        local name="$1" limit="$2"
        shift 2
        piece "$name" "$limit" "$LOGS/$name.log" kvcache-causal KVCACHE_BENCH_RUNS=3 "$@" -- \
            "$BIN/bench/causal" --bench
    }
    if wanted engine-kernel cache; then
        NEED_PASSED=1 piece engine-kernel 60 "$LOGS/engine-kernel.log" kvcache-models KVCACHE_DEVICE=cuda -- \
            "$BIN/models/paged_attention" the_cuda_kernel_on_the_gpu --nocapture
    fi
    if wanted stand-ins serving; then
        piece stand-ins 90 "$LOGS/stand-ins.log" kvcache-models -- bash -c \
            "'$BIN/tools/stand_in' fill '$unpack/models/smollm2.skeleton.gguf' '$smollm2' 1 && \
             '$BIN/tools/stand_in' fill '$unpack/models/gemma3.skeleton.gguf' '$gemma3' 1"
    fi
    if wanted e6-e7-cuda serving; then
        e6_e7 cuda 180
    fi
    if wanted causal-bench-cuda cache; then
        causal_bench causal-bench-cuda 90 KVCACHE_DEVICE=cuda
    fi
    if wanted e8-cuda cache; then
        piece e8-cuda 120 "$LOGS/e8-cuda.log" kvcache-bench \
            KVCACHE_DEVICE=cuda KVCACHE_E8_WEIGHTS=random KVCACHE_E8_KV=f32 KVCACHE_E8_RUNS=3 -- \
            "$BIN/bench/e8" --bench
    fi
    if wanted e5s-cuda serving; then
        piece e5s-cuda 120 "$LOGS/e5s-cuda.log" kvcache-server -- \
            "$BIN/server/e5s_serving" --server-bin "$BIN/server/kvcache-server" --gemma "$gemma3" \
            --mode both --device cuda
    fi
    if wanted causal-tests cache; then
        local test running=0
        for test in "$BIN"/causal-tests/*; do
            NEED_PASSED=1 piece "causal-tests/${test##*/}" 120 "$LOGS/causal-tests/${test##*/}.log" \
                kvcache-causal KVCACHE_DEVICE=cuda -- "$test" &
            running=$(( running + 1 ))
            if [ "$running" -ge "$JOBS" ]; then
                wait -n
                running=$(( running - 1 ))
            fi
        done
        wait
    fi
    if wanted e6-e7-cpu serving; then
        e6_e7 cpu 180
    fi
    if wanted causal-bench-cpu cache; then
        causal_bench causal-bench-cpu 60 KVCACHE_DEVICE=cpu
    fi
    if wanted causal-bench-cuda-paged cache; then
        causal_bench causal-bench-cuda-paged 90 KVCACHE_DEVICE=cuda KVCACHE_BENCH_VIEW=paged
    fi
    for name in e6-e7-cuda e5s-cuda e6-e7-cpu; do
        [ -f "$LOGS/$name.log" ] || continue
        { echo "== $name"; grep -E '^(E[0-9]|trace|  )' "$LOGS/$name.log"; echo; } >> "$OUT/results.txt"
    done

    echo
    echo "summary ($SUMMARY), $(seconds $(( $(now_ms) - start_ms )))s in all:"
    column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
    if awk -F'\t' 'NR > 1 && $2 != "ok" && $2 != "ok-with-skips" && $2 != "dry-run" {bad = 1} END {exit !bad}' "$SUMMARY"; then
        ok=0
    fi
    [ "$ok" = 1 ]
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
