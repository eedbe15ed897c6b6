#!/usr/bin/env bash
# Everything a GPU must show, on one H100 or H200, in stages of under ten minutes each (each step has its own
# time limit, and a stage's limits sum to at most 570 s):
#
#     bash fastpath/gpu_check.sh results/decode_e2e.json                 # the default stages: bench tests hf
#     bash fastpath/gpu_check.sh results/decode_e2e.json compare         # one call per stage, or a few
#     bash fastpath/gpu_check.sh results/decode_e2e.json suite
#
#   bench    python -m fastpath.bench --e2e: the lean, graph and fused steps, full cache vs keep 0.1 for
#            SnapKV, StreamingLLM and H2O, TINYLLAMA_1B shape in bf16, 16 x 8,192 and 16 x 32,768 tokens, the
#            copy bandwidth measured in the same run, transformers' StaticCache step (eager); the report, with
#            provenance, to OUT; the same for SmolLM2-135M's shape (random weights) with 1 and 16 sequences of
#            2,048 and 8,192 tokens, to OUT's .smollm2_b1.json and .smollm2_b16.json siblings (320 s);
#   tests    the tests a GPU changes: tests/fastpath (the graph and fused steps captured and replayed on CUDA,
#            compared with the lean step; the split-K kernel in both) and tests/kernels (150 s);
#   hf       transformers' StaticCache step under torch.compile(mode="reduce-overhead") at 8,192 tokens, to
#            OUT's .hf_compiled_8192.json sibling; a compile that runs out of its time says so (70 s);
#   compare  the main job on the GPU: the bundled model's suite (2 samples) on the CPU and on the GPU (one
#            process, and 8 sharing it), their records checked equal (methods.evaluation.agree) and their
#            seconds printed; SmolLM2-135M's main job (2,048 tokens, 30 samples per task and mode) on the GPU
#            in 8 processes against the committed CPU run results/compare_smollm2.json, where its file is
#            here (3 x 70 + 270 s, 30 s to fetch it, 20 s per check); JSON files to OUT's .compare/;
#   suite    the whole fast tier (python -m pytest -q) on the CUDA machine (400 s).
#
# SmolLM2's file (98 MB) is over what one call to a lent machine carries (64 MiB). Split it into the ignored
# folder .gpu_cache/ here, `split -b 48M ~/.cache/nanollm/smollm2-135m/*.gguf .gpu_cache/smollm2.` (two parts),
# carry .gpu_cache/smollm2.aa in one call and .gpu_cache/smollm2.ab in the next (a warm machine keeps the
# first): the compare stage joins the parts and fetches the model from them.
#
# Every number it prints is the device's it ran on (the reports name it). GPU_CHECK_DEVICE=cpu runs a stage's
# commands on the CPU instead (a dry run of the script before a lent machine's minutes are spent on it).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=$(realpath -m "${1:?usage: bash fastpath/gpu_check.sh OUT.json [bench] [tests] [hf] [compare] [suite]}")
shift
stages=("${@:-bench tests hf}")
stages=(${stages[*]})
for s in "${stages[@]}"; do
    case "$s" in bench|tests|hf|compare|suite) ;; *) echo "unknown stage '$s': bench, tests, hf, compare, suite"; exit 2;; esac
