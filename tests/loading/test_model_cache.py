"""The model cache (`orca_jax.loading.model_cache`): a GGUF file converted once is restored from an orbax
entry keyed by its content hash and the dtype; stale, damaged, half-written and unwritable
caches cost a conversion, never a failure. Mostly on a tiny GGUF written here; once on the real
default model."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.loading import checkpoint, model_cache
from orca_jax.loading.loader import load_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 16, 2, 1, 8, 32, 2
TEXTS = ["the cat", "<s>hello</s> world", "tab\tnew\nline 123", "日本 😀", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def _saves_finish():
    """No save thread of one test outlives it (they write into its tmp_path)."""
    yield
    model_cache.wait_for_saves()


def _tokenizer_kv(writer) -> int:
    """Byte-level vocabulary: the 256 byte symbols, two merges, <s> and </s>. Returns its size."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    return len(tokens)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A random two-layer Llama GGUF (float32, tied embeddings), llama.cpp tensor names."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = _tokenizer_kv(writer)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    writer.add_tensor("token_embd.weight", w(vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", 1 + w(HIDDEN))
    for i in range(LAYERS):
        for name, shape in [("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,)), ("attn_q", (HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)), ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_output", (HIDDEN, HEADS * HEAD_DIM)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))]:
            writer.add_tensor(f"blk.{i}.{name}.weight", w(*shape) + (1 if "norm" in name else 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    return write_tiny_gguf(tmp_path / "model" / "tiny.gguf")


@pytest.fixture
def parse_counter(monkeypatch):
    """Counts GGUFReader constructions (each one is a parse of a file)."""
    calls = []
    real = gguf.GGUFReader

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return calls


@pytest.fixture
def no_parsing(monkeypatch):
    """After this, parsing a GGUF file fails the test."""
    def forbid():
        def refuse(*args, **kwargs):
            raise AssertionError(f"the GGUF file was parsed again: {args}")

        monkeypatch.setattr(gguf, "GGUFReader", refuse)

    return forbid


def _host(tree, dtype=None):
    """A copy (float32 GGUF tensors can be views of the file's memory map) in `dtype`."""
    return jax.tree.map(lambda x: np.array(x, jnp.dtype(dtype) if dtype else None, copy=True), tree)


def _assert_bit_identical(got, expected):
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _first_load(path, cache_dir, dtype="float32"):
    loaded = load_model(path, dtype=dtype, cache_dir=cache_dir)
    expected = _host(loaded.params, dtype)
    model_cache.wait_for_saves()
    return loaded, expected


def _assert_same_tokenizer(a, b):
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert a.chat_template == b.chat_template
    assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(messages, tokenize=False)
    assert (a.bos_token_id, a.eos_token_id, a.add_bos_token) == (b.bos_token_id, b.eos_token_id, b.add_bos_token)


# ---- hits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_restores_without_parsing(tiny_gguf, tmp_path, no_parsing, dtype):
    cache_dir = tmp_path / "cache"
    first, expected = _first_load(tiny_gguf, cache_dir, dtype)
    assert isinstance(first.params, dict)  # converted now
    assert {"gguf_parse_s", "tokenizer_s", "dequantize_convert_s", "cache_hash_s", "cache_save_s"} <= set(first.timings)
    [entry] = _entries(cache_dir)
    assert entry.name.endswith(f"-{dtype}") and checkpoint.is_checkpoint(entry)
    marker = json.loads((entry / checkpoint.MARKER).read_text())
    assert marker["cache"]["gguf_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert marker["dtype"] == dtype

    no_parsing()
    second = load_model(tiny_gguf, dtype=dtype, cache_dir=cache_dir)
    assert isinstance(second.params, model_cache.CachedCheckpoint)
    assert not second.params.verify_shapes, "its key vouches for the tree: no trace of the model at start"
    assert second.config == first.config and second.source == str(tiny_gguf)
    assert {"cache_hash_s", "cache_restore_open_s", "tokenizer_s"} <= set(second.timings)
    assert "gguf_parse_s" not in second.timings
    _assert_bit_identical(second.params.restore(dtype), expected)
    assert "cache_restore_s" in second.timings
    _assert_same_tokenizer(second.tokenizer, first.tokenizer)
    assert second.tokenizer.encode("the")[0] == first.tokenizer.bos_token_id  # add_bos_token survived the cache


def test_restored_params_are_placed_like_converted_ones(tiny_gguf, tmp_path):
    """Same placement, same step programs: a start from the cache reuses what the converting
    start compiled into the persistent compilation cache (committed arrays would change the HLO)."""
    cache_dir = tmp_path / "cache"
    _, expected = _first_load(tiny_gguf, cache_dir)
    converted = checkpoint.place_host_params(_host(expected), jnp.float32)  # as the runner places them
    restored = load_model(tiny_gguf, cache_dir=cache_dir).params.restore("float32")
    step = jax.jit(lambda params, x: params["params"]["embed"] @ x + params["params"]["final_norm"]["scale"].sum())
    x = jnp.ones(HIDDEN)
    assert step.lower(restored, x).as_text() == step.lower(converted, x).as_text()
    assert not any(leaf.committed for leaf in jax.tree.leaves(restored))


def test_each_dtype_has_its_own_entry(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    _, f32 = _first_load(tiny_gguf, cache_dir, "float32")
    _, bf16 = _first_load(tiny_gguf, cache_dir, "bfloat16")
    assert len(parse_counter) == 2  # the float32 entry does not serve bfloat16
    assert [e.name.rsplit("-", 1)[1] for e in _entries(cache_dir)] == ["bfloat16", "float32"]
    for dtype, expected in (("float32", f32), ("bfloat16", bf16)):
        hit = load_model(tiny_gguf, dtype=dtype, cache_dir=cache_dir)
        _assert_bit_identical(hit.params.restore(dtype), expected)
    assert len(parse_counter) == 2
    _assert_bit_identical(bf16, _host(f32, "bfloat16"))


def test_a_copied_file_hits_the_same_entry(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    assert isinstance(load_model(copy, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)
    assert len(parse_counter) == 1 and len(_entries(cache_dir)) == 1


def test_a_directory_holding_a_gguf_uses_the_cache(tiny_gguf, tmp_path):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf.parent, cache_dir)
    assert isinstance(load_model(tiny_gguf.parent, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)


# ---- the hash index ------------------------------------------------------------------------------
@pytest.fixture
def hash_counter(monkeypatch):
    calls = []
    real = hashlib.file_digest

    def counting(f, digest):
        calls.append(digest)
        return real(f, digest)

    monkeypatch.setattr(model_cache.hashlib, "file_digest", counting)
    return calls


def test_the_index_spares_hashing_an_unchanged_file(tiny_gguf, tmp_path, hash_counter):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    load_model(tiny_gguf, cache_dir=cache_dir)
    load_model(tiny_gguf, cache_dir=cache_dir)
    assert len(hash_counter) == 1
    index = json.loads((cache_dir / model_cache.INDEX_FILE).read_text())
    assert index[str(tiny_gguf.absolute())]["size"] == tiny_gguf.stat().st_size


def test_a_touched_file_is_hashed_again_and_still_hits(tiny_gguf, tmp_path, hash_counter, parse_counter):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)
    assert len(hash_counter) == 2 and len(parse_counter) == 1  # same content: same entry


def test_a_rewritten_file_is_converted_again(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    _, old = _first_load(tiny_gguf, cache_dir)
    write_tiny_gguf(tiny_gguf, seed=1)  # same path and size, new weights
    fresh = load_model(tiny_gguf, cache_dir=cache_dir)
    assert isinstance(fresh.params, dict) and len(parse_counter) == 2
    assert not np.array_equal(fresh.params["params"]["embed"], old["params"]["embed"])
    model_cache.wait_for_saves()
    assert len(_entries(cache_dir)) == 2  # one per content


def test_a_damaged_index_only_costs_a_hash(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    (cache_dir / model_cache.INDEX_FILE).write_text("{not json")
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)
    assert len(parse_counter) == 1
    json.loads((cache_dir / model_cache.INDEX_FILE).read_text())  # rewritten


@pytest.mark.parametrize("bad_digest", [None, 12345, "not-a-digest", "0" * 63], ids=["missing", "int", "text", "short"])
def test_a_damaged_index_entry_is_hashed_again_never_trusted(tiny_gguf, tmp_path, hash_counter, parse_counter,
                                                             bad_digest):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    index_file = cache_dir / model_cache.INDEX_FILE
    index = json.loads(index_file.read_text())
    entry = index[str(tiny_gguf.absolute())]
    if bad_digest is None:
        del entry["sha256"]
    else:
        entry["sha256"] = bad_digest
    index_file.write_text(json.dumps(index))
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)
    assert len(hash_counter) == 2 and len(parse_counter) == 1


# ---- damage, staleness, failures: rebuilt, never fatal ------------------------------------------
def test_a_corrupt_marker_is_logged_and_rebuilt(tiny_gguf, tmp_path, parse_counter, caplog):
    cache_dir = tmp_path / "cache"
    _, expected = _first_load(tiny_gguf, cache_dir)
    [entry] = _entries(cache_dir)
    (entry / checkpoint.MARKER).write_text("{garbage")
    with caplog.at_level(logging.WARNING, logger="orca_jax.loading.model_cache"):
        rebuilt = load_model(tiny_gguf, cache_dir=cache_dir)
    assert isinstance(rebuilt.params, dict) and len(parse_counter) == 2
    assert "unreadable" in caplog.text and entry.name in caplog.text
    model_cache.wait_for_saves()
    hit = load_model(tiny_gguf, cache_dir=cache_dir)  # the rebuilt entry replaced the damaged one
    _assert_bit_identical(hit.params.restore("float32"), expected)
    assert len(parse_counter) == 2


def test_a_damaged_tokenizer_is_rebuilt(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    [entry] = _entries(cache_dir)
    (entry / checkpoint.TOKENIZER_DIR / "tokenizer.json").write_text("[]")
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, dict)
    assert len(parse_counter) == 2


def test_damaged_arrays_found_at_restore_are_converted_again(tiny_gguf, tmp_path, parse_counter, caplog):
    """The marker reads fine, so the damage shows only when the runner restores: the entry then
    converts the file again instead of failing, and a fresh entry is written."""
    cache_dir = tmp_path / "cache"
    _, expected = _first_load(tiny_gguf, cache_dir)
    [entry] = _entries(cache_dir)
    for data in (entry / checkpoint.PARAMS_DIR).rglob("*.npy"):  # the arrays, truncated
        data.write_bytes(data.read_bytes()[:-7])
    hit = load_model(tiny_gguf, cache_dir=cache_dir)
    assert isinstance(hit.params, model_cache.CachedCheckpoint) and len(parse_counter) == 1
    with caplog.at_level(logging.WARNING, logger="orca_jax.loading.model_cache"):
        params = hit.params.restore("float32")
    assert "cannot be restored" in caplog.text and len(parse_counter) == 2
    _assert_bit_identical(params, expected)
    model_cache.wait_for_saves()
    again = load_model(tiny_gguf, cache_dir=cache_dir)
    _assert_bit_identical(again.params.restore("float32"), expected)
    assert len(parse_counter) == 2


def test_an_entry_from_other_conversion_code_is_rebuilt(tiny_gguf, tmp_path, parse_counter, monkeypatch):
    cache_dir = tmp_path / "cache"
    _first_load(tiny_gguf, cache_dir)
    monkeypatch.setattr(model_cache, "converter_fingerprint", lambda: "changed-code")
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, dict)
    model_cache.wait_for_saves()
    [entry] = _entries(cache_dir)  # replaced in place, not added
    assert json.loads((entry / checkpoint.MARKER).read_text())["cache"]["converter"] == "changed-code"
    assert isinstance(load_model(tiny_gguf, cache_dir=cache_dir).params, model_cache.CachedCheckpoint)


def test_converter_fingerprint_follows_the_model_code():
    """It digests every file that decides a converted entry, the config parsers among them
    (each family's, beside its model), so changing any of them makes old entries stale."""
    import inspect

    from orca_jax.models import ARCHITECTURES, hf_config
    from orca_jax.loading import loader

    first = model_cache.converter_fingerprint()
    assert first == model_cache.converter_fingerprint()
    sources = set(model_cache.fingerprint_sources())
    from orca_jax.config import ModelConfig

    deciding = [loader.gguf_config, loader.unpermute_rope_rows, hf_config.rope_from_hf, checkpoint.model_config_from_dict,
                ModelConfig]
    for arch in ARCHITECTURES.values():
        deciding += [arch.config_from_hf, arch.hf_to_params]
    assert {Path(inspect.getsourcefile(f)) for f in deciding} <= sources
    assert {"gguf_tokenizer.py", "tokenizer.py", "jinja_chat.py"} <= {p.name for p in sources}


def test_a_failed_save_leaves_no_entry(tiny_gguf, tmp_path, monkeypatch, caplog):
    """A save that stops half-way (as a killed run would) publishes nothing a later run trusts."""
    cache_dir = tmp_path / "cache"
    real = model_cache.npy_tree.save_tree

    def dies_after_the_params(out_dir, *args, **kwargs):
        real(out_dir, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(model_cache.npy_tree, "save_tree", dies_after_the_params)
    with caplog.at_level(logging.WARNING, logger="orca_jax.loading.model_cache"):
        _first_load(tiny_gguf, cache_dir)
    assert "could not save" in caplog.text and "disk full" in caplog.text
    assert _entries(cache_dir) == [] and not list(cache_dir.glob(".tmp-*"))


def test_a_killed_runs_temporary_directory_is_ignored_and_removed(tiny_gguf, tmp_path, parse_counter):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    half = cache_dir / f".tmp-{digest[:32]}-float32-{gone.pid}-deadbeef"
    (half / checkpoint.PARAMS_DIR).mkdir(parents=True)
    (half / checkpoint.MARKER).write_text("{}")
    loaded, _ = _first_load(tiny_gguf, cache_dir)
    assert isinstance(loaded.params, dict) and len(parse_counter) == 1  # not taken for an entry
    assert not half.exists() and len(_entries(cache_dir)) == 1


def test_an_unwritable_cache_dir_only_warns(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="orca_jax.loading.model_cache"):
        loaded, _ = _first_load(tiny_gguf, blocker / "cache")
    assert loaded.params["params"]["embed"].shape[1] == HIDDEN
    assert "could not save" in caplog.text


def test_no_cache_dir_writes_nothing(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCA_JAX_CACHE_DIR", str(tmp_path / "default-cache"))
    loaded = load_model(tiny_gguf, cache_dir=None)
    model_cache.wait_for_saves()
    assert isinstance(loaded.params, dict) and "cache_hash_s" not in loaded.timings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in tiny_gguf.parent.iterdir()) == ["tiny.gguf"]


def test_hf_directories_are_not_cached(tiny_llama_dir, tmp_path):
    loaded = load_model(tiny_llama_dir, cache_dir=tmp_path / "cache")
    assert isinstance(loaded.params, dict) and not (tmp_path / "cache").exists()


# ---- through the engine, and on the real default model --------------------------------------------
def test_engine_started_from_the_cache_generates_the_same_tokens(tiny_gguf, tmp_path):
    from orca_jax import SamplingParams
    from orca_jax.engine.engine import LLMEngine

    def run():
        engine = LLMEngine(model=str(tiny_gguf), model_cache_dir=str(tmp_path / "cache"), compilation_cache_dir=None,
                           max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16, page_size=8,
                           num_pages=16, max_model_len=64)
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
        model_cache.wait_for_saves()
        return tokens

    first = run()
    assert _entries(tmp_path / "cache")
    assert run() == first and len(first) == 6


@pytest.mark.slow
def test_default_model_round_trip(tmp_path, no_parsing):
    cache_dir = tmp_path / "cache"
    first, expected = _first_load(None, cache_dir)
    no_parsing()
    hit = load_model(None, cache_dir=cache_dir)
    assert hit.config == first.config
    _assert_bit_identical(hit.params.restore("float32"), expected)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for text in ["What is the capital of France?", "a\n\n1 😀 <|im_start|>x", "def f():\n\treturn 42"]:
        assert hit.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert hit.tokenizer.chat_template == first.tokenizer.chat_template
    assert (hit.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == first.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert hit.tokenizer.eos_token_id == first.tokenizer.eos_token_id == 2
