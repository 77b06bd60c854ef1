"""Presets in configs/: every one builds an EngineConfig (no weights loaded), mistakes name the
key and the file, and command-line flags win over a --config preset."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from orca_jax.cli import commands as cli
from orca_jax.config import EngineConfig
from orca_jax.entrypoints.presets import engine_config_from_preset, list_presets, load_preset

REPO = Path(__file__).resolve().parents[2]
PRESET_FILES = sorted((REPO / "configs").glob("*.toml"))


def test_the_issue_presets_are_shipped():
    names = list_presets()
    assert names == sorted(p.stem for p in PRESET_FILES)
    assert {"smollm2-cpu", "llama-3.2-1b-gpu", "llama-3.1-8b-h100", "llama-3.1-8b-tpu-v5e-8",
            "qwen2.5-7b-h100", "gemma-3-27b-it-tpu-v5e-8", "gemma-3-4b-it-gpu", "gemma-2-9b-it-tpu-v5e-4",
            "phi-4-mini-cpu"} <= set(names)


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_parses_and_builds_an_engine_config(path):
    preset = load_preset(path)
    config = engine_config_from_preset(preset)
    assert isinstance(config, EngineConfig)
    assert preset["description"].strip()
    assert config.model == preset["model"]
    for key, value in preset["engine"].items():
        assert getattr(config, key) == value


def test_cpu_preset_is_the_embedded_default_and_tpu_preset_is_tensor_parallel():
    assert load_preset("smollm2-cpu")["model"] is None
    tpu = engine_config_from_preset(load_preset("llama-3.1-8b-tpu-v5e-8"))
    assert tpu.tensor_parallel_size == 8 and tpu.model == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("spelling", ["smollm2-cpu", "smollm2-cpu.toml", "configs/smollm2-cpu",
                                      "configs/smollm2-cpu.toml", str(REPO / "configs" / "smollm2-cpu.toml")])
def test_a_preset_is_found_by_name_or_path(spelling, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # names and "configs/NAME" resolve without the repository as cwd
    assert load_preset(spelling)["name"] == "smollm2-cpu"


def test_dotted_names_keep_their_dots():
    assert load_preset("qwen2.5-7b-h100")["model"] == "Qwen/Qwen2.5-7B-Instruct"


def test_missing_preset_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-cpu"):
        load_preset("no-such-preset")


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key", [
    ('descripton = "typo"\n', "descripton"),
    ('[engine]\nmax_num_seq = 4\n', "engine.max_num_seq"),
    ('[engine]\ntoken_buckets = [8, 16]\n', "engine.token_buckets"),  # derived, never set
])
def test_unknown_key_names_the_key_and_the_file(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match="unknown key") as info:
        load_preset(path)
    assert f"'{key}'" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, field", [
    ('[engine]\ndtype = "float8"\n', "dtype"),                   # EngineConfig's own check
    ('[engine]\nmax_num_seqs = 64\nmax_num_batched_tokens = 32\n', "max_num_batched_tokens"),
    ('[engine]\ngpu_memory_utilization = 1.5\n', "gpu_memory_utilization"),
    ('[engine]\nmax_num_seqs = "32"\n', "max_num_seqs"),           # a quoted number
    ('[engine]\npage_size = 16.0\n', "page_size"),
    ('model = 7\n', "model"),
])
def test_bad_value_is_a_value_error_naming_the_file(tmp_path, text, field):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        engine_config_from_preset(load_preset(path))
    assert field in str(info.value) and str(path) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    path = _write(tmp_path, "[engine\n")
    with pytest.raises(ValueError, match="not valid TOML") as info:
        load_preset(path)
    assert str(path) in str(info.value)


def test_overrides_win_and_unknown_overrides_are_refused():
    preset = load_preset("llama-3.2-1b-gpu")
    config = engine_config_from_preset(preset, max_num_seqs=8, model="/local/llama")
    assert config.max_num_seqs == 8 and config.model == "/local/llama"
    assert config.max_num_batched_tokens == preset["engine"]["max_num_batched_tokens"]
    with pytest.raises(ValueError, match="max_num_seq"):
        engine_config_from_preset(preset, max_num_seq=8)


# ---- the command line ------------------------------------------------------------------------
def _cli_config(*argv: str) -> EngineConfig:
    """Parse with the real parser and build the EngineConfig the command would start with."""
    return cli._engine_config(cli.build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_preset_values_survive_when_flags_are_not_given(command):
    preset = load_preset("llama-3.1-8b-h100")
    config = _cli_config(*command, "--config", "configs/llama-3.1-8b-h100")
    assert config == engine_config_from_preset(preset)
    assert config.dtype == "bfloat16" and config.max_num_seqs == 256  # not the CLI's defaults


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_flags_given_explicitly_override_the_preset(command):
    config = _cli_config(*command, "--config", "llama-3.1-8b-h100", "--max-num-seqs", "4",
                         "--dtype", "float32", "--model", "/models/mine", "--max-model-len", "1024")
    assert (config.max_num_seqs, config.dtype, config.model, config.max_model_len) == (4, "float32", "/models/mine", 1024)
    assert config.max_num_batched_tokens == 4096 and config.page_size == 16  # still the preset's


def test_cli_without_a_preset_uses_engine_config_defaults():
    assert _cli_config("serve") == EngineConfig()
    assert _cli_config("generate", "hi", "--page-size", "8") == EngineConfig(page_size=8)


def test_cli_bad_preset_is_a_clean_error(tmp_path, capsys):
    path = _write(tmp_path, '[engine]\nmax_num_seq = 4\n')
    assert cli.main(["generate", "hi", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_num_seq" in err and str(path) in err


# ---- packaging -------------------------------------------------------------------------------
def test_every_package_directory_is_listed_in_pyproject():
    """pyproject.toml lists packages by hand (so configs/ can ship as orca_jax.configs); a new
    subpackage that is not listed would be missing from the wheel."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(d.relative_to(REPO).parts) for d in (REPO / "orca_jax").rglob("*")
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))}
    on_disk.add("orca_jax")
    assert on_disk <= listed
    assert "orca_jax.configs" in listed


