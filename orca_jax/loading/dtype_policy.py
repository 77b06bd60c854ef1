"""What `dtype="auto"` (the default, as vLLM's) runs a model in.

    backend        auto picks                    why
    gpu >= sm_80,  the checkpoint's dtype        bfloat16 for nearly every HF model; float16
    tpu            (float16 -> bfloat16)         checkpoints run bfloat16 (its wider range)
    gpu < sm_80    float16 (float32 checkpoints  T4 (sm_75), V100 (sm_70): no bfloat16
                   and FLOAT16_UNSTABLE models   arithmetic; XLA would emulate it in float32
                   stay float32)
    cpu            CPU_AUTO_DTYPE                measured on this project's CPUs (below)

Below sm_80 an explicit bfloat16 is refused (as vLLM refuses it), naming `--dtype half`; the
Pallas kernel's matrix products also compile to FMA code there (Triton dropped tensor-core MMA
below sm_80; kernels/ragged_paged_attention_gpu.py picks tiles that fit that). Gemma 2 and 3
overflow float16's range in their activations: float16 is refused for them (vLLM does the
same), and "auto" keeps them in float32 on those GPUs.

The checkpoint's dtype is what its files say before anything is loaded: `torch_dtype`/`dtype`
in an HF config.json, the dtype an orca_jax checkpoint was converted to, the tensor types of a
GGUF file (a quantized GGUF counts as half precision: its source was, and it dequantizes to
at least that). Unknown means bfloat16 on accelerators.

On CPU, float32 stays the choice, measured on the AVX-512 + AMX machine (avx512_bf16,
amx_bf16; benchmarks/cpu_step_bench.py, docs/benchmarks.md): bfloat16 weights over a float32
KV cache made the default model's decode step about 3x slower (656 against 212 ms at batch 1,
627 against 217 at batch 16, the same run), and its 128-token prefill 1.9x slower, although a
lone [16, 576] x [576, 6144] bfloat16 matmul ran faster than float32's. A bfloat16 KV cache is
worse still: XLA:CPU converts the whole pool around every scatter and gather (131 s a step for
a 2.8 GiB pool). CPUs without those instructions emulate bfloat16 and were slower before. So no
CPU gets bfloat16 from "auto"; `cpu_bfloat16_capable` says whether a CPU has the instructions,
for the logs and the benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

from orca_jax.kernels.gpu_info import BFLOAT16_MIN_CAPABILITY, has_bfloat16

AUTO = "auto"
CPU_AUTO_DTYPE = "float32"
_HALF = ("bfloat16", "float16")
# Model types whose activations exceed float16's range (65504): Gemma 2 and 3 scale their
# embeddings and residual stream past it. vLLM refuses float16 for the same ones.
FLOAT16_UNSTABLE = frozenset({"gemma2", "gemma3", "gemma3_text"})


def resolve_dtype(requested: str, backend: str, checkpoint: str | None, *, capability: int | None = None,
                  model_type: str | None = None) -> str:
    """The dtype a model runs in: `requested` unless it is "auto". `capability`: the GPU's
    compute capability (75 for sm_75), None when not a GPU or unknown (taken as one with
    bfloat16); `model_type`: the checkpoint's HF model_type where known."""
    no_bfloat16 = backend == "gpu" and not has_bfloat16(capability)
    if requested != AUTO:
        check_dtype_supported(requested, backend, capability=capability, model_type=model_type)
        return requested
    if backend == "cpu":
        return CPU_AUTO_DTYPE
    if checkpoint == "float32":
        return "float32"
    if no_bfloat16:
        return "float32" if model_type in FLOAT16_UNSTABLE else "float16"
    return "bfloat16"


