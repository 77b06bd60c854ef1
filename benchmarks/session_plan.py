"""The plan of an accelerator session: every stage, its time limit and what it checks, in one table.

A session gets one device command of at most 590 s (the device tool's 10-minute limit, less a
margin for its own start), so the stages' limits plus START_ALLOWANCE_S must stay within it
(a test asserts so). Checks come first, timings after: a session cut short still says whether
every feature works, and a slow benchmark loses its own last rows, not the others.

Each stage is a command (argv; `{python}` is this interpreter, `{json}` the file the stage writes
its record to, which benchmarks/session_runner.py merges into summary.json) and `keys`: the
names of the numbers worth lifting from that record into the summary's short view (any leaf
whose key contains one of them).

Why each limit is what it is: measured runs of the stage (docs/benchmarks.md), trimmed until
the sum fits; each stage writes its JSON row by row, so one that runs out keeps what it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The device tool's limit for one command, and what the runner itself takes outside the stages
# (starting Python, reading versions without jax, writing the summary after every stage).
DEVICE_COMMAND_LIMIT_S = 590
START_ALLOWANCE_S = 25


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int
    checks: str  # what the stage checks or measures, in a sentence
    argv: tuple[str, ...]
    keys: tuple[str, ...] = field(default=())


def stage_budget_s(plan: list[Stage]) -> int:
    """What a plan can take: every stage running to its limit, plus the runner's own start."""
    return sum(stage.limit_s for stage in plan) + START_ALLOWANCE_S


FACTS = Stage("machine_facts", 20, "jax's backend, devices, memory and versions; which optional packages import",
              ("{python}", "benchmarks/machine_facts.py", "--json", "{json}"),
              ("backend", "device_kind", "jax"))
FEATURE_KEYS = ("status", "max_abs_err", "max_logprob_diff", "tokens_identical", "draft_tokens",
                "cached_tokens_of_second", "attention_impl", "reason")


def feature_stage(limit_s: int) -> Stage:
    # The check's own budget ends it 10 s before the stage's limit, so it records "skipped: out
    # of time" for the checks it cannot reach instead of being killed mid-check.
    return Stage("feature_check", limit_s,
                 "every feature on the accelerator vs the CPU: kernels vs the float64 oracle (f32/bf16/f16, int8/fp8 "
                 "KV), six families, bf16/f16, int8/fp8 weights and KV, MXFP4, prefix caching, n-gram speculation, "
                 "a one-device TP mesh, regex structured outputs (benchmarks/feature_check.py)",
                 ("{python}", "benchmarks/feature_check.py", "--check-seconds", "40",
                  "--budget-seconds", str(limit_s - 10), "--json", "{json}"), FEATURE_KEYS)


def moe_stage(limit_s: int, checks: str) -> Stage:
    """The grouped matmul on Qwen3-30B-A3B's expert shapes (both plans; what it compares
    depends on the backend's lowerings)."""
    return Stage("moe_bench", limit_s, checks,
                 ("{python}", "benchmarks/moe_bench.py", "--parts", "matmul", "--shapes", "qwen3_30b_a3b", "--dtype",
                  "bfloat16", "--decode-tokens", "8,64", "--prefill-tokens", "256,512", "--max-seconds", "2",
                  "--bandwidth-mib", "2048", "--json", "{json}"),
                 ("relative_error", "gflops", "ms"))


def mxfp4_stage(limit_s: int) -> Stage:
    return Stage("moe_mxfp4_bench", limit_s, "MXFP4 experts (gpt-oss-120b shapes): ragged_dot on unpacked 4-bit vs "
                 "bfloat16",
                 ("{python}", "benchmarks/moe_bench.py", "--parts", "matmul", "--shapes", "gpt_oss_120b", "--dtype",
                  "bfloat16", "--projections", "up", "--impls", "dense,ragged_dot,ragged_dot_mxfp4,blocked_mxfp4",
                  "--decode-tokens", "8,64", "--prefill-tokens", "512", "--max-seconds", "2", "--bandwidth-mib", "0",
                  "--json", "{json}"),
                 ("relative_error", "ms"))


