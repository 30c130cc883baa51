#!/usr/bin/env bash
# One command for a CUDA machine: the GPU tests, then short GPU timings, results into
# OUTDIR. Two parts, each stage under its own time limit (a failing stage does not
# stop the next ones):
#
#   scripts/gpu_check.sh OUTDIR          the tests and the short timings: 470 s of stage
#                                        limits, about 5 minutes on one H200 (room for
#                                        a rerun in a session's 15 device minutes)
#   scripts/gpu_check.sh OUTDIR long     the long stages: nano-vllm's throughput workload,
#                                        the eager and fp8 decode steps, fla's kernels
#                                        (their autotuning alone passes 45 s), the
#                                        quantized GEMMs' tile sweep: 490 s of limits
#   (PYTHON=... to pick the interpreter)
#
# OUTDIR gets: env.txt (torch / CUDA / triton / GPU); gpu_tests.log + .xml (tests/gpu/
# test_cuda_parity.py: CUDA greedy == CPU fp32 for dense, sliding, multi-group, MoE,
# hybrid models, with and without CUDA graphs, chunked prefill, preemption, head sizes
# 96 and 512 and soft-capped attention; the Triton attention kernels compiled, bf16
# included, over head sizes 80 / 96 / 128 / 512 and soft-capping; the sync-free MoE);
# gpu_spec_tests.log + .xml (test_cuda_spec_graphs.py: n-gram / EAGLE-3 / DFlash verify
# steps replayed from the decode graphs, tokens equal to the CPU's without drafts);
# gpu_quant_tests.log + .xml (test_cuda_quant*.py: the quantized GEMMs compiled, fp32
# and bf16, GPTQ / AWQ / FP8 / MoE-GPTQ / --quantization int8 and fp8 / fp8 KV-cache
# models on CUDA equal to the CPU, tokens and logprobs; the experts' grouped GEMMs
# replayed from a CUDA graph); attn_kernels.json/.log (the paged-decode kernel at head
# sizes 96 / 128 / 512 and soft-capped: us per call, GB/s of K/V read);
# quant_gemm.json/.log (the Triton W8A16 / W4A16 / FP8 GEMMs against bf16 cuBLAS at
# decode rows); decode_step*.json/.log (decode-step time vs the HBM bandwidth bound:
# bf16 with CUDA graphs, --quantization int8 against its resident bytes; long: eager,
# fp8); long: throughput.json/.log (nano-vllm's workload on a Qwen3-0.6B-architecture
# model with random bf16 weights: 256 requests, prompt and output lengths uniform in
# [100, 1024], ignore_eos; tokenmill vs HF generate on its first 16 requests;
# roofline), gpu_fla_tests.log, quant_sweep.json/.log; summary.txt (each stage's exit
# status and headline lines).
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR [long]}
PART=${2:-quick}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENMILL_CACHE=${TOKENMILL_CACHE:-$OUT/cache}  # the bench model is built here
unset TRITON_INTERPRET  # compiled Triton kernels, not the CPU interpreter
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log, record the status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
    return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" 2>&1
  "$PY" -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt"
cat "$OUT/env.txt" >> "$SUMMARY"

if [ "$PART" = quick ]; then
# 1. The GPU tests (alone in their process: the interpreter tests set TRITON_INTERPRET).
stage gpu_tests 100 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_parity.py \
    -k "not fla" --timeout 60 --junitxml "$OUT/gpu_tests.xml"
tail -n 3 "$OUT/gpu_tests.log" >> "$SUMMARY"
# 1a. Speculative decoding inside the decode graphs (n-gram, EAGLE-3, DFlash).
stage gpu_spec_tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_spec_graphs.py \
    --timeout 60 --junitxml "$OUT/gpu_spec_tests.xml"
