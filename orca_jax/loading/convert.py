"""`orca-jax convert`: load a model once (`orca_jax.loading.loader`) and save it as an orca_jax
checkpoint (`orca_jax.loading.checkpoint`), so later starts restore it without reading or converting
the original again. It sits above both: the loader reads checkpoints, and the checkpoint
module knows nothing of loading.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax.numpy as jnp

from orca_jax.distributed import parallel
from orca_jax.loading.checkpoint import CheckpointError, is_checkpoint, place_host_params, save_checkpoint
from orca_jax.config import ModelConfig
from orca_jax.loading.loader import load_model

logger = logging.getLogger(__name__)


def convert(model: str | None, out_dir: str | Path, dtype: str = "float32", tensor_parallel_size: int = 1,
            quantization: str | None = None) -> dict:
    """Load and convert `model` (HF directory, .gguf, hub id, None for the default) and save it
    as an orbax checkpoint in `out_dir`, sharded over `tensor_parallel_size` devices when > 1
    (so a model too large for one device never sits whole on one). `quantization` (a format of
    orca_jax.kernels.quantization) saves the weights quantized; the checkpoint then restores them as
    they are, without quantizing again. Returns timings in seconds."""
    if tensor_parallel_size < 1:
        raise CheckpointError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"output directory {out_dir} exists and is not empty")
    start = time.perf_counter()
    loaded = load_model(model, quantization=quantization)
    if is_checkpoint(Path(loaded.source)):
        raise CheckpointError(f"{loaded.source} is already an orca_jax checkpoint")
    params = _to_devices(loaded.params, jnp.dtype(dtype), loaded.config, tensor_parallel_size)
    loaded.params = None
    convert_s = time.perf_counter() - start
    save_checkpoint(out_dir, params, loaded.tokenizer, loaded.config, dtype, loaded.source,
                    tensor_parallel_size=tensor_parallel_size)
    total_s = time.perf_counter() - start
    logger.info("converted %s -> %s in %.1f s (saving %.1f s)", loaded.source, out_dir, total_s, total_s - convert_s)
    return {"convert_s": convert_s, "total_s": total_s}


def _to_devices(params: dict, dtype, config: ModelConfig, tensor_parallel_size: int) -> dict:
    """The converted weights in `dtype`, on one device or sharded over a mesh of
    `tensor_parallel_size`. The checkpoint keeps the model's own KV heads (no repeat): a mesh
    that needs them repeated does so when it restores."""
    if tensor_parallel_size == 1:
        return place_host_params(params, dtype)
    parallel.kv_head_repeats(config, tensor_parallel_size)  # refuse a size the model cannot run at
    return place_host_params(params, dtype, parallel.make_mesh(tensor_parallel_size), config=config)
