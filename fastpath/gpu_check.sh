#!/usr/bin/env bash
# Everything a GPU must show, on one H100 or H200, in stages of under ten minutes each (each step has its own
# time limit):
#
#     bash fastpath/gpu_check.sh results/decode_e2e.json                 # the default stages: bench tests hf
#     bash fastpath/gpu_check.sh results/decode_e2e.json tests compare   # one call per few stages
#     bash fastpath/gpu_check.sh results/decode_e2e.json smollm2
#
#   bench    python -m fastpath.bench --e2e: the lean, graph, fused and skinny steps, full cache vs keep 0.1 for
#            SnapKV, StreamingLLM, H2O and Scissorhands, TINYLLAMA_1B shape in bf16, 16 x 8,192 and
#            16 x 32,768 tokens, the copy bandwidth measured in the same run, transformers' StaticCache step
#            (eager), the split kernel's launch first timed and chosen at each length, on the full cache's
#            slots and a tenth's (fastpath/tune.py), and the skinny kernel's on each product of the step, beside
#            cuBLAS's; the report, with provenance, to OUT, written after each length (a 400 s limit; 64 s on
#            an H200 for three paths without Scissorhands or tuning); BENCH_PATHS="fused skinny" times only
#            those steps (--paths);
#   smolbench  the same for SmolLM2-135M's shape (random weights) with 1 and 16 sequences of 2,048 and 8,192
#            tokens, to OUT's .smollm2_b1.json and .smollm2_b16.json siblings (2 x 90 s; the split kernel's
#            launch not tuned: --no-tune, as it was measured);
#   tests    the tests a GPU changes: tests/fastpath (the graph and fused steps captured and replayed on CUDA,
#            compared with the lean step; the split-K kernel in both) and tests/kernels, their output also to
#            OUT's .tests.txt sibling (200 s, then an interrupt, on which pytest still prints what ran and
#            failed; 65 s on an H200 before the tests of the evictions' kernels; TESTS="PATHS" runs those
#            test files instead);
#   hf       transformers' StaticCache step under torch.compile(mode="reduce-overhead") at 8,192 tokens, to
#            OUT's .hf_compiled_8192.json sibling; a compile that runs out of its time says so (70 s);
#   profile  the skinny step's kernels per method (PROFILE_PATH=fused: the fused step's), 8,192 and 32,768
#            tokens (python -m fastpath.profile), the kernels tuned as the bench tunes them: each kernel's
#            launches and device time per step, to OUT's .profile.txt sibling (250 s);
#   compare  the bundled model's main job (COMPARE_SAMPLES samples, default 2) on the CPU (a worker per core, the fast engine) and on the
#            GPU (a worker per core sharing it, with the batched engine, then with one group), their records
#            checked equal (experiments.evaluation.agree) and their seconds printed, JSON files to OUT's .compare/
#            sibling (3 x 60 s + 2 x 20 s; one process on the GPU did not finish in 90 s on an H200, so
#            none by default); COMPARE_RUNS="DEVICE WORKERS
#            ENGINE [VAR=VALUE,...]; ..." names other runs (DEVICE cuda is the CPU in a dry run; the first run is
#            the one the others are checked against; a fourth word sets variables for that run, comma-separated,
#            as NANOKV_NO_TRITON=1: PyTorch's attention and sketch instead of the Triton kernels; MPS=1: the
#            run's processes share the GPU through NVIDIA's Multi-Process Service, a daemon of this script's
#            own, quit after the run; skipped where it cannot start; TOGETHER=K: experiments.compare --together K,
#            each process stepping K samples side by side), COMPARE_LIMIT another limit per run in seconds;
#   launches one job of the bundled model's main job with each engine, on the GPU then on the CPU: its tensor
#            operations and the host's waits by phase and method (experiments.evaluation.launches), and its time
#            uncounted, so the cost of one operation on each device; reports to OUT's .launches/ (4 x 60 s);
#   smollm2  SmolLM2-135M's main job (2,048 tokens, 30 samples per task and mode) on the GPU in
#            SMOLLM2_WORKERS processes with the SMOLLM2_ENGINE engine (defaults: experiments.compare's own, one
#            group and the workers its memory holds) for at most SMOLLM2_LIMIT seconds (300), through MPS
#            where SMOLLM2_MPS=1 (as compare's MPS=1; without it, saying so, where it cannot start), each
#            process stepping SMOLLM2_TOGETHER samples side by side (default 1), where its file is here
#            (below), checked
#            against the committed CPU run results/compare_smollm2.json (30 s to fetch, 300 s, 20 s);
#   suite    the whole fast tier (python -m pytest -q) on the CUDA machine, with the packages the image lacks
#            installed from .gpu_cache/wheels where that folder is carried (fastpath/gpu_wheels.sh) (60 s),
#            and the project installed as the README's set-up does (pip install -e ., without its dependencies),
#            its output also to OUT's .suite.txt sibling (400 s, then an interrupt: pytest prints what ran),
#            in SUITE_WORKERS processes (8; pytest-xdist, among the wheels, a test file to a process);
#            SUITE_ARGS="--runslow" runs the slow tier (what CI runs; a dry run on 2 CPU cores in 2 processes
#            passed in 688 s; CI, in one, 1,204 s with the book; its longest files, as CI runs them, are
#            tests/course/test_grader_hostile.py and tests/notebooks/test_notebooks.py, 131 s and 125 s on this
#            project's 2 cores), SUITE_LIMIT another limit in seconds.
#            JupyterLab is not among the wheels: with what it needs (30 MB) beside the tree (21 MB) and the
#            wheels (25 MB) it is over what a call carries, so on a lent machine the slow tier's
#            test_jupyterlab_is_installed fails for that alone. Nor is SmolLM2's file there: the notebooks and
#            tests that load the model skip.
#            Its Triton (3.6) and numpy (2.5) clash in Triton's interpreter, where the course grades the kernels
#            and kvreviver assignments: those grades skip, saying why (kernels.interpreter_problem).
#
# SmolLM2's file (98 MB, 90 MB compressed) is over what one call to a lent machine carries (64 MiB, the
# working tree's 20 MB included). Compress and split it into the ignored folder .gpu_cache/ here:
#     xz -T2 -6 -c ~/.cache/nanollm/smollm2-135m/*.gguf > /tmp/smollm2.xz && split -n 2 /tmp/smollm2.xz .gpu_cache/smollm2.xz.
# then carry .gpu_cache/smollm2.xz.aa in one call and .gpu_cache/smollm2.xz.ab in the next (a warm machine
# keeps the first): the smollm2 stage joins the parts, decompresses them and fetches the model.
#
# Every number it prints is the device's it ran on (the reports name it). GPU_CHECK_DEVICE=cpu runs a stage's
# commands on the CPU instead (a dry run of the script before a lent machine's minutes are spent on it; bench
# and profile then take their tiny --quick shapes: tests, bench and profile together took 56 s on 2 cores).
# On a lent machine (this project's: 15 minutes a session, the machine started by the first call, calls of at
# most ten minutes, each carrying the tree and the ignored paths it names, 64 MiB in all, and sending back what
# is under $OUT), the next lease's calls, in this order, as far as the minutes go; each ends the script within
# the call with a timeout and sends back one archive:
#   1. the bench, the skinny step beside the fused one (the lean and graph steps left out for time): the skinny
#      step's time and its rows' logits_vs (do its never-run kernels give the fused step's logits?), and
#      whether the targets of keep 0.1 move with the launch now tuned on a tenth's slots too;
#   2. with what the status says is left, less a minute, the whole slow tier, carrying .gpu_cache/wheels;
#   3. in a lease after: the profile (what is left of the fixed cost), carrying .gpu_cache/smollm2.xz.aa; then
#      SmolLM2's main job with the command's defaults, carrying .gpu_cache/smollm2.xz.ab (the warm machine
#      keeps the first part).
#     BENCH_PATHS="fused skinny" timeout -k 5 420 bash fastpath/gpu_check.sh /tmp/g1/decode_e2e.json bench; tar -C /tmp/g1 -czf $OUT/call1.tgz .
#     SUITE_ARGS=--runslow SUITE_LIMIT=300 timeout -k 5 390 bash fastpath/gpu_check.sh /tmp/g0/decode_e2e.json suite; tar -C /tmp/g0 -czf $OUT/call0.tgz .
#     timeout -k 5 300 bash fastpath/gpu_check.sh /tmp/g2/decode_e2e.json profile; tar -C /tmp/g2 -czf $OUT/call2.tgz .
#     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True SMOLLM2_MPS=1 SMOLLM2_LIMIT=240 timeout -k 5 400 bash fastpath/gpu_check.sh /tmp/g3/decode_e2e.json smollm2; tar -C /tmp/g3 -czf $OUT/call3.tgz .
# Then: call 1's report, which has only the fused and skinny steps, goes beside results/decode_e2e_h200.json
# (whose lean and graph steps lesson 07 plots) as results/decode_e2e_h200_skinny.json, named in
# tests/test_results_reproduce.py's CHECKED_BY, its summary (python -m fastpath.bench --summary) added to
# results/decode_e2e_h200_summary.txt (test_the_committed_summaries_are_what_summary_prints reads them), and
# fastpath/README.md's targets table and lesson 07's section 6.3 say what it changed.
#
set -uo pipefail
export PYTHONUNBUFFERED=1
out=$(realpath -m "${1:?usage: bash fastpath/gpu_check.sh OUT.json [bench] [smolbench] [tests] [hf] [profile] [compare] [launches] [smollm2] [suite]}")
shift
stages=("${@:-bench tests hf}")
stages=(${stages[*]})
for s in "${stages[@]}"; do
    case "$s" in bench|smolbench|tests|hf|profile|compare|launches|smollm2|suite) ;; *) echo "unknown stage '$s': bench, smolbench, tests, hf, profile, compare, launches, smollm2, suite"; exit 2;; esac
