"""Every token bucket's step lowered for TPU (jax's Pallas TPU kernel) and CUDA (the Triton
kernel) from this CPU, at tensor parallelism 1 and 8 on 8 forced host devices; run as a
subprocess by tests/worker/test_cross_lowering.py. Prints one JSON object: per case, per
target, per bucket, the program's custom calls and what the program holds.

    python tests/cross_lowering_worker.py CASES_JSON
    CASES_JSON: {case name: {"model": dir, "kv_cache_dtype": ..., "tp": [1, 8]}}
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.worker import cross_lowering  # noqa: E402

ENGINE = dict(warmup=False, attention_impl="reference", max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=8,
              page_size=16, num_pages=64, max_model_len=256, dtype="bfloat16")


def describe(lowered: jax.stages.Lowered) -> dict:
    text = lowered.as_text()
    return dict(custom_calls=sorted(cross_lowering.custom_calls(lowered)), ragged_dot="ragged_dot" in text,
                manual_computations=text.count("sdy.manual_computation"), chars=len(text))


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    cases = json.loads(sys.argv[1])
    result = {}
    for name, case in cases.items():
        for tp in case["tp"]:
            engine = LLMEngine(model=case["model"], kv_cache_dtype=case["kv_cache_dtype"], tensor_parallel_size=tp,
                               **ENGINE)
            for target in (cross_lowering.TPU_V5E, cross_lowering.H100):
                steps = cross_lowering.lower_steps(engine.runner, target)
                result[f"{name}/tp{tp}/{target.platform}"] = {str(b): describe(low) for b, low in steps.items()}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