def test_scheduling_flag_overrides_the_preset():
    from orca_jax.cli.commands import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--config", "smollm2-cpu", "--scheduling", "request"])
    assert _engine_config(args).scheduling == "request"
    args = build_parser().parse_args(["serve", "--config", "smollm2-cpu"])
    assert _engine_config(args).scheduling == "iteration"


# Qwen3-30B-A3B's config.json (the hub's, abridged to what the model reads).
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


@pytest.mark.parametrize("name, devices", [("qwen3-30b-a3b-h200", 1), ("qwen3-30b-a3b-tpu-v5e-8", 8)])
def test_moe_presets_fit_the_model_they_name(name, devices):
    """The layout the preset asks for is one the model allows, and its description's sizes are
    the model's: 30.5B parameters, 3.35B active per token, 61 GB in bfloat16, 7.6 GB per chip."""
    import flax.linen as nn
    import numpy as np

    from orca_jax.distributed import parallel
    from orca_jax.models import abstract_variables, config_from_hf

    config = engine_config_from_preset(load_preset(name))
    assert config.tensor_parallel_size == devices
    model = parallel.expert_layout(config_from_hf(QWEN3_30B_A3B), devices, config.enable_expert_parallel)
    parallel.kv_head_repeats(model, devices)  # raises if the heads cannot be split
    sizes = {path: int(np.prod(leaf.shape))
             for path, leaf in parallel.tree_paths(nn.unbox(abstract_variables(model))["params"]).items()}
    total = sum(sizes.values())
    experts = sum(sizes[f"layers/moe/{name}"] for name in ("gate_proj", "up_proj", "down_proj"))
    active = total - experts + experts * model.num_experts_per_tok // model.num_experts
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 2) == 3.35
    assert round(2 * total / 1e9) == 61
    if config.enable_expert_parallel:
        assert model.num_experts // devices == 16 and round(2 * total / devices / 1e9, 1) == 7.6


