"""What `dtype="auto"` (the default, as vLLM's) runs a model in.

    backend        auto picks                    why
    gpu, tpu       the checkpoint's dtype        bfloat16 for nearly every HF model; float16
                   (float16 -> bfloat16)         checkpoints run bfloat16 (no float16 path)
    cpu            CPU_AUTO_DTYPE                measured on this project's CPUs (below)

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

AUTO = "auto"
CPU_AUTO_DTYPE = "float32"
_HALF = ("bfloat16", "float16")


def resolve_dtype(requested: str, backend: str, checkpoint: str | None) -> str:
    """The dtype a model runs in: `requested` unless it is "auto"."""
    if requested != AUTO:
        return requested
    if backend == "cpu":
        return CPU_AUTO_DTYPE
    return "float32" if checkpoint == "float32" else "bfloat16"


def resolve_model_dtype(requested: str, backend: str, model: str | Path | None, revision: str | None = None) -> str:
    """`resolve_dtype` for `model` (as `load_model` takes it), whose files are found and read
    only when the answer depends on them (not on CPU: parsing a GGUF file's tensor table takes
    seconds)."""
    if requested != AUTO or backend == "cpu":
        return resolve_dtype(requested, backend, None)
    from orca_jax.loading.loader import resolve_model_path

    return resolve_dtype(requested, backend, checkpoint_dtype(resolve_model_path(model, revision)))


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
