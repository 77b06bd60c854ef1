"""orbax checkpoints of converted weights: an HF directory or GGUF file converted once
(`orca_jax.loading.convert`), then started from without reading or converting the original again.

    OUT_DIR/
      orca_jax_checkpoint.json   marker: format version, ModelConfig, dtype, where it came from
      params/                    the Flax parameter tree, saved by orbax (StandardCheckpointer)
      tokenizer/                 the tokenizer in HF's layout (its `save_pretrained`)

`LLM(model=OUT_DIR)` recognises the marker (`orca_jax.loading.loader.load_model`) and the runner
restores the parameters straight into their target shardings: with tensor parallelism each
device (each process, multi-host) reads only its own slices from storage. The checkpoint holds
the model's own KV heads; a mesh that replicates them (see `parallel.kv_head_repeats`) restores
K/V projections whole and repeats them on device. A checkpoint converted at one tensor-parallel
size restores at any other.

The model cache's entries (`orca_jax.loading.model_cache`: converted GGUF files) share the marker and
the tokenizer layout (`write_marker`), but keep their weights as memory-mapped .npy files
(`orca_jax.loading.npy_tree`), which a warm start places without reading or copying them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from orca_jax.distributed import parallel
from orca_jax.kernels import quantization
from orca_jax.config import ModelConfig
from orca_jax.models import abstract_variables, check_supported, logical_specs

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "orca_jax_checkpoint.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used (missing parts, corrupt, wrong version)."""


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).exists()


# ---- writing ----------------------------------------------------------------------------------
def save_checkpoint(out_dir: str | Path, params: dict, tokenizer, config: ModelConfig, dtype: str, source: str, *,
                    tensor_parallel_size: int = 1, compress: bool = True, extra: dict | None = None) -> None:
    """Write a checkpoint directory from converted parameters (numpy or jax arrays, already in
    `dtype`). `compress`: zstd-compress the arrays (a third smaller for float32, but restoring
    takes about twice as long: the model cache turns it off). `extra`: more marker fields."""
    import orbax.checkpoint as ocp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # StandardCheckpointer is this handler with compression on; the handler lets it be turned off.
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress)) as checkpointer:
        checkpointer.save((out_dir / PARAMS_DIR).absolute(), args=ocp.args.PyTreeSave(params))
    tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
    # The marker last: a directory without it was never finished and is not taken for one.
    write_marker(out_dir, config, dtype, source, tensor_parallel_size=tensor_parallel_size, extra=extra)


def write_marker(out_dir: Path, config: ModelConfig, dtype: str, source: str, *, tensor_parallel_size: int = 1,
                 extra: dict | None = None) -> None:
    """The marker file (`open_checkpoint` reads it back); `extra`: more fields."""
    (Path(out_dir) / MARKER).write_text(json.dumps({
        **(extra or {}),
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(config),
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "source": source,
    }, indent=2))


def place_host_params(params: dict, dtype, mesh: Mesh | None = None, kv_head_repeats: int = 1, *,
                      config: ModelConfig | None = None) -> dict:
    """Host (numpy) parameters -> jax.Arrays in `dtype`: on the default device (uncommitted), or
    sharded over `mesh` with K/V heads repeated `kv_head_repeats` times, each weight as the model
    of `config` declares it (needed with a mesh). The one placement of converted weights (the
    runner's, the model cache's, convert's). Consumes `params`: each host array is dropped as
    soon as its copy exists, so the peak is one copy of the weights, not two (on a first start
    from a GGUF file the model cache's background save holds its own host copy until written)."""
    if mesh is None:
        return _to_device_consuming(params, dtype)
    if config is None:
        raise ValueError("placing parameters on a mesh needs the model config (its weights declare their sharding)")
    logical = logical_specs(config)
    params = parallel.repeat_kv_heads(params, logical, kv_head_repeats)
    return parallel.place_params(params, parallel.param_shardings(params, mesh, logical), dtype)


def _to_device_consuming(tree: dict, dtype) -> dict:
    for key, value in tree.items():
        if isinstance(value, dict):
            tree[key] = _to_device_consuming(value, dtype)
        else:  # quantized values and their scales keep their own dtype
            tree[key] = jnp.asarray(value, quantization.stored_dtype(key, value.dtype, dtype))
    return tree


