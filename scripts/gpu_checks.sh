#!/usr/bin/env bash
# All GPU checks and benchmarks in one go: CUDA tests (kernels, caches, sampling, CUDA graphs, engines), the
# attention benchmarks (the target's decode attention, the drafter's block attention by split count), the
# quantized-linear, few-rows float32 linear, greedy-token (argmax) and decode benchmarks, the DFlash evaluation of the embedded default
# on CUDA (and with int8 / int4 drafters: eval-drafters; twice on one fresh cache folder: eval-persist, what a
# second process learns from the first's probes), the engine's per-step
# profile (time, graph captures, host synchronisations), the host work of a plain step per engine (overlapped and not), a DFlash round's
# calls kernel by kernel (drafter attention as the Triton kernel and as the torch reference; matrix products by
# the few-rows kernel, row-invariant, and by cuBLAS), the real-width
# decode benchmark and the serving benchmark. Results (logs,
# JSON, Markdown tables) go to ${OUT:-gpu-results}. Works from a source checkout without installing: the mg.*
# namespace is mapped with links.
#
#   scripts/gpu_checks.sh                      # everything: tests attention draft-attention quant rows argmax decode
#                                              # eval eval-drafters eval-persist profile host round real real-quant serve
#   scripts/gpu_checks.sh tests eval           # only those steps, in that order
#
# `real` exports the first 16 layers of MG-30B at full width (~21 GB of weights, written under
# ${MG_BENCH_WORKDIR:-a temporary folder}, one layout at a time) and benchmarks it: it needs ~25 GB of
# free disk and ~5 minutes. `real-quant` exports the first ${MG_QUANT_LAYERS:-8} layers of MG-30B five times
# (bf16; int8; int8 with the head quantized too; int4 in groups of 128; int4 with its head) and times a decode
# step of each, the int4 ones also with --int4-tensor-cores (~14 minutes, ~25 GB of disk). `tests` runs the CUDA
# tests in one process, or with MG_TEST_WORKERS=N in N pytest-xdist workers (each exports and compiles its own
# test artifacts). `serve` runs scripts/bench_serve.py against `mg-serve --device cuda` (needs the serving
# packages: fastapi, uvicorn, openai, prometheus-client).
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
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests attention draft-attention quant rows argmax decode eval eval-drafters eval-persist profile host round real real-quant serve)
status=0
for step in "${steps[@]}"; do
    case "$step" in
        tests) python3 -m pytest -q -p no:cacheprovider ${MG_TEST_WORKERS:+-n "$MG_TEST_WORKERS" --dist loadfile} -m cuda \
                  tests/kernels tests/runtime tests/export/test_quantize.py 2>&1 | tee "$OUT/cuda_tests.log" ;;
        attention) python3 scripts/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.md" ;;
        draft-attention) python3 scripts/bench_draft_attention.py --out "$OUT/bench_draft_attention.json" 2>&1 \
                  | tee "$OUT/bench_draft_attention.md" ;;
        quant) python3 scripts/bench_quant.py --head --out "$OUT/bench_quant.json" 2>&1 | tee "$OUT/bench_quant.md" ;;
        rows) python3 scripts/bench_rows.py --out "$OUT/bench_rows.json" 2>&1 | tee "$OUT/bench_rows.md" ;;
        argmax) python3 scripts/bench_argmax.py --out "$OUT/bench_argmax.json" 2>&1 | tee "$OUT/bench_argmax.md" ;;
        decode) python3 scripts/bench_decode.py --out "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.md" ;;
        eval) python3 scripts/eval_dflash.py --device cuda --compare-overlap --speculation adaptive,adaptive:shadow,fixed \
                  --out "$OUT/eval_dflash_cuda.json" \
                  --trace "$OUT/eval_dflash_cuda_trace.json" 2>&1 \
                  | grep -v "Warning\|return cls" | tee "$OUT/eval_dflash_cuda.md" ;;
        eval-drafters) python3 scripts/eval_dflash.py --device cuda --draft-weights float,int8,int4 \
                  --speculation adaptive --layouts sequence --out "$OUT/eval_dflash_cuda_drafters.json" 2>&1 \
                  | grep -v "Warning\|return cls" | tee "$OUT/eval_dflash_cuda_drafters.md" ;;
        eval-persist) cache="$(mktemp -d)"  # probe overruns persist next to the cost tables: process 2 reads 1's
              for run in 1 2; do
                  MG_CACHE_DIR="$cache" python3 scripts/eval_dflash.py --device cuda --speculation adaptive \
                      --layouts sequence,cell --repeats 1 --out "$OUT/eval_dflash_cuda_process$run.json" \
                      --trace "$OUT/eval_dflash_cuda_process${run}_trace.json" 2>&1 | grep -v "Warning\|return cls" \
                      | tee "$OUT/eval_dflash_cuda_process$run.md"
                  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
                  cat "$cache"/cost-tables/*overrun* > "$OUT/probe_overrun_after_process$run.txt" 2>/dev/null
              done ;;
        profile) python3 scripts/profile_engine.py --device cuda --by-kind --appends --speculator --out "$OUT/profile_engine_cuda.json" \
                  --profile "$OUT/profiles" 2>&1 | grep -v "Warning\|return cls" | tee "$OUT/profile_engine_cuda.md" ;;
        host) for o in on off; do
                  python3 scripts/bench_host_step.py --device cuda --batches 1,8 --overlap "$o" \
                      --out "$OUT/bench_host_step_cuda_overlap_$o.json" 2>&1 | grep -v "Warning\|return cls" \
                      | tee "$OUT/bench_host_step_cuda_overlap_$o.md"
                  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
              done ;;
        round) for run in kernel,off,off reference,off,off kernel,on,off kernel,off,on; do
                  IFS=, read -r a r k <<< "$run"
                  python3 scripts/profile_round.py --device cuda --draft-attention "$a" --row-invariant "$r" \
                      --rows-kernel "$k" --out "$OUT/profile_round_cuda_${a}_${r}_$k.json" 2>&1 \
                      | grep -v "Warning\|return cls" | tee "$OUT/profile_round_cuda_${a}_${r}_$k.md"
                  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
              done ;;
        real) python3 scripts/bench_decode.py --preset mg-30b --n-layers 16 --modes graphs,compiled \
                  --batches 1,8,32 --dflash-batches 1,8 \
                  --max-new 32 --steps 10 ${MG_BENCH_WORKDIR:+--workdir "$MG_BENCH_WORKDIR"} \
                  --out "$OUT/bench_real.json" 2>&1 | tee "$OUT/bench_real.md" ;;
        real-quant) for w in float int8 int8-head int4 int4-head; do
                  python3 scripts/bench_decode.py --preset mg-30b --n-layers "${MG_QUANT_LAYERS:-8}" \
                      --layouts sequence --modes "graphs$([ "${w#int4}" != "$w" ] && echo ,graphs-tc)" \
                      --batches 1,4,8,32 --dflash-batches 1 --e2e-batches '' --steps 8 --max-new 32 \
                      --weights "${w%-head}" $([ "${w%-head}" != "$w" ] && echo --quantize-head) \
                      ${MG_BENCH_WORKDIR:+--workdir "$MG_BENCH_WORKDIR"} --out "$OUT/bench_real_$w.json" 2>&1 \
                      | tee "$OUT/bench_real_$w.md"
                  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
              done ;;
        serve) python3 scripts/bench_serve.py --device cuda --out "$OUT/bench_serve_cuda.json" 2>&1 \
                  | tee "$OUT/bench_serve_cuda.md" ;;
        *) echo "gpu_checks.sh: unknown step '$step'; allowed: tests attention draft-attention quant rows argmax decode eval eval-drafters eval-persist profile host round real real-quant serve" >&2; exit 2 ;;
    esac
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
