#!/usr/bin/env bash
# Every TPU check of the project in one planned command, for a TPU VM (jax[tpu] installed; the
# project from this checkout: `pip install -e .` or PYTHONPATH, as here). The same design as
# gpu_session.sh: summary.json written first and after every stage, checks before timings, each
# stage under its own limit. The plan is TPU_PLAN in benchmarks/session_plan.py:
#
#   machine_facts    jax's TPU devices and versions
#   feature_check    every feature on the TPU against the CPU: jax's Pallas TPU kernel
#                    (orca_jax/kernels/ragged_paged_attention_tpu.py) against the float64 oracle
#                    (8-bit KV caches are "skipped": the kernel cannot read them, the engine uses the
#                    reference), then the engine per family, dtypes, quantization, MoE, speculation,
#                    prefix caching, a one-device TP mesh, structured outputs (if llguidance imports)
#   moe_bench, moe_mxfp4_bench, moe_step_bench, sliding_window_bench   timings that take any backend
#
# kernel_bench, step_bench and gpu_engine_check are GPU-only (the Triton kernel, a CUDA copy
# roofline; they exit 2 elsewhere), so they are not in this plan. Run from the repository root:
#
#     OUT=/tmp/orca_jax_tpu bash benchmarks/tpu_session.sh
#
# and read $OUT/summary.json and $OUT/session.log.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/orca_jax_tpu}"
if [[ " $* " == *" --plan-file "* ]]; then plan=(); else plan=(--plan tpu); fi
exec "${PYTHON:-python3}" benchmarks/session_runner.py "${plan[@]}" --out "$OUT" "$@"