tail -n 3 "$OUT/gpu_spec_tests.log" >> "$SUMMARY"
# 1b. Quantized weights (dense and MoE experts) and the fp8 KV cache (the GEMMs compile
# on first use: its own limit).
stage gpu_quant_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_quant.py \
    tests/gpu/test_cuda_quant_moe.py \
    --timeout 60 --junitxml "$OUT/gpu_quant_tests.xml"
tail -n 3 "$OUT/gpu_quant_tests.log" >> "$SUMMARY"

# 2. The decode kernel per head size (masked tails next to the powers of two) and
#    soft-capped, replayed from CUDA graphs.
stage attn_kernels 20 "$PY" -m tokenmill.bench.attention_kernels --device cuda \
    --heads 96,128,512 --softcap-heads 128 --batch 1,32 --context 2048 \
    --output-json "$OUT/attn_kernels.json"
grep "us/call" "$OUT/attn_kernels.log" >> "$SUMMARY"

# 2b. The quantized-weight GEMMs against bf16 at decode-sized rows.
stage quant_gemm 40 "$PY" -m tokenmill.bench.quant_gemm --rows 1,16,64,256 \
    --output-json "$OUT/quant_gemm.json"
grep "us/call" "$OUT/quant_gemm.log" | grep -v "bf16 " >> "$SUMMARY"

# 3. Decode-step time against the HBM bound (CUDA graphs; the bench model is built on
#    first use), bf16 and int8 weights.
stage decode_step 30 "$PY" -m tokenmill.bench.decode_step --model bench-qwen3-0.6b \
    --device cuda --batch 1,32,256 --context 512 --steps 32 \
    --output-json "$OUT/decode_step.json"
stage decode_step_int8 40 "$PY" -m tokenmill.bench.decode_step --model bench-qwen3-0.6b \
    --device cuda --batch 1,32 --context 512 --steps 32 --quantization int8 \
    --output-json "$OUT/decode_step_int8.json"
else
# 4. Throughput: nano-vllm's workload (the model is built on first use, ~1 min).
stage throughput 170 "$PY" -m tokenmill.entrypoints.cli bench throughput \
    --model bench-qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 256 \
    --input-len 100:1024 --output-len 100:1024 --seed 0 --max-num-seqs 256 \
    --hf-num-prompts 16 --hf-batch-size 16 --skip-hf-cb --output-json "$OUT/throughput.json"
grep -E "tok/s|tokenmill|HF generate|roofline" "$OUT/throughput.log" | tail -n 8 >> "$SUMMARY"
# 5. Eager decode steps, fp8 weights.
stage decode_step_eager 15 "$PY" -m tokenmill.bench.decode_step --model bench-qwen3-0.6b \
    --device cuda --batch 1,32 --context 512 --steps 16 --enforce-eager \
    --output-json "$OUT/decode_step_eager.json"
stage decode_step_fp8 40 "$PY" -m tokenmill.bench.decode_step --model bench-qwen3-0.6b \
    --device cuda --batch 1,32 --context 512 --steps 32 --quantization fp8 \
    --output-json "$OUT/decode_step_fp8.json"
# 6. fla's Gated DeltaNet kernels against the PyTorch rule (autotuned on first use).
stage gpu_fla_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_parity.py \
    -k fla --timeout 140
tail -n 3 "$OUT/gpu_fla_tests.log" >> "$SUMMARY"
# 7. The quantized GEMMs' decode tile settings and the dequantized path's crossover.
stage quant_sweep 115 "$PY" -m tokenmill.bench.quant_gemm --sweep \
    --shapes 4096x4096,1024x3072 --iters 10 --output-json "$OUT/quant_sweep.json"
grep best "$OUT/quant_sweep.log" >> "$SUMMARY"
fi
grep -H "ms/step" "$OUT"/decode_step*.log 2>/dev/null | sed "s|^$OUT/||" >> "$SUMMARY"
cat "$SUMMARY"
grep -q "rc=[^0]" "$SUMMARY" && exit 1
exit 0
