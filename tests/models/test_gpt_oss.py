"""gpt-oss (orca_jax/models/gpt_oss.py) against Hugging Face transformers (PyTorch CPU, float32)
through the real engine path, and its MXFP4 experts (orca_jax/kernels/packed4.py) kept 4-bit.

The tiny model has what the real one has: attention sinks, sliding (window 8, below most
prompts here) and full layers alternating, YaRN RoPE, biases on the attention, the router and
every expert, the clamped SwiGLU, 6 experts top-2. Parity steps an engine with a small token
budget (chunked prefill, mixed steps, a late arrival; `drive_engine_against_hf` in conftest).

MXFP4: the same tiny model saved as the released checkpoints store their experts (`*_blocks`
codes, `*_scales`, a `quantization_config`), against a float checkpoint holding exactly the
dequantized weights: the logits agree to float32 rounding, and transformers itself reads the
MXFP4 file to the same logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from orca_jax import LLM, SamplingParams
from orca_jax.loading.loader import load_model
from orca_jax.models import config_from_hf
from orca_jax.models.moe_families import MoEForCausalLM
from orca_jax.worker.compile_guard import no_compiles

ATOL = 1e-4
WINDOW = 8
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW,
            max_position_embeddings=256, initializer_range=0.1)
ENGINE = dict(page_size=8, max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=4, num_pages=64,
              max_model_len=128)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def float_dir(tiny_hf_model_factory) -> Path:
    return tiny_hf_model_factory("GptOssConfig", seed=3, random_biases=True, **TINY)


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def mxfp4_dirs(float_dir, make_mxfp4_checkpoint) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint of the tiny model, a float checkpoint of its dequantized weights)."""
    return make_mxfp4_checkpoint(float_dir)


@pytest.fixture(scope="module")
def dequantize(float64_mxfp4_dequantize):
    return float64_mxfp4_dequantize


# ---- HF parity ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parity(float_dir, engine_parity, make_logits_engine):
    engine = make_logits_engine(model=str(float_dir), warmup=False, attention_impl="reference", **ENGINE)
    stats = engine_parity(engine, _hf_model(float_dir), np.random.default_rng(7), prompt_lengths=(5, 23, 12, 37))
    return engine, stats


def test_logits_match_transformers_through_engine(parity):
    engine, stats = parity
    print(f"gpt_oss: max |logit diff| = {stats['max_diff']:.3e} over {stats['compared_rows']} rows, "
          f"{stats['steps']} steps ({stats['mixed_steps']} mixed, {stats['partial_prefill_rows']} partial prefills)")
    assert stats["mixed_steps"] > 0 and stats["partial_prefill_rows"] > 0
    assert stats["max_diff"] <= ATOL
    assert type(engine.runner.model) is MoEForCausalLM
    config = engine.model_config
    assert config.layer_windows() == (WINDOW, None) and config.attention_sinks and config.moe_bias


def test_window_and_sinks_change_the_reference(float_dir):
    """Guards the parity case: in HF both the window and the sinks change the logits of a
    sequence longer than the window, so matching HF means the engine applied both."""
    tokens = torch.tensor([np.random.default_rng(0).integers(3, 512, size=4 * WINDOW).tolist()])
    model = _hf_model(float_dir)
    with torch.no_grad():
        base = model(tokens).logits[0, -1]
        model.model.layers[0].self_attn.sliding_window = None
        model.config.layer_types = ["full_attention"] * 2
        unwindowed = model(tokens).logits[0, -1]
        model = _hf_model(float_dir)
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no weight
        unsunk = model(tokens).logits[0, -1]
    assert (base - unwindowed).abs().max() > 1e-2
    assert (base - unsunk).abs().max() > 1e-2


def test_greedy_generation_matches_hf_generate(float_dir, greedy_matches_hf):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (3, 11, 20, 29)]
    greedy_matches_hf(LLM(model=str(float_dir), **ENGINE), _hf_model(float_dir), prompts, num_new=16)


def test_loader_tree_matches_model_init(float_dir, mxfp4_dirs, assert_tree_matches_model_init):
    assert_tree_matches_model_init(load_model(float_dir))
    assert_tree_matches_model_init(load_model(mxfp4_dirs[0]))