# ---- reading ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint directory: its metadata read and checked, parameters not yet read."""

    path: Path
    config: ModelConfig
    dtype: str
    marker: dict = dataclasses.field(default_factory=dict, repr=False)  # the whole marker file
    # Check the restored tree against the model the config builds (a trace of its init, ~0.4 s).
    # The model cache turns it off: its entries were written by this code from a converted tree,
    # under a key that changes with the sources defining that tree (model_cache.py).
    verify_shapes: bool = dataclasses.field(default=True, repr=False)

    def restore(self, dtype=None, mesh: Mesh | None = None, kv_head_repeats: int = 1) -> dict:
        """The parameters as jax.Arrays in `dtype` (default: the saved one), on one device or
        sharded over `mesh` as the model declares them (`parallel.param_shardings`), K/V heads
        repeated `kv_head_repeats` times."""
        import orbax.checkpoint as ocp

        dtype = jnp.dtype(dtype or self.dtype)
        start = time.perf_counter()
        params = self._read(ocp.StandardCheckpointer(), lambda checkpointer, params_dir, saved: checkpointer.restore(
            params_dir, _restore_targets(saved, dtype, mesh, self.config, kv_head_repeats)))
        if kv_head_repeats > 1:
            params = _repeat_kv_heads_on_device(params, self.config, mesh, kv_head_repeats)
        logger.info("restored %s in %.2f s", self.path / PARAMS_DIR, time.perf_counter() - start)
        return params

    def restore_stages(self, dtype, mesh: Mesh, stage_meshes: list[Mesh], holders: dict[str, list[int]]) -> list[dict]:
        """Pipeline parallelism: each stage's weights restored straight onto its own devices,
        none whole on one device. `mesh` is the stage x model mesh (stages on its first axis;
        their number divides the layers), `stage_meshes` its rows as 1-D "model" meshes,
        `holders` the stages that hold each top-level weight other than "layers" (a tied table:
        the first and the last). Stacked layer weights are read sharded over the stages (each
        row reads its slice) and tensor-parallel within a row; every other weight is read onto
        its first holder's row and copied to the others. Returns one {"params": ...} per stage."""
        import orbax.checkpoint as ocp

        dtype = jnp.dtype(dtype or self.dtype)
        tp = mesh.shape[parallel.MODEL_AXIS]

        def targets(checkpointer, params_dir, saved):
            specs = parallel.tree_paths(parallel.param_specs(saved, logical_specs(self.config), tp)["params"])

            def target(name, leaf):
                spec = tuple(specs[name])
                if name.startswith("layers/"):  # [L, ...]: the layer axis over the stages
                    sharding = NamedSharding(mesh, P(mesh.axis_names[0], *spec[1:]))
                else:
                    sharding = NamedSharding(stage_meshes[holders[name.split("/")[0]][0]], P(*spec))
                return jax.ShapeDtypeStruct(tuple(leaf.shape), quantization.stored_dtype(name, leaf.dtype, dtype),
                                            sharding=sharding)

            return checkpointer.restore(params_dir, {"params": parallel.map_with_path(target, saved["params"])})

        start = time.perf_counter()
        whole = self._read(ocp.StandardCheckpointer(), targets)["params"]
        stages: list[dict] = [{} for _ in stage_meshes]
        for s, row in enumerate(stage_meshes):
            stages[s]["layers"] = jax.tree.map(lambda leaf, row=row: _stage_slice(leaf, row), whole["layers"])
        for key, value in whole.items():
            for s in holders.get(key, []) if key != "layers" else []:
                stages[s][key] = value if s == holders[key][0] else jax.tree.map(
                    lambda leaf, row=stage_meshes[s]: jax.device_put(leaf, NamedSharding(row, leaf.sharding.spec)), value)
        logger.info("restored %s onto %d pipeline stages in %.2f s", self.path / PARAMS_DIR, len(stage_meshes),
                    time.perf_counter() - start)
        return [{"params": tree} for tree in stages]

    def restore_host(self, dtype=None) -> dict:
        """The parameters as numpy arrays in `dtype` (default: the saved one), on the host."""
        import orbax.checkpoint as ocp

        dtype = jnp.dtype(dtype or self.dtype)

        def as_numpy(checkpointer, params_dir, saved):
            restore_args = {"params": parallel.map_with_path(
                lambda name, leaf: ocp.RestoreArgs(restore_type=np.ndarray,
                                                   dtype=quantization.stored_dtype(name, leaf.dtype, dtype)),
                saved["params"])}
            return checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))

        return self._read(ocp.Checkpointer(ocp.PyTreeCheckpointHandler()), as_numpy)

    def _read(self, checkpointer, restore) -> dict:
        """`restore(checkpointer, params_dir, saved array metadata)` with any failure named as
        this checkpoint's, then the tree checked against the model (unless `verify_shapes` is off)."""
        params_dir = (self.path / PARAMS_DIR).absolute()
        try:
            with checkpointer:
                saved = checkpointer.metadata(params_dir)
                # orbax versions differ in how they wrap the tree of array metadata.
                saved = getattr(saved, "item_metadata", saved)
                saved = getattr(saved, "tree", saved)
                params = restore(checkpointer, params_dir, saved)
        except Exception as exc:  # orbax, tensorstore and OS errors alike: name the checkpoint
            raise CheckpointError(f"could not restore orbax checkpoint {params_dir}: {type(exc).__name__}: {exc}") from exc
        if self.verify_shapes:
            _check_shapes(params, self.config, self.path)
        return params


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the marker of a checkpoint directory (the parameters stay on disk)."""
    path = Path(path)
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text())
        version = meta["format_version"]
        config = model_config_from_dict(meta["model_config"])
        dtype = meta["dtype"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not an orca_jax checkpoint (no {MARKER})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint marker {marker} is corrupt: {type(exc).__name__}: {exc}") from exc
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this orca_jax reads {FORMAT_VERSION}")
    try:
        check_supported(config)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path} holds a model this orca_jax cannot run: {exc}") from exc
    for part in (PARAMS_DIR, TOKENIZER_DIR):
        if not (path / part).is_dir():
            raise CheckpointError(f"checkpoint {path} is incomplete: {path / part} is missing")
    return Checkpoint(path, config, dtype, meta)


def load_tokenizer(checkpoint: Checkpoint):
    """orca_jax's own tokenizer class where it reads the saved one exactly, else AutoTokenizer."""
    from orca_jax.loading.tokenizer import load_tokenizer as load_tokenizer_dir

    return load_tokenizer_dir(checkpoint.path / TOKENIZER_DIR)


