#!/bin/sh
# Every GPU figure in one run of a few minutes on one CUDA GPU (an H200: about 4):
#   1. gpu_check.py             copy bandwidth, bytes a token streams and the bound; c(n) for 1-128 rows at
#                               1024 and 4096 positions, eager and from CUDA graphs; AR and EAGLE-3 on both
#   2. gpu_check.py --lossless  every lossless method of infer/run.py on BFCL requests, fp32 equal to AR,
#                               and each method's host ms per call on this machine   (needs TOKENIZER)
#   3. gpu_project.py           a CPU bench's call shapes on the graphs' costs, with 2.'s host time (needs BENCH)
#
#   benchmarks/on_gpu.sh [TOKENIZER_DIR [REQUESTS [BENCH_DIR]]]
# Results in outputs/gpu/; docs/benchmarks.md says what to bring to a machine without a package registry.
set -eu
cd "$(dirname "$0")/.."
out=outputs/gpu
mkdir -p "$out"
python benchmarks/gpu_check.py --out "$out/gpu_check.json"
status=0
if [ -n "${1:-}" ]; then
    python benchmarks/gpu_check.py --lossless --tokenizer "$1" --requests "${2:-artifacts/requests/bfcl450.jsonl}" \
        --limit 8 --out "$out/gpu_lossless.json" || status=$?
fi
if [ -n "${3:-}" ]; then
    python benchmarks/gpu_project.py --bench "$3" --host "$out/gpu_lossless.json" --out "$out/gpu_projection.json"
fi
exit "$status"
