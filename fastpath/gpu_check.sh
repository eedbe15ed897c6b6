#!/usr/bin/env bash
# Everything the graph step (fastpath/graph.py, fastpath/fused.py) must show on a GPU, in one command on one
# H100 or H200, under ten minutes by design (each stage has its own time limit; they sum to 540 s):
#
#     bash fastpath/gpu_check.sh results/decode_e2e.json
#
#   1. python -m fastpath.bench --e2e: the lean, graph and fused steps, full cache vs keep 0.1 for SnapKV,
#      StreamingLLM and H2O, TINYLLAMA_1B shape in bf16, 16 x 8,192 and 16 x 32,768 tokens, the copy
#      bandwidth measured in the same run, transformers' StaticCache step (eager); the report, with
#      provenance, to OUT; the same for SmolLM2-135M's shape (random weights) with 1 and 16 sequences of
#      2,048 and 8,192 tokens, to OUT's .smollm2_b1.json and .smollm2_b16.json siblings;
#   2. the tests a GPU changes: tests/fastpath (the graph and fused steps captured and replayed on CUDA,
#      compared with the lean step; the split-K kernel in both) and tests/kernels (the Triton kernels on CUDA);
#   3. transformers' StaticCache step under torch.compile(mode="reduce-overhead") at 8,192 tokens, to OUT's
#      .hf_compiled_8192.json sibling; a compile that runs out of its time says so, and the script ends.
#
# Every number it prints is the device's it ran on (the report names it).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=$(realpath -m "${1:?usage: bash fastpath/gpu_check.sh OUT.json}")
cd "$(dirname "$0")/.."                      # the repository root
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" || true
python -c "import transformers; print('transformers', transformers.__version__)" || true
status=0

echo "== 1/3 end-to-end decode steps -> $out"
timeout 200 python -m fastpath.bench --e2e --json "$out" || { echo "e2e FAILED or ran out of time (rc $?)"; status=1; }

for batch in 1 16; do
    smol="${out%.json}.smollm2_b$batch.json"
    echo "== 1/3 (cont.) SmolLM2-135M's shape, $batch sequences of 2,048 and 8,192 tokens -> $smol"
    timeout 60 python -m fastpath.bench --e2e --preset SMOLLM2_135M --batch "$batch" --length 2048 8192 \
        --json "$smol" || { echo "SmolLM2 e2e FAILED or ran out of time (rc $?)"; status=1; }
done

echo "== 2/3 tests (tests/fastpath, tests/kernels) on $(python -c 'import torch; print(torch.cuda.get_device_name())')"
timeout 150 python -m pytest -q -p no:cacheprovider tests/fastpath tests/kernels \
    || { echo "tests FAILED or ran out of time (rc $?)"; status=1; }

hf="${out%.json}.hf_compiled_8192.json"
echo "== 3/3 transformers' StaticCache step at 8192 tokens, compiled -> $hf"
timeout 70 python -m fastpath.bench --e2e --hf-only --hf-compile --length 8192 --json "$hf" \
    || echo "transformers compiled step at 8192: not timed (rc $?: failed, or its compile ran past 70 s)"
exit $status
