#!/usr/bin/env bash
# Every GPU check of the project in one command, for a session lent a GPU machine (the device
# tool): at most about 9 minutes on an H200, each stage under its own time limit so that a slow one
# still leaves the others' results. Run from the repository root:
#
#     run(command="bash benchmarks/gpu_session.sh", timeout_s=590)
#
# The machine has no network: orca_jax runs from this checkout (PYTHONPATH), on the machine's
# own jax/flax/transformers; nothing here needs gguf or the server's packages. JSON and logs
# land in $OUT (the device tool brings them back); copy the numbers into docs/benchmarks.md.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/orca_jax_gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

stage() {  # stage NAME SECONDS COMMAND...: run one check, keep its log, never stop the others
    local name=$1 seconds=$2
    shift 2
    echo "=== $name (limit ${seconds}s)"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]}"
}
# kernel_bench and step_bench write their JSON after every stage or row (correctness, each case,
# tuning; each engine's batch), so a stage cut by its limit still returns what it measured.
# Limits: 140 + 145 + 80 + 85 + 55 + 25 + 25 s of stages, plus start-up and the version checks: about
# 9.5 minutes (the first four were 190 + 170 + 90 + 100 before the MoE stage, kernel_bench 170 and MoE 60
# before the sliding-window one, kernel_bench 150 and step_bench 155 before the MXFP4 one; each cut
# drops at most its last rows).
stage kernel_bench 140 python3 benchmarks/kernel_bench.py --json "$OUT/kernel_bench.json"
# Decode step at batch 64 and 256 against the roofline, synchronous and overlapped scheduling
# (issue 13), then the attention reference once: three engines, the second from the cache.
stage step_bench 145 python3 benchmarks/step_bench.py --modes sync,async --json "$OUT/step_bench.json"
stage gpu_engine_check 80 python3 benchmarks/gpu_engine_check.py --batch-sizes 1,64 --out "$OUT/gpu_engine_check.json"
# Quantized weights and KV cache (issue 18): the decode step on fp8 weights (H200 has fp8 units)
# with an int8 cache, then int8 weights with an fp8 cache, against the roofline of the bytes held.
stage quant_step_bench 85 bash -c "python3 benchmarks/step_bench.py --quantization fp8 --kv-cache-dtype int8 \
    --modes async --no-reference --batch-sizes 1,64 --context 512 --json $OUT/quant_fp8_step_bench.json && \
  python3 benchmarks/step_bench.py --quantization int8 --kv-cache-dtype fp8_e4m3 --modes async --no-reference \
    --batch-sizes 1,64 --context 512 --json $OUT/quant_int8_step_bench.json"
# Mixture of experts (issue 20): the grouped matmul on Qwen3-30B-A3B's expert shapes (D 2048,
# F 768, 128 experts, top-8, bfloat16), both projections, decode and prefill row counts:
# ragged_dot (XLA's lowering; and jax's Pallas Triton one) against the blocked loop (the CPU
# path) and a dense matmul of the same FLOPs, each checked against numpy first. Prefills stay
# at 512 tokens: were a lowering dense-masked (128x the FLOPs), one call would take seconds.
stage moe_bench 55 python3 benchmarks/moe_bench.py --parts matmul --shapes qwen3_30b_a3b --dtype bfloat16 \
    --decode-tokens 8,64 --prefill-tokens 256,512 --max-seconds 2 --bandwidth-mib 2048 --json "$OUT/moe_bench.json"
# MXFP4 experts (issue 36): gpt-oss-120b's expert shapes (D = F = 2880, 128 experts, top-4), the
# experts packed 4-bit and unpacked for ragged_dot each call, against ragged_dot on bfloat16 and
# the blocked loop unpacking one expert per block: what keeping gpt-oss 4-bit costs per layer.
stage moe_mxfp4_bench 25 python3 benchmarks/moe_bench.py --parts matmul --shapes gpt_oss_120b --dtype bfloat16 \
    --projections up --impls dense,ragged_dot,ragged_dot_mxfp4,blocked_mxfp4 --decode-tokens 8,64 \
    --prefill-tokens 512 --max-seconds 2 --bandwidth-mib 0 --json "$OUT/moe_mxfp4_bench.json"
# Sliding windows (issue 34): a decode step of a sliding layer at 8k context against the same
# step at its window's length (about 1x when the kernel reads only the window's pages) and
# against a full layer at 8k; the output checked against the reference on the same inputs.
stage sliding_window_bench 25 python3 benchmarks/sliding_window_bench.py --impl pallas_gpu --dtype bfloat16 \
    --batch 64 --window 512 --context 8192 --json "$OUT/sliding_window_gpu.json"