# ---- the presets of the Gemma and Phi families, against the real models -------------------
# config.json as on the hub, abridged to what the model reads. Gemma 3's is the vision-language
# file, whose text_config lists only what differs from transformers' defaults. Phi-4-mini's
# LongRoPE factors are 48 numbers each that change no size, so ones stand in for them.
GEMMA_3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
               "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                               "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                               "num_key_value_heads": 16, "query_pre_attn_scalar": 168, "sliding_window": 1024,
                               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
               "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
GEMMA_3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "sliding_window": 1024,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
              "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
GEMMA_2_9B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
                  intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                  hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, eos_token_id=1)
PHI_4_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
                  intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=131072,
                  original_max_position_embeddings=4096, partial_rotary_factor=0.75, sliding_window=262144,
                  rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
                  tie_word_embeddings=True, hidden_act="silu", eos_token_id=[200020, 199999])

GiB = 1 << 30
# preset -> (hub config, the machine's memory per device in bytes, published parameter counts:
# (embedding, non-embedding) exactly for Gemma 2 (its report), non-embedding in millions for
# Gemma 3 (its report, Table 1; its embedding row adds the vision projector), the total in
# billions for Phi-4-mini (its model card).
FAMILY_PRESETS = {
    "gemma-3-27b-it-tpu-v5e-8": (GEMMA_3_27B, 16 * GiB, dict(non_embedding_m=25_600)),
    "gemma-3-4b-it-gpu": (GEMMA_3_4B, 24 * 10**9, dict(non_embedding_m=3_209)),
    "gemma-2-9b-it-tpu-v5e-4": (GEMMA_2_9B, 16 * GiB, dict(embedding=917_504_000, non_embedding=8_324_201_984)),
    "phi-4-mini-cpu": (PHI_4_MINI, 16 * 10**9, dict(total_b=3.84)),
}


def _weight_bytes_per_device(model, dtype: str, devices: int) -> tuple[dict[str, int], int]:
    """Parameter counts by path and the bytes one device holds, as the engine stores them."""
    import flax.linen as nn
    import numpy as np

    from orca_jax.distributed import parallel
    from orca_jax.kernels.quantization import stored_dtype
    from orca_jax.models import abstract_variables

    leaves = parallel.tree_paths(nn.unbox(abstract_variables(model))["params"])
    sizes = {path: int(np.prod(leaf.shape)) for path, leaf in leaves.items()}
    total_bytes = sum(size * stored_dtype(path, leaves[path].dtype, dtype).itemsize for path, size in sizes.items())
    return sizes, total_bytes // devices