# ---- MXFP4 ---------------------------------------------------------------------------------------
def test_packed_experts_give_the_logits_of_their_dequantized_weights(mxfp4_dirs, make_logits_engine, engine_parity):
    """The engine on the MXFP4 checkpoint (experts unpacked inside the grouped matmul) against
    transformers on the float checkpoint of the same dequantized weights."""
    packed_dir, dequantized_dir = mxfp4_dirs
    engine = make_logits_engine(model=str(packed_dir), warmup=False, attention_impl="reference", **ENGINE)
    assert engine.model_config.expert_format == "mxfp4"
    stats = engine_parity(engine, _hf_model(dequantized_dir), np.random.default_rng(8))
    assert stats["max_diff"] <= ATOL, stats["max_diff"]


def test_transformers_reads_the_mxfp4_file_as_the_engine_does(mxfp4_dirs):
    """The layout written above is the released checkpoints': transformers dequantizes it to
    the same model as the float file (its own reading, on CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    packed_dir, dequantized_dir = mxfp4_dirs
    tokens = torch.tensor([list(range(3, 40))])
    # dequantize=True: transformers' own unpacking on CPU (its packed path needs a hub kernel).
    hf_packed = AutoModelForCausalLM.from_pretrained(packed_dir, dtype=torch.float32, attn_implementation="eager",
                                                     quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        from_packed = hf_packed(tokens).logits
        from_floats = _hf_model(dequantized_dir)(tokens).logits
    assert (from_packed - from_floats).abs().max() <= 1e-4 * from_floats.abs().max()


def test_packed_experts_take_under_a_third_of_bfloat16s_bytes(mxfp4_dirs):
    """Measured on the params tree the device holds: codes (half a byte per weight) and one
    scale byte per 32, 4.25 bits against bfloat16's 16."""
    loaded = load_model(mxfp4_dirs[0])
    moe = loaded.params["params"]["layers"]["moe"]
    packed_bytes = sum(moe[f"{name}_{part}"].nbytes for name in ("gate_proj", "up_proj", "down_proj")
                       for part in ("blocks", "scales"))
    c = loaded.config
    bfloat16_bytes = 2 * c.num_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    assert moe["gate_proj_blocks"].dtype == np.uint8
    assert packed_bytes / bfloat16_bytes <= 0.3
    assert packed_bytes / bfloat16_bytes == pytest.approx(4.25 / 16)


def test_quantization_none_unpacks_and_mxfp4_packs(mxfp4_dirs, dequantize):
    """The fallback switch: quantization="none" unpacks an MXFP4 checkpoint's experts at load
    (exactly: the float file's weights); quantization="mxfp4" packs a float checkpoint's (these
    weights are already on the MXFP4 grid, so packing them again gives the same codes)."""
    packed_dir, dequantized_dir = mxfp4_dirs
    unpacked = load_model(packed_dir, quantization="none")
    floats = load_model(dequantized_dir)
    assert unpacked.config.expert_format is None
    for name in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(unpacked.params["params"]["layers"]["moe"][name],
                                      floats.params["params"]["layers"]["moe"][name])
    repacked = load_model(dequantized_dir, quantization="mxfp4")
    original = load_model(packed_dir)
    assert repacked.config.expert_format == "mxfp4"
    got, want = repacked.params["params"]["layers"]["moe"], original.params["params"]["layers"]["moe"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        # A zero may be coded +0 or -0 and an all-zero block have any scale: compare values.
        np.testing.assert_array_equal(dequantize(got[f"{name}_blocks"], got[f"{name}_scales"]),
                                      dequantize(want[f"{name}_blocks"], want[f"{name}_scales"]))


def test_mxfp4_engine_compiles_nothing_after_warm_up(mxfp4_dirs):
    llm = LLM(model=str(mxfp4_dirs[0]), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rng = np.random.default_rng(5)
    with no_compiles():
        outs = llm.generate([{"prompt_token_ids": rng.integers(3, 512, size=n).tolist()} for n in (4, 17, 30)],
                            params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]


def test_mxfp4_on_a_dense_model_and_none_on_int8_are_refused(tiny_llama_factory):
    with pytest.raises(ValueError, match="has no experts"):
        load_model(tiny_llama_factory(), quantization="mxfp4")


# ---- config ------------------------------------------------------------------------------------
# gpt-oss-20b's config.json as on the hub (abridged to what the model reads).
GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                   intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, experts_per_token=4,
                   sliding_window=128, rms_norm_eps=1e-5, rope_theta=150000, max_position_embeddings=131072,
                   initial_context_length=4096, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
                   eos_token_id=200002, pad_token_id=199999, hidden_act="silu",
                   rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                   layer_types=["sliding_attention", "full_attention"] * 12,
                   quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                   "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"],
                                        "quant_method": "mxfp4"})