def check_dtype_supported(dtype: str, backend: str, *, capability: int | None = None,
                          model_type: str | None = None) -> None:
    """Refuse a dtype the hardware or the model cannot run, saying what to use instead."""
    if dtype == "bfloat16" and backend == "gpu" and not has_bfloat16(capability):
        raise ValueError(
            f"dtype bfloat16 needs a GPU of compute capability >= {BFLOAT16_MIN_CAPABILITY // 10}.0; this one is "
            f"{capability // 10}.{capability % 10}: use --dtype half (float16) or float32")
    if dtype == "float16" and model_type in FLOAT16_UNSTABLE:
        raise ValueError(f"dtype float16 is not supported for {model_type}: its activations overflow float16's "
                         "range; use bfloat16 or float32")


def resolve_model_dtype(requested: str, backend: str, model: str | Path | None, revision: str | None = None, *,
                        capability: int | None = None) -> str:
    """`resolve_dtype` for `model` (as `load_model` takes it), whose files are found and read
    only when the answer depends on them (not on CPU: parsing a GGUF file's tensor table takes
    seconds). An explicit dtype's model check (`check_dtype_supported`) is the engine's, once
    the model's config is loaded."""
    if requested != AUTO or backend == "cpu":
        return resolve_dtype(requested, backend, None, capability=capability)
    from orca_jax.loading.loader import resolve_model_path

    path = resolve_model_path(model, revision)
    no_bfloat16 = backend == "gpu" and not has_bfloat16(capability)
    return resolve_dtype(requested, backend, checkpoint_dtype(path), capability=capability,
                         model_type=checkpoint_model_type(path) if no_bfloat16 else None)


def auto_dtype_reason(dtype: str, backend: str, capability: int | None) -> str:
    """Why "auto" chose `dtype`, for the engine's log line."""
    if backend == "cpu":
        return "float32 on CPU (bfloat16 measured slower on XLA:CPU)"
    if backend == "gpu" and not has_bfloat16(capability):
        return (f"{dtype} on a GPU of compute capability {capability // 10}.{capability % 10}, which has no "
                "bfloat16 arithmetic" + ("" if dtype == "float16" else " (float16 would overflow for this model, "
                                         "or the checkpoint is float32)"))
    return f"{dtype}, the checkpoint's dtype (float16 checkpoints run bfloat16) on {backend}"


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype a model's files hold ("float32", "bfloat16", "float16"), or None if they do
    not say. `path`: an HF directory, an orca_jax checkpoint directory or a .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dtype(path)
    from orca_jax.loading import checkpoint

    if checkpoint.is_checkpoint(path):
        return checkpoint.open_checkpoint(path).dtype
    config = path / "config.json"
    if config.exists():
        try:
            meta = json.loads(config.read_text())
        except ValueError:
            return None  # the loader reports a corrupt config.json with its own message
        named = meta.get("torch_dtype") or meta.get("dtype")
        return named if named in ("float32", *_HALF) else None
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return _gguf_dtype(ggufs[0]) if ggufs else None


def checkpoint_model_type(path: Path) -> str | None:
    """The HF model_type of a model's files, or None if they do not say."""
    path = Path(path)
    from orca_jax.loading import checkpoint

    if path.is_dir() and checkpoint.is_checkpoint(path):
        return checkpoint.open_checkpoint(path).config.model_type
    config = path / "config.json"
    if path.is_dir() and config.exists():
        try:
            return json.loads(config.read_text()).get("model_type")
        except ValueError:
            return None
    gguf_file = path if path.is_file() else next(iter(sorted(path.glob("*.gguf"))), None) if path.is_dir() else None
    if gguf_file is None or gguf_file.suffix != ".gguf":
        return None
    import gguf

    field = gguf.GGUFReader(str(gguf_file)).get_field("general.architecture")
    return None if field is None else field.contents()


def _gguf_dtype(path: Path) -> str:
    """float32 when the weight matrices are F32, else half precision (F16, BF16, quantized).
    One-dimensional tensors (norms, biases) are F32 in every llama.cpp file: not counted."""
    import gguf

    matrix_types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1}
    if matrix_types == {"F32"}:
        return "float32"
    return "float16" if matrix_types == {"F16"} else "bfloat16"


def cpu_bfloat16_capable(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX-512 BF16 or AMX)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})
