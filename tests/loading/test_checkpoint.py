"""orbax checkpoints (orca_jax/loading/checkpoint.py, written by orca_jax/loading/convert.py): convert once,
restore without converting, sharded or not; clear errors for missing and corrupt checkpoints."""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from orca_jax import SamplingParams
from orca_jax.loading import checkpoint
from orca_jax.distributed import parallel
from orca_jax.cli import main
from orca_jax.loading.convert import convert
from orca_jax.engine.engine import LLMEngine
from orca_jax.loading.loader import load_model

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=8, num_pages=32,
              max_model_len=128, warmup=False)


@pytest.fixture(scope="module")
def hf_dir(tiny_llama_factory) -> Path:
    return tiny_llama_factory(seed=3, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def ckpt_dir(hf_dir, tmp_path_factory) -> Path:
    """Converted through the command line, as a user would."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert main(["convert", str(hf_dir), str(out)]) == 0
    return out


def assert_trees_equal(restored: dict, expected: dict) -> None:
    a, b = parallel.tree_paths(restored), parallel.tree_paths(expected)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def test_checkpoint_layout_and_marker(ckpt_dir, hf_dir):
    assert {p.name for p in ckpt_dir.iterdir()} == {checkpoint.MARKER, checkpoint.PARAMS_DIR, checkpoint.TOKENIZER_DIR}
    meta = json.loads((ckpt_dir / checkpoint.MARKER).read_text())
    assert meta["format_version"] == checkpoint.FORMAT_VERSION and meta["dtype"] == "float32"
    assert checkpoint.open_checkpoint(ckpt_dir).config == load_model(hf_dir).config


def test_restored_parameters_equal_the_converted_ones(ckpt_dir, hf_dir):
    restored = checkpoint.open_checkpoint(ckpt_dir).restore()
    assert all(isinstance(x, jax.Array) and x.dtype == np.float32 for x in jax.tree.leaves(restored))
    assert_trees_equal(restored, load_model(hf_dir).params)


def test_bfloat16_conversion_round_trips(hf_dir, tmp_path):
    out = tmp_path / "bf16"
    convert(str(hf_dir), out, dtype="bfloat16")
    opened = checkpoint.open_checkpoint(out)
    assert opened.dtype == "bfloat16"
    restored = opened.restore()
    expected = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16), load_model(hf_dir).params)
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(restored))
    assert_trees_equal(restored, expected)


def test_engine_starts_from_the_checkpoint_without_converting(ckpt_dir, hf_dir, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 99, 3], list(range(10, 31))]

    def generate(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [done[str(i)] for i in range(len(prompts))]

    original = LLMEngine(model=str(hf_dir), **ENGINE)
    expected, expected_ids = generate(original), original.tokenizer.encode("The quick brown fox")

    def no_conversion(*_args, **_kwargs):
        raise AssertionError("the checkpoint path must not read or convert the original weights")

    import orca_jax.loading.loader as loader

    monkeypatch.setattr(loader, "read_safetensors", no_conversion)
    monkeypatch.setattr(loader, "hf_to_params", no_conversion)
    engine = LLMEngine(model=str(ckpt_dir), **ENGINE)
    assert engine.tokenizer.encode("The quick brown fox") == expected_ids
    assert generate(engine) == expected


def test_sharded_round_trip_on_eight_devices(ckpt_dir, hf_dir, tmp_path, run_parallel_worker):
    """Restored onto meshes of 2 and 4 devices (4: KV heads replicated 2x on restore), each
    device holding its slice; saved sharded over 4 and restored on one device; and the engine
    at tensor_parallel_size 4 on the checkpoint generates what one device does on the HF files."""
    result = run_parallel_worker("checkpoint", str(hf_dir), str(ckpt_dir), str(tmp_path / "sharded"))
    for tp, k_heads in (("2", 1), ("4", 1)):
        assert result[tp]["equal"] and result[tp]["devices"] == int(tp)
        assert result[tp]["q_spec"] == str(jax.sharding.PartitionSpec(None, None, "model", None))
        assert result[tp]["k_shard_shape"][2] == k_heads  # one KV head per device
    assert result["sharded_save_restored_whole_equal"]
    assert result["generate_equal"]


# ---- errors -----------------------------------------------------------------------------------
@pytest.fixture
def broken_copy(ckpt_dir, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(ckpt_dir, copy)
    return copy


def test_missing_params_named(broken_copy):
    shutil.rmtree(broken_copy / checkpoint.PARAMS_DIR)
    with pytest.raises(checkpoint.CheckpointError, match=f"incomplete: {broken_copy / 'params'} is missing"):
        LLMEngine(model=str(broken_copy), **ENGINE)


def test_corrupt_marker_named(broken_copy):
    (broken_copy / checkpoint.MARKER).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match=f"marker {broken_copy / checkpoint.MARKER} is corrupt"):
        load_model(broken_copy)


def test_a_marker_with_fields_since_removed_still_opens(broken_copy, ckpt_dir):
    """Checkpoints converted before `ModelConfig.bos_token_id` was removed saved it: ignored."""
    marker = broken_copy / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    assert "bos_token_id" not in meta["model_config"]
    meta["model_config"]["bos_token_id"] = 1
    marker.write_text(json.dumps(meta))
    opened = checkpoint.open_checkpoint(broken_copy)
    assert opened.config == checkpoint.open_checkpoint(ckpt_dir).config
    assert not hasattr(opened.config, "bos_token_id")


@pytest.mark.parametrize("field, value", [("model_type", "mamba"), ("hidden_act", "relu_squared")])
def test_a_marker_for_a_model_this_version_cannot_run_is_refused_at_open(broken_copy, field, value):
    marker = broken_copy / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    meta["model_config"][field] = value
    marker.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=f"cannot run: unsupported {field} '{value}'"):
        checkpoint.open_checkpoint(broken_copy)


def test_unknown_format_version_refused(broken_copy):
    marker = broken_copy / checkpoint.MARKER
    marker.write_text(json.dumps(dict(json.loads(marker.read_text()), format_version=99)))
    with pytest.raises(checkpoint.CheckpointError, match="format version 99"):
        load_model(broken_copy)


# After a failed read, orbax leaves tensorstore reads in flight whose callbacks find orbax's
# event loop closed; they finish within the wait below and are only reported, not raised.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_array_data_named(broken_copy):
    data_files = [p for p in (broken_copy / checkpoint.PARAMS_DIR).rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for f in data_files:
        f.write_bytes(b"\x00garbage" * 16)
    with pytest.raises(checkpoint.CheckpointError, match=f"could not restore orbax checkpoint {broken_copy / 'params'}"):
        LLMEngine(model=str(broken_copy), **ENGINE)
    time.sleep(1.0)
    gc.collect()


def test_params_that_do_not_fit_the_config_are_refused(broken_copy):
    marker = broken_copy / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    meta["model_config"]["hidden_size"] = 32
    marker.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="parameter embed is"):
        checkpoint.open_checkpoint(broken_copy).restore()


# Every parameter is checked against the tree the model declares, not just a few named ones.
@pytest.mark.parametrize("field,value,message", [
    ("qkv_bias", True, r"parameter layers/attn/k_proj/bias is missing, the model config needs \(2, 2, 16\)"),
    ("tie_word_embeddings", True, "parameter lm_head is not one the model declares"),
])
def test_params_missing_from_or_extra_to_the_model_are_refused(broken_copy, field, value, message):
    marker = broken_copy / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    assert meta["model_config"][field] != value
    meta["model_config"][field] = value
    marker.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.open_checkpoint(broken_copy).restore()


def test_convert_refuses_a_non_empty_directory_and_a_checkpoint(ckpt_dir, hf_dir, tmp_path, capsys):
    assert main(["convert", str(hf_dir), str(ckpt_dir)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(checkpoint.CheckpointError, match="already an orca_jax checkpoint"):
        convert(str(ckpt_dir), tmp_path / "again")


def test_convert_refuses_a_tensor_parallel_size_below_one(hf_dir, tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="at least 1"):
        convert(str(hf_dir), tmp_path / "out", tensor_parallel_size=0)
    assert not (tmp_path / "out").exists()