GPU_PLAN: list[Stage] = [
    FACTS,
    feature_stage(170),
    # Its correctness part (the GPU kernel vs the float64 oracle at Llama-3-8B's heads) runs
    # first; the tuning sweep is left out (it was 50 s of the 140 this stage had).
    Stage("kernel_bench", 75, "Pallas GPU kernel vs the oracle, then ms, GB/s and share of copy bandwidth on decode "
          "and mixed batches, vs the reference and jax's paged_attention",
          ("{python}", "benchmarks/kernel_bench.py", "--no-tune", "--json", "{json}"),
          ("correctness_max_abs_err", "copy_gbs", "share_of_copy", "speedup_vs_reference")),
    # Two engines (sync, then async from the compilation cache); the reference engine is left
    # out (the feature check compares kernel and reference; kernel_bench times them).
    Stage("step_bench", 85, "LLMEngine.step() decode at batch 64/256 on Llama-3.2-1B shapes vs the memory roofline, "
          "synchronous and overlapped",
          ("{python}", "benchmarks/step_bench.py", "--modes", "sync,async", "--no-reference", "--json", "{json}"),
          ("tokens_per_s", "share_of_roofline", "device_idle_frac", "median_step_ms")),
    Stage("gpu_engine_check", 45, "engine CPU/GPU parity on a tiny Llama, warm-up programs, zero compiles while "
          "serving, decode steps/s at batch 1 and 64 (1B shapes)",
          ("{python}", "benchmarks/gpu_engine_check.py", "--batch-sizes", "1,64", "--out", "{json}"),
          ("ok", "max_abs_logit_diff", "warmup_compiles", "tokens_per_s", "startup_s")),
    # Quantized steps (issue 18): fp8 weights (the H100/H200 fp8 units) with an int8 cache, then
    # int8 weights with an fp8 cache, against the roofline of the bytes held.
    Stage("quant_fp8_step", 30, "decode step on fp8 weights + int8 KV cache vs its roofline",
          ("{python}", "benchmarks/step_bench.py", "--quantization", "fp8", "--kv-cache-dtype", "int8", "--modes",
           "async", "--no-reference", "--batch-sizes", "1,64", "--context", "512", "--json", "{json}"),
          ("tokens_per_s", "share_of_roofline")),
    Stage("quant_int8_step", 30, "decode step on int8 weights + fp8 KV cache vs its roofline",
          ("{python}", "benchmarks/step_bench.py", "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3",
           "--modes", "async", "--no-reference", "--batch-sizes", "1,64", "--context", "512", "--json", "{json}"),
          ("tokens_per_s", "share_of_roofline")),
    # Mixture of experts (issue 20) on Qwen3-30B-A3B's expert shapes; prefills stay at 512
    # tokens, since a dense-masked lowering would take seconds per call.
    moe_stage(40, "grouped matmul (ragged_dot, its Triton lowering, blocked loop) vs dense on Qwen3-30B-A3B "
              "experts, checked vs numpy first"),
    # MXFP4 experts (issue 36): gpt-oss-120b's expert shapes, 4-bit experts unpacked per call.
    mxfp4_stage(20),
    # Sliding windows (issue 34): a sliding layer's decode at 8k context vs its window's length.
    Stage("sliding_window_bench", 20, "sliding-window decode at 8k context vs the window's length and a full layer, "
          "checked vs the reference",
          ("{python}", "benchmarks/sliding_window_bench.py", "--impl", "pallas_gpu", "--dtype", "bfloat16",
           "--batch", "64", "--window", "512", "--context", "8192", "--json", "{json}"),
          ("max_abs_error", "_over_", "ms")),
]

# A TPU VM: the same feature check (backend tpu: jax's Pallas TPU kernel in the engine and against
# the oracle), then the timings whose scripts take any backend. kernel_bench, step_bench and
# gpu_engine_check are GPU-only (they exit 2 elsewhere: Triton kernel, CUDA copy roofline), so
# they are not in this plan. A TPU command has no device tool's limit; the same budget keeps
# the run short and its summary comparable.
TPU_PLAN: list[Stage] = [
    FACTS,
    feature_stage(240),
    moe_stage(60, "grouped matmul (ragged_dot, blocked loop) vs dense on Qwen3-30B-A3B experts, checked "
              "vs numpy first"),
    mxfp4_stage(30),
    # The bench passes the window as a traced int32, as a model that mixes sliding and full
    # layers does inside its layer scan; jax's TPU kernel takes only a static window, so on a TPU
    # this times the reference such a model falls back to (orca_jax/kernels/ragged_paged_attention_tpu.py).
    # The feature check's kernel_* checks run the TPU kernel itself, with static windows.
    Stage("sliding_window_bench", 30, "sliding-window decode at 8k context vs the window's length and a full layer "
          "on a TPU: the reference a mixed sliding/full model falls back to (traced window)",
          ("{python}", "benchmarks/sliding_window_bench.py", "--impl", "pallas_tpu", "--dtype", "bfloat16",
           "--batch", "64", "--window", "512", "--context", "8192", "--num-q-heads", "16", "--num-kv-heads", "8",
           "--json", "{json}"),
          ("max_abs_error", "_over_", "ms")),
    # The MoE model's whole step (attention + experts) on the TPU against its dense twin.
    Stage("moe_step_bench", 60, "a random qwen3_moe model's forward step vs a dense qwen3 of its active width",
          ("{python}", "benchmarks/moe_bench.py", "--parts", "step", "--dtype", "bfloat16", "--max-seconds", "2",
           "--json", "{json}"),
          ("ms", "tokens_per_s")),
]

PLANS = {"gpu": GPU_PLAN, "tpu": TPU_PLAN}