def model_config_from_dict(fields: dict[str, Any]) -> ModelConfig:
    """ModelConfig from its JSON form (lists back to the tuples it holds). Keys that ModelConfig
    no longer has are dropped: checkpoints written before a field was removed (such as
    `bos_token_id`, which nothing read) still open."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    dropped = sorted(set(fields) - known)
    if dropped:
        logger.debug("checkpoint model config: ignoring fields this orca_jax does not have: %s", dropped)
    fields = {name: value for name, value in fields.items() if name in known}
    if fields.get("rope_scaling") is not None:
        scaling = {key: tuple(value) if isinstance(value, list) else value for key, value in fields["rope_scaling"]}
        scaling.setdefault("rope_type", "llama3")  # written before other scalings existed
        fields["rope_scaling"] = tuple(sorted(scaling.items()))
    for name in ("rope_freq_factors", "eos_token_ids", "layer_types"):
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    return ModelConfig(**fields)


def _restore_targets(saved: dict, dtype, mesh: Mesh | None, config: ModelConfig, kv_head_repeats: int) -> dict:
    """Abstract arrays (shape, dtype, sharding) for orbax to restore into. K/V weights that the
    mesh repeats are restored whole, then repeated on device and sharded."""
    if mesh is None:
        one_device = SingleDeviceSharding(jax.local_devices()[0])
        return {"params": parallel.map_with_path(
            lambda name, leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), quantization.stored_dtype(name, leaf.dtype, dtype),
                                                    sharding=one_device), saved["params"]
        )}
    shardings = parallel.tree_paths(
        parallel.param_shardings(saved, mesh, logical_specs(config), whole_kv_heads=kv_head_repeats > 1)["params"]
    )
    return {"params": parallel.map_with_path(
        lambda name, leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), quantization.stored_dtype(name, leaf.dtype, dtype),
                                                sharding=shardings[name]), saved["params"]
    )}


def _stage_slice(leaf: jax.Array, row: Mesh) -> jax.Array:
    """One stage's part of a layer-stacked weight sharded over the stage axis: the shards on the
    row's devices, as an array of that row (no copy)."""
    devices = set(row.devices.flat)
    shards = [shard.data for shard in leaf.addressable_shards if shard.device in devices]
    sharding = NamedSharding(row, P(None, *tuple(leaf.sharding.spec)[1:]))  # the layer axis now whole
    shape = (leaf.shape[0] // leaf.sharding.mesh.shape[leaf.sharding.mesh.axis_names[0]], *leaf.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _check_shapes(params: dict, config: ModelConfig, path: Path) -> None:
    """The parameters are the tree that the model of the marker's config declares, shape for
    shape (a mismatched params/ directory would otherwise fail deep inside the first step)."""
    expected = parallel.tree_paths(nn.unbox(abstract_variables(config))["params"])
    got = parallel.tree_paths(params["params"])
    for name, leaf in expected.items():
        shape = tuple(leaf.shape)
        if name not in got or tuple(got[name].shape) != shape:
            found = tuple(got[name].shape) if name in got else "missing"
            raise CheckpointError(f"checkpoint {path}: parameter {name} is {found}, the model config needs {shape}")
    for name in got.keys() - expected.keys():
        raise CheckpointError(f"checkpoint {path}: parameter {name} is not one the model declares")


def _repeat_kv_heads_on_device(params: dict, config: ModelConfig, mesh: Mesh, repeats: int) -> dict:
    """K/V weights restored whole -> heads repeated by `parallel.repeat_kv_heads` (the host
    path's function, here on device arrays) and sharded over the mesh, in one jitted call."""
    logical = logical_specs(config)
    repeat = functools.partial(parallel.repeat_kv_heads, logical=logical, repeats=repeats, xp=jnp)
    shardings = parallel.param_shardings(jax.eval_shape(repeat, params), mesh, logical)
    # Donated, so the weights that pass through unchanged keep their buffers (no copy). The
    # whole K/V inputs change shape, so theirs cannot be reused, which jax would warn about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return jax.jit(repeat, out_shardings=shardings, donate_argnums=0)(params)