done
cd "$(dirname "$0")/.."                      # the repository root
gpu=${GPU_CHECK_DEVICE:-cuda}
if [ "$gpu" = cuda ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU')" || exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" || true
python -c "import transformers; print('transformers', transformers.__version__)" || true
echo "stages: ${stages[*]}"
status=0
device=$(python -c "import torch; print(torch.cuda.get_device_name() if '$gpu' == 'cuda' else 'the CPU (dry run)')")

bench() {
    echo "== bench: end-to-end decode steps -> $out"
    timeout 200 python -m fastpath.bench --e2e --json "$out" || { echo "e2e FAILED or ran out of time (rc $?)"; status=1; }
    for batch in 1 16; do
        smol="${out%.json}.smollm2_b$batch.json"
        echo "== bench (cont.) SmolLM2-135M's shape, $batch sequences of 2,048 and 8,192 tokens -> $smol"
        timeout 60 python -m fastpath.bench --e2e --preset SMOLLM2_135M --batch "$batch" --length 2048 8192 \
            --json "$smol" || { echo "SmolLM2 e2e FAILED or ran out of time (rc $?)"; status=1; }
    done
}

tests() {
    echo "== tests: tests/fastpath, tests/kernels on $device"
    timeout 150 python -m pytest -q -p no:cacheprovider tests/fastpath tests/kernels \
        || { echo "tests FAILED or ran out of time (rc $?)"; status=1; }
}

hf() {
    local hf="${out%.json}.hf_compiled_8192.json"
    echo "== hf: transformers' StaticCache step at 8192 tokens, compiled -> $hf"
    timeout 70 python -m fastpath.bench --e2e --hf-only --hf-compile --length 8192 --json "$hf" \
        || echo "transformers compiled step at 8192: not timed (rc $?: failed, or its compile ran past 70 s)"
}

compare() {
    local dir="${out%.json}.compare" first=""
    mkdir -p "$dir"
    # the CPU with a worker per core (its default), the GPU with one process, then with up to 8 sharing it: a
    # step of the evaluation is launch-bound, so processes launching side by side may fill the GPU
    local many=$(( $(nproc) < 8 ? $(nproc) : 8 ))              # --workers is at most the CPU cores
    for run in "cpu $(nproc)" "$gpu 1" "$gpu $many"; do
        set -- $run
        local json="$dir/bundled_$1_$2.json"
        echo "== compare: the bundled model's suite, 2 samples, --device $1 --workers $2 -> $json"
        timeout 70 python -m methods.compare --samples 2 --device "$1" --workers "$2" --json "$json" --quiet \
            | tail -n 3 || { echo "compare on $1 FAILED or ran out of time (rc $?)"; status=1; }
        if [ -z "$first" ]; then first=$json
        else timeout 20 python -m methods.evaluation.agree "$first" "$json" | tail -n 6 || status=1; fi
    done
    # SmolLM2: fetched into .gpu_cache/models by an earlier call, or carried in two parts (the top of this
    # script) and fetched now; that cache folder is set for these commands only (later stages keep theirs)
    local models=$PWD/.gpu_cache/models
    local here="from nanollm.io.checkpoint import load_config; load_config('smollm2-135m')"
    if ! NANOLLM_CACHE=$models python -c "$here" 2>/dev/null && [ -f .gpu_cache/smollm2.aa ] && [ -f .gpu_cache/smollm2.ab ]; then
        cat .gpu_cache/smollm2.aa .gpu_cache/smollm2.ab > .gpu_cache/smollm2.gguf
        NANOLLM_CACHE=$models timeout 30 python -m nanollm.cli.fetch smollm2-135m --from .gpu_cache/smollm2.gguf || status=1
    fi
    if NANOLLM_CACHE=$models python -c "$here" 2>/dev/null; then
        echo "== compare: SmolLM2-135M's main job on $device, $many processes -> $dir/smollm2_$gpu.json"
        NANOLLM_CACHE=$models timeout 270 python -m methods.compare --checkpoint smollm2-135m --device "$gpu" \
            --workers "$many" --json "$dir/smollm2_$gpu.json" --quiet | tail -n 3 \
            || { echo "SmolLM2 compare FAILED or ran out of time (rc $?)"; status=1; }
        timeout 20 python -m methods.evaluation.agree results/compare_smollm2.json "$dir/smollm2_$gpu.json" || status=1
    else
        echo "compare: SmolLM2-135M is not here (both parts .gpu_cache/smollm2.aa and .ab: the top of this" \
             "script): its main job not run"
    fi
}

suite() {
    echo "== suite: the fast tier on $device"
    timeout 400 python -m pytest -q -p no:cacheprovider || { echo "the fast tier FAILED or ran out of time (rc $?)"; status=1; }
}

for s in "${stages[@]}"; do "$s"; done
exit $status