@pytest.mark.parametrize("name", list(FAMILY_PRESETS))
def test_family_presets_fit_the_model_and_machine_they_name(name):
    """The model's sizes are the published ones; the layout the preset asks for splits its heads
    without copies; weights and a full-length sequence's KV fit the machine; and the numbers
    in the preset's description and comments are these."""
    import dataclasses

    from orca_jax.core.kv_cache import kv_bytes_per_page
    from orca_jax.distributed import parallel
    from orca_jax.models import config_from_hf

    hub, memory, published = FAMILY_PRESETS[name]
    preset = load_preset(name)
    config = engine_config_from_preset(preset)
    devices = config.tensor_parallel_size
    model = dataclasses.replace(config_from_hf(hub), quantization=config.quantization)
    assert parallel.kv_head_repeats(model, devices) == 1  # the KV cache shards without copies
    assert config.max_model_len <= model.max_position_embeddings

    sizes, weights = _weight_bytes_per_device(model, config.dtype, devices)
    embedding = sizes["embed"]
    total = sum(size for path, size in sizes.items() if not path.endswith(("qscale", "qzero")))
    assert embedding == model.vocab_size * model.hidden_size and model.tie_word_embeddings
    non_embedding = total - embedding
    if "embedding" in published:
        assert (embedding, non_embedding) == (published["embedding"], published["non_embedding"])
    if "non_embedding_m" in published:
        assert round(non_embedding / 1e6) == published["non_embedding_m"]
    if "total_b" in published:
        assert round(total / 1e9, 2) == published["total_b"]

    kv_dtype = config.resolved_kv_cache_dtype("cpu" if config.dtype == "float32" else "tpu")
    kv_per_token = kv_bytes_per_page(model, 1, kv_dtype) // devices
    text = preset["description"] + (REPO / "configs" / f"{name}.toml").read_text()
    if config.kv_cache_memory_bytes != EngineConfig().kv_cache_memory_bytes:  # CPU: a stated budget
        budget = config.kv_cache_memory_bytes
        assert weights + budget <= memory * 0.5  # room for the OS, the activations and the rest
    else:  # an accelerator: a fraction of what the weights leave
        budget = int((memory - weights) * config.gpu_memory_utilization)
    pool_tokens = budget // kv_per_token
    assert pool_tokens >= 2 * config.max_model_len, f"{pool_tokens} tokens of KV"
    # The figures the preset states.
    if name == "gemma-3-27b-it-tpu-v5e-8":
        assert f"{weights / 1e9:.1f} GB" in text and kv_per_token // 1024 == 62 and pool_tokens > 100_000
        assert model.layer_windows()[:6] == (1024,) * 5 + (None,)
    if name == "gemma-3-4b-it-gpu":
        assert f"{weights / 1e9:.1f} GB" in text and f"{kv_per_token // 1024} KiB" in text
        assert f"{total / 1e9:.1f}B" in text and model.layer_windows()[:6] == (1024,) * 5 + (None,)
    if name == "gemma-2-9b-it-tpu-v5e-4":
        assert f"{weights / 1e9:.1f} GB" in text and f"{kv_per_token // 1024} KiB" in text
        assert model.layer_windows()[:2] == (4096, None) and model.attn_logit_softcapping == 50.0
    if name == "phi-4-mini-cpu":
        float32 = _weight_bytes_per_device(dataclasses.replace(model, quantization=None), "float32", 1)[1]
        assert f"{weights / 1e9:.1f} GB" in text and f"{float32 / 1e9:.1f} GB" in text
        assert f"{pool_tokens:,} tokens" in text and kv_per_token == 256 * 1024
        # Within the pretraining context LongRoPE uses its short factors only, as HF does.
        assert config.max_model_len == dict(model.rope_scaling)["original_max_position_embeddings"]


# ---- gpt-oss: MXFP4 experts, against the real models' configs ------------------------------
# gpt-oss-20b's and -120b's config.json as on the hub, abridged to what differs from
# transformers' defaults (which are the 120b's) and what the loader reads.
_GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                quantization_config={"quant_method": "mxfp4"})
GPT_OSS_20B = dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)
GPT_OSS_120B = dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)
# preset -> (hub config, memory per device in bytes, published (total, active) parameters in
# billions: the gpt-oss model card's Table 1, 20.91 / 3.61 and 116.83 / 5.13).
GPT_OSS_PRESETS = {
    "gpt-oss-20b-h200": (GPT_OSS_20B, 141 * 10**9, (20.91, 3.61)),
    "gpt-oss-20b-24gb": (GPT_OSS_20B, 24 * 10**9, (20.91, 3.61)),
    "gpt-oss-120b-h200": (GPT_OSS_120B, 141 * 10**9, (116.83, 5.13)),
    "gpt-oss-120b-tpu-v5e-8": (GPT_OSS_120B, 16 * GiB, (116.83, 5.13)),
    "gpt-oss-120b-tpu-v6e-8": (GPT_OSS_120B, 32 * GiB, (116.83, 5.13)),
}


