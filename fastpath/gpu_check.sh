#!/usr/bin/env bash
# Everything the graph step (fastpath/graph.py) must show on a GPU, in one command on one H100 or H200,
# under ten minutes by design (each stage has its own time limit; they sum to 560 s):
#
#     bash fastpath/gpu_check.sh results/decode_e2e.json
#
#   1. the tests a GPU changes: tests/fastpath (the graph step captured and replayed on CUDA, compared with
#      the lean step; the split-K kernel in the lean step) and tests/kernels (the Triton kernels on CUDA);
#   2. python -m fastpath.bench --e2e: lean vs graph step, full cache vs keep 0.1 for SnapKV, StreamingLLM
#      and H2O, TINYLLAMA_1B shape in bf16, 16 x 8,192 and 16 x 32,768 tokens, the copy bandwidth measured in
#      the same run, transformers' StaticCache step (eager); the report, with provenance, to OUT;
#   3. transformers' StaticCache step under torch.compile(mode="reduce-overhead"), one length at a time, to
#      OUT's .hf_compiled_<length>.json siblings; a compile that runs out of its time says so, and on it goes.
#
# Every number it prints is the device's it ran on (the report names it). The results are not measured yet.
set -uo pipefail
out=$(realpath -m "${1:?usage: bash fastpath/gpu_check.sh OUT.json}")
cd "$(dirname "$0")/.."                      # the repository root
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0

echo "== 1/3 tests (tests/fastpath, tests/kernels) on $(python -c 'import torch; print(torch.cuda.get_device_name())')"
timeout 180 python -m pytest -q tests/fastpath tests/kernels || { echo "tests FAILED or ran out of time (rc $?)"; status=1; }

echo "== 2/3 end-to-end decode steps -> $out"
timeout 180 python -m fastpath.bench --e2e --json "$out" || { echo "e2e FAILED or ran out of time (rc $?)"; status=1; }

for length in 8192 32768; do
    hf="${out%.json}.hf_compiled_$length.json"
    echo "== 3/3 transformers' StaticCache step at $length tokens, compiled -> $hf"
    timeout 100 python -m fastpath.bench --e2e --hf-only --hf-compile --length "$length" --json "$hf" \
        || echo "transformers compiled step at $length: not timed (rc $?: failed, or its compile ran past 100 s)"
done
exit $status
