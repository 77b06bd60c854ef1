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
            "qwen2.5-7b-h100"} <= set(names)


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
    ('[engine]\ndtype = "float16"\n', "dtype"),                   # EngineConfig's own check
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