def test_config_fields_of_the_released_model():
    c = config_from_hf(GPT_OSS_20B)
    assert (c.model_type, c.num_layers, c.num_experts, c.num_experts_per_tok) == ("gpt_oss", 24, 32, 4)
    assert (c.hidden_size, c.moe_intermediate_size, c.head_dim, c.num_heads, c.num_kv_heads) == (2880, 2880, 64, 64, 8)
    assert c.qkv_bias and c.o_bias and c.attention_sinks and c.moe_bias and c.norm_topk_prob
    assert (c.swiglu_limit, c.swiglu_alpha, c.expert_format) == (7.0, 1.702, "mxfp4")
    assert c.layer_windows()[:4] == (128, None, 128, None)
    assert c.rope_theta == 150000.0 and dict(c.rope_scaling)["rope_type"] == "yarn"
    assert dict(c.rope_scaling)["truncate"] is False


def test_defaults_are_transformers_defaults():
    from transformers import GptOssConfig

    from orca_jax.models.gpt_oss import DEFAULT_ROPE, HF_DEFAULTS

    hf = GptOssConfig()
    for key, value in HF_DEFAULTS.items():
        assert getattr(hf, key) == value, key
    assert hf.rope_parameters == DEFAULT_ROPE
    minimal = config_from_hf({"model_type": "gpt_oss"})
    assert minimal.layer_types == tuple(hf.layer_types)


def test_other_quantization_methods_are_refused():
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        config_from_hf(dict(GPT_OSS_20B, quantization_config={"quant_method": "bitsandbytes"}))


def test_a_config_that_disagrees_with_its_tensors_is_refused(mxfp4_dirs, tmp_path):
    packed_dir = mxfp4_dirs[0]
    broken = tmp_path / "broken"
    shutil.copytree(packed_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds MXFP4 blocks but its config"):
        load_model(broken)


def test_the_layer_holds_no_float_copy_of_the_experts(mxfp4_dirs):
    """The blocked (CPU) path unpacks one expert per block inside the loop: the compiled layer
    has no float array of all of its experts [E, D, F] (either order)."""
    import re

    import jax.numpy as jnp

    from orca_jax.models.moe import SparseMoE

    c = load_model(mxfp4_dirs[0]).config
    E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
    module = SparseMoE(c)
    x = jnp.ones((24, D))
    params = jax.eval_shape(module.init, jax.random.key(0), x, jnp.int32(24))
    hlo = jax.jit(module.apply).lower(params, x, jnp.int32(24)).compile().as_text()
    shapes = {tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", hlo)}
    assert not [s for s in shapes if len(s) == 3 and s[0] == E and set(s[1:]) == {D, F}]
    assert [s for s in shapes if len(s) == 2 and set(s) == {D, F}]  # one expert's matrix, unpacked


def test_a_converted_checkpoint_keeps_the_experts_packed(mxfp4_dirs, tmp_path):
    """`orca-jax convert` of the MXFP4 model saves the codes and scales as they are; the
    checkpoint restores them packed, with its expert format in the config marker."""
    from orca_jax.loading.convert import convert

    convert(str(mxfp4_dirs[0]), tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt")
    assert restored.config.expert_format == "mxfp4"
    tree = restored.params.restore_host()
    original = load_model(mxfp4_dirs[0]).params["params"]["layers"]["moe"]
    for key in ("gate_proj_blocks", "down_proj_scales"):
        assert tree["params"]["layers"]["moe"][key].dtype == np.uint8
        np.testing.assert_array_equal(tree["params"]["layers"]["moe"][key], original[key])
    unpacked = load_model(tmp_path / "ckpt", quantization="none")
    assert unpacked.config.expert_format is None and unpacked.params["params"]["layers"]["moe"]["up_proj"].ndim == 4