done
gpu=${GPU_CHECK_DEVICE:-cuda}
case "$gpu" in cuda|cuda:[0-9]*|cpu) ;; *) echo "GPU_CHECK_DEVICE=$gpu: cuda (the default, or cuda:N) or cpu"; exit 2;; esac
# A signal to this script reaches the stage it runs: the script runs again in a session of its own, which
# this one ends as a whole (the stage's processes, timeout's too) on SIGTERM or SIGINT, and waits for.
if [ -z "${GPU_CHECK_INNER:-}" ] && command -v setsid > /dev/null && command -v pkill > /dev/null; then
    GPU_CHECK_INNER=1 setsid bash "$(realpath "$0")" "$out" "${stages[@]}" &
    inner=$!
    trap 'pkill -TERM -s "$inner" 2> /dev/null; wait "$inner"; exit 143' TERM INT
    wait "$inner"
    exit $?
fi
cd "$(dirname "$0")/.."                      # the repository root
mkdir -p "$(dirname "$out")"                 # OUT's folder, for every stage's files
if [ "$gpu" = cuda ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU')" || exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" || true
python -c "import transformers; print('transformers', transformers.__version__)" || true
echo "stages: ${stages[*]}"
status=0
mps_dir=""
mps_start() {
    # NVIDIA's Multi-Process Service for one run, where the machine has it: a control daemon of this script's
    # own (its pipes and logs in a temporary folder) through which the processes sharing the GPU run their
    # kernels side by side, where without it they take turns in time slices. It changes no setting of the
    # GPU, and is quit after the run (and when the script exits). Fails, its log printed, where a CUDA
    # context cannot be made through it, or one is made without it (a client that cannot reach the daemon
    # runs as without MPS): the daemon must then list the server that serves that context.
    [ "$gpu" = cuda ] && command -v nvidia-cuda-mps-control > /dev/null || return 1
    mps_dir=$(mktemp -d)
    export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # the daemon without this script's output streams: one left holding them would hold the call open
    if ! nvidia-cuda-mps-control -d < /dev/null > /dev/null 2>&1 \
        || ! timeout -k 5 30 python -c "import torch; torch.zeros(1, device='cuda')" \
        || [ -z "$(echo get_server_list | timeout 10 nvidia-cuda-mps-control 2> /dev/null)" ]; then
        echo "MPS: no server serves a CUDA context through the daemon"
        mps_stop log
        return 1
    fi
}
mps_stop() {                                   # "log": print the daemon's logs first
    [ -n "$mps_dir" ] || return 0
    [ "${1:-}" = log ] && tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/*.log 2> /dev/null
    echo quit | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1
    for _ in $(seq 30); do                     # until the daemon is gone (its control pipe removed)
        [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break
        sleep 1
    done
    rm -rf "$mps_dir"
    mps_dir=""
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap mps_stop EXIT
device=$(python -c "import torch; print('the CPU (dry run)' if '$gpu' == 'cpu' else torch.cuda.get_device_name('$gpu'))")

bench() {
    echo "== bench: end-to-end decode steps -> $out"
    timeout -k 10 400 python -m fastpath.bench --e2e --json "$out" $([ "$gpu" = cpu ] && echo --quick) \
        $([ -n "${BENCH_PATHS:-}" ] && echo --paths $BENCH_PATHS) \
        || { echo "e2e FAILED or ran out of time (rc $?)"; status=1; }
}

smolbench() {
    for batch in 1 16; do
        smol="${out%.json}.smollm2_b$batch.json"
        echo "== bench (cont.) SmolLM2-135M's shape, $batch sequences of 2,048 and 8,192 tokens -> $smol"
        timeout -k 10 90 python -m fastpath.bench --e2e --no-tune --preset SMOLLM2_135M --batch "$batch" --length 2048 8192 \
            --json "$smol" || { echo "SmolLM2 e2e FAILED or ran out of time (rc $?)"; status=1; }
    done
}

tests() {
    local txt="${out%.json}.tests.txt"
    mkdir -p "$(dirname "$txt")"
    echo "== tests: ${TESTS:-tests/fastpath tests/kernels} on $device -> $txt"
    timeout -s INT -k 10 200 python -m pytest -q -rs -p no:cacheprovider ${TESTS:-tests/fastpath tests/kernels} 2>&1 | tee "$txt" \
        || { echo "tests FAILED or ran out of time (rc $?)"; status=1; }
}

hf() {
    local hf="${out%.json}.hf_compiled_8192.json"
    echo "== hf: transformers' StaticCache step at 8192 tokens, compiled -> $hf"
    timeout -k 10 70 python -m fastpath.bench --e2e --hf-only --hf-compile --length 8192 --json "$hf" \
        || echo "transformers compiled step at 8192: not timed (rc $?: failed, or its compile ran past 70 s)"
}

profile() {
    local txt="${out%.json}.profile.txt"
    mkdir -p "$(dirname "$txt")"
    echo "== profile: the ${PROFILE_PATH:-skinny} step's kernels per method -> $txt"
    # the four caches its 250 s were planned for (Scissorhands' too by hand: python -m fastpath.profile)
    timeout -k 10 250 python -m fastpath.profile --out "$txt" --path "${PROFILE_PATH:-skinny}" \
        --methods full snapkv streaming_llm h2o \
        $([ "$gpu" = cpu ] && echo --quick) > "$txt.log" 2>&1 \
        || { echo "profile FAILED or ran out of time (rc $?)"; status=1; }
    grep -E "tokens: " "$txt.log"
}

compare() {
    local dir="${out%.json}.compare" first=""
    mkdir -p "$dir"
    # the CPU with a worker per core (its default), the GPU with a worker per core sharing it (experiments.compare's
    # default there), groups by size then one group: a step of the evaluation is launch-bound, so processes
    # launching side by side fill the GPU better
    local many=$(nproc)                                          # --workers is at most the CPU cores
    local runs=${COMPARE_RUNS:-"cpu $(nproc) fast; $gpu $many batched; $gpu $many one-group"}
    local list
    IFS=';' read -ra list <<< "$runs"
    for run in "${list[@]}"; do
        set -- $run
        [ "$1" = cuda ] && set -- "$gpu" "${@:2}"            # a dry run (GPU_CHECK_DEVICE=cpu) on the CPU
        local setting=${4:-} json="$dir/bundled_$1_$2_$3${4:+_${4//[=,]/_}}.json" envs=() together=1 mps=0
        local kv
        for kv in ${setting//,/ }; do                            # MPS=1 and TOGETHER=K here, the rest to env
            case "$kv" in MPS=1) mps=1;; TOGETHER=*) together=${kv#TOGETHER=};; *) envs+=("$kv");; esac
        done
        echo "== compare: the bundled model's main job, ${COMPARE_SAMPLES:-2} samples, --device $1 --workers $2 --engine $3 ${setting:+($setting) }-> $json"
        if [ "$mps" = 1 ] && ! mps_start; then
            echo "MPS=1: no MPS control daemon could start here (nvidia-cuda-mps-control, on a GPU): run skipped"
            [ -n "$first" ] || echo "(the next run is the one the others are checked against)"
            continue
        fi
        local t0=$SECONDS
        rm -f "$json"
        # output to a file, not a pipe (a worker left behind would hold a pipe open); timeout signals the
        # command's whole process group (its workers too), and sends SIGKILL 10 s after SIGTERM
        env ${envs[@]+"${envs[@]}"} timeout -k 10 "${COMPARE_LIMIT:-60}" python -m experiments.compare --samples "${COMPARE_SAMPLES:-2}" --device "$1" --workers "$2" --engine "$3" --together "$together" --json "$json" --quiet \
            > "$json.log" 2>&1 || { echo "compare on $1 FAILED or ran out of time (rc $?)"; status=1; }
        tail -n 3 "$json.log"
        echo "--device $1 --workers $2 --engine $3${setting:+ $setting}: $((SECONDS - t0)) s wall"
        mps_stop $([ -f "$json" ] || echo log)
        if [ ! -f "$json" ]; then :                            # nothing to check
        elif [ -z "$first" ]; then first=$json
        else timeout -k 5 20 python -m experiments.evaluation.agree "$first" "$json" | tail -n 6 || status=1; fi
    done
}

smollm2() {
    local dir="${out%.json}.compare"
    mkdir -p "$dir"
    local many=${SMOLLM2_WORKERS:-}
    # the usual cache (python -m nanollm.cli.fetch smollm2-135m); else .gpu_cache/models, fetched there by an
    # earlier call or now from two compressed parts (the top of this script); that folder is set for these
    # commands only (later stages keep theirs)
    local here="from nanollm.io.checkpoint import load_config; load_config('smollm2-135m')"
    local models=${NANOLLM_CACHE:-}
    if ! python -c "$here" 2>/dev/null; then models=$PWD/.gpu_cache/models; fi
    if ! NANOLLM_CACHE=$models python -c "$here" 2>/dev/null && [ -f .gpu_cache/smollm2.xz.aa ] && [ -f .gpu_cache/smollm2.xz.ab ]; then
        cat .gpu_cache/smollm2.xz.aa .gpu_cache/smollm2.xz.ab \
            | timeout -k 5 60 python -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
            > .gpu_cache/smollm2.gguf || { echo "smollm2: the parts did not decompress"; rm -f .gpu_cache/smollm2.gguf; status=1; return; }
        NANOLLM_CACHE=$models timeout -k 10 30 python -m nanollm.cli.fetch smollm2-135m --from .gpu_cache/smollm2.gguf || status=1
    fi
    if ! NANOLLM_CACHE=$models python -c "$here" 2>/dev/null; then
        echo "smollm2: SmolLM2-135M is not here (both parts .gpu_cache/smollm2.xz.aa and .ab: the top of this" \
             "script): its main job not run"
        status=1
    else
        # through MPS where asked and it starts; where it cannot, the job runs without it (a lent machine's
        # call is too scarce to spend on nothing), saying so
        if [ "${SMOLLM2_MPS:-0}" = 1 ] && ! mps_start; then
            echo "SMOLLM2_MPS=1: no MPS control daemon could start here (nvidia-cuda-mps-control, on a GPU): the job runs without it"
        fi
        echo "== smollm2: SmolLM2-135M's main job on $device, ${many:-the default number of} processes, ${SMOLLM2_ENGINE:-the default} engine, ${SMOLLM2_TOGETHER:-1} sample(s) together${mps_dir:+, through MPS} -> $dir/smollm2_$gpu.json"
        local t0=$SECONDS
        rm -f "$dir/smollm2_$gpu.json"
        # the progress bar to a file beside the report: a run stopped at its time limit still says how far it got
        NANOLLM_CACHE=$models timeout -k 10 "${SMOLLM2_LIMIT:-300}" python -m experiments.compare --checkpoint smollm2-135m \
            --device "$gpu" ${many:+--workers "$many"} ${SMOLLM2_ENGINE:+--engine "$SMOLLM2_ENGINE"} --together "${SMOLLM2_TOGETHER:-1}" --json "$dir/smollm2_$gpu.json" > "$dir/smollm2_$gpu.log" \
            2> "$dir/smollm2_${gpu}_progress.txt" || { echo "SmolLM2 compare FAILED or ran out of time (rc $?)"; status=1; }
        tail -n 3 "$dir/smollm2_$gpu.log"
        echo "SmolLM2's main job: $((SECONDS - t0)) s wall; the end of its progress bar and errors:"
        tail -c 1000 "$dir/smollm2_${gpu}_progress.txt" | tr '\r' '\n' | grep . | tail -n 4
        mps_stop $([ -f "$dir/smollm2_$gpu.json" ] || echo log)
        if [ -f "$dir/smollm2_$gpu.json" ]; then
            timeout -k 5 20 python -m experiments.evaluation.agree results/compare_smollm2.json "$dir/smollm2_$gpu.json" | tail -n 12 || status=1
        fi
    fi
}

launches() {
    local dir="${out%.json}.launches"
    mkdir -p "$dir"
    for run in "$gpu fast" "$gpu batched" "cpu fast" "cpu batched"; do
        set -- $run
        echo "== launches: one job of the bundled model's main job, --device $1 --engine $2 -> $dir/bundled_$1_$2.txt"
        timeout -k 10 60 python -m experiments.evaluation.launches --device "$1" --engine "$2" --out "$dir/bundled_$1_$2.txt" \
            > "$dir/bundled_$1_$2.log" 2>&1 || { echo "launches on $1 FAILED or ran out of time (rc $?)"; status=1; }
        tail -n 4 "$dir/bundled_$1_$2.log"
    done
}

suite() {
    local txt="${out%.json}.suite.txt"
    mkdir -p "$(dirname "$txt")"
    # the packages the suite needs that the image lacks, carried as wheels (fastpath/gpu_wheels.sh)
    if [ -d .gpu_cache/wheels ] && ls .gpu_cache/wheels/*.whl >/dev/null 2>&1; then
        timeout -k 5 60 python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu_cache/wheels/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH \
            || echo "suite: the carried wheels did not install"
    else
        echo "suite: no wheels carried (fastpath/gpu_wheels.sh): the tests of the notebooks, the linter and GGUF will fail"
    fi
    # the project itself, as the README's set-up installs it: a slow test imports it from another folder
    PIP_BREAK_SYSTEM_PACKAGES=1 timeout -k 5 60 python -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || echo "suite: pip install -e . failed: the tests that import the library from another folder will fail"
    # SUITE_WORKERS processes where pytest-xdist is importable (it is among the wheels; default 8, 0 for one), a
    # test file's tests all in one of them (--dist loadfile): a module's fixture, as the one that runs every
    # notebook at once, would otherwise run again in each process that draws one of its tests
    local workers=${SUITE_WORKERS:-8} parallel=()
    if [ "$workers" -gt 1 ] && python -c "import xdist" 2> /dev/null; then
        parallel=(-n "$workers" --dist loadfile)
    elif [ "$workers" -gt 1 ]; then
        echo "suite: pytest-xdist is not installed (fastpath/gpu_wheels.sh): the tests run in one process"
    fi
    echo "== suite: python -m pytest -q ${parallel[*]+${parallel[*]} }${SUITE_ARGS:-(the fast tier)} on $device -> $txt"
    # the 25 slowest tests listed at the end (what to split should a run not fit its call); no network there
    HF_HUB_OFFLINE=1 timeout -s INT -k 10 "${SUITE_LIMIT:-400}" \
        python -m pytest -q -p no:cacheprovider --durations=25 ${parallel[@]+"${parallel[@]}"} ${SUITE_ARGS:-} 2>&1 \
        | tee "$txt" \
        || { echo "the suite FAILED or ran out of time (rc $?)"; status=1; }
}

for s in "${stages[@]}"; do "$s"; done
exit $status
