#!/usr/bin/env bash
# All GPU checks and benchmarks in one go: CUDA tests (kernels, caches, sampling, CUDA graphs, engines), then
# the attention and decode benchmarks. Results (logs, JSON, Markdown tables) go to ${OUT:-gpu-results}.
# Works from a source checkout without installing: the mg.* namespace is mapped with links.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
ROOT="$(pwd)"
NS="$(mktemp -d)/site"
mkdir -p "$NS/mg"
for pkg in export runtime kernels manifests; do ln -s "$ROOT/$pkg" "$NS/mg/$pkg"; done
export PYTHONPATH="$NS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels tests/runtime \
    2>&1 | tee "$OUT/cuda_tests.log"
python3 scripts/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.md"
python3 scripts/bench_decode.py --out "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.md"