def _bytes_per_device(model, dtype: str, devices: int) -> int:
    """The weight bytes one device holds: a leaf with an axis on the mesh split, the rest whole."""
    import flax.linen as nn
    import numpy as np

    from orca_jax.distributed import parallel
    from orca_jax.kernels.quantization import stored_dtype
    from orca_jax.models import abstract_variables, logical_specs

    leaves = parallel.tree_paths(nn.unbox(abstract_variables(model))["params"])
    specs = parallel.tree_paths(logical_specs(model)["params"])
    rules = dict(parallel.LOGICAL_AXIS_RULES)
    total = 0
    for path, leaf in leaves.items():
        size = int(np.prod(leaf.shape)) * stored_dtype(path, leaf.dtype, dtype).itemsize
        total += size // devices if any(rules.get(axis) for axis in tuple(specs[path]) if axis) else size
    return total


@pytest.mark.parametrize("name", list(GPT_OSS_PRESETS))
def test_gpt_oss_presets_fit_the_model_and_machine_they_name(name):
    """Parameters as published (a packed byte holds two; the experts' biases count with their
    experts), the MXFP4 weights and the KV cache fit the machine with the layout asked for, and
    the preset's figures are these."""
    import flax.linen as nn
    import numpy as np

    from orca_jax.core.kv_cache import kv_bytes_per_page
    from orca_jax.distributed import parallel
    from orca_jax.models import abstract_variables, config_from_hf

    hub, memory, (published_total, published_active) = GPT_OSS_PRESETS[name]
    preset = load_preset(name)
    config = engine_config_from_preset(preset)
    devices = config.tensor_parallel_size
    assert config.quantization == "mxfp4"
    model = parallel.expert_layout(config_from_hf(hub), devices, config.enable_expert_parallel)
    assert model.expert_format == "mxfp4" and parallel.kv_head_repeats(model, devices) == 1

    sizes = {path: int(np.prod(leaf.shape))
             for path, leaf in parallel.tree_paths(nn.unbox(abstract_variables(model))["params"]).items()}
    expert = sum(2 * n if path.endswith("_blocks") else n for path, n in sizes.items()
                 if path.startswith("layers/moe/") and path.endswith(("_blocks", "gate_bias", "up_bias", "down_bias")))
    total = sum(n for path, n in sizes.items() if not path.endswith(("_blocks", "_scales"))) + \
        sum(2 * n for path, n in sizes.items() if path.endswith("_blocks"))
    active = total - expert + expert * model.num_experts_per_tok // model.num_experts - sizes["embed"]
    assert (round(total / 1e9, 2), round(active / 1e9, 2)) == (published_total, published_active)

    weights = _bytes_per_device(model, config.dtype, devices)
    kv_per_token = kv_bytes_per_page(model, 1, "bfloat16") // devices
    pool_tokens = int((memory - weights) * config.gpu_memory_utilization) // kv_per_token
    assert pool_tokens >= 2 * config.max_model_len and config.max_model_len <= model.max_position_embeddings
    text = preset["description"] + (REPO / "configs" / f"{name}.toml").read_text()
    assert f"{weights / 1e9:.1f} GB" in text and f"{kv_per_token // 1024} KiB per token" in text
    tokens = f"{pool_tokens / 1e6:.1f}M" if pool_tokens >= 10**6 else f"{round(pool_tokens / 1000)}k"
    assert f"about {tokens} tokens" in text, tokens
    if name.startswith("gpt-oss-20b"):  # bfloat16 experts would not fit 24 GB
        assert f"{2 * total / 1e9:.1f} GB" in text and 2 * total > 24 * 10**9
    if name == "gpt-oss-120b-h200":
        assert f"{2 * total / 1e9:.1f} GB in bfloat16" in text and 2 * total > memory
    if devices > 1:
        assert model.expert_parallel and model.num_experts // devices == 16
