"""Shared fixtures: tiny random checkpoints (Llama and the other families) saved with
transformers, and engines on them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

TINY_VOCAB = 512
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Iteration-level scheduling lets finished requests leave after every step.",
    "Selective batching flattens all tokens of all requests into one axis.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
] * 20


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_root(tmp_path_factory):
    """Everything orca_jax caches between runs (compiled programs, converted weights) goes to
    a directory of this test session, never to the user's ~/.cache; child processes the tests
    start inherit it."""
    import os

    from orca_jax.cache_dirs import CACHE_DIR_ENV

    root = _run_directory(tmp_path_factory) / "orca-jax-cache"
    root.mkdir(exist_ok=True)
    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(root)
    yield root
    if before is None:
        del os.environ[CACHE_DIR_ENV]
    else:
        os.environ[CACHE_DIR_ENV] = before


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, but odd-numbered workers take files from the end of the collection
    and even-numbered ones from its start. Files of one folder build engines that compile the
    same programs; two workers running neighbouring files at once both compile them (measured:
    the two default-model files took 90 s side by side against 86 s one after the other). Walking
    the tree from opposite ends, one worker runs a folder's files in a row and the second file
    loads from the shared compilation cache what the first compiled."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FromBothEnds(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if self.workqueue and int(node.gateway.id.lstrip("gw") or 0) % 2 == 1:
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return FromBothEnds(config, log)


def _run_directory(tmp_path_factory) -> Path:
    """This run's temporary directory, the same for every pytest-xdist worker of the run (each
    worker's own base directory sits inside it), so the workers share one cache: a program one
    worker compiled, another loads."""
    import os

    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def make_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer (vocab TINY_VOCAB) saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(directory)


def make_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a random LlamaForCausalLM (float32) with `save_pretrained`, plus a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(torch.float32).eval()
    # Random init has tiny weights; scale the norms so the logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    make_tokenizer(directory)
    return directory


def make_tiny_hf_model(directory: Path, config_class_name: str, seed: int = 0, random_biases: bool = False,
                       **settings) -> Path:
    """Save a random causal LM of any transformers family (float32), plus the tiny tokenizer.
    `config_class_name` names a transformers config class ("GPT2Config", "Qwen3Config", ...);
    `settings` are its arguments (the vocabulary and special token ids default to the
    tokenizer's). Norm weights are drawn from [0.5, 1.5] so the logits are not all near zero;
    with `random_biases`, biases (zero at init) are drawn too, so a mishandled bias shows."""
    import torch
    import transformers

    settings = dict(dict(vocab_size=TINY_VOCAB, bos_token_id=1, eos_token_id=2), **settings)
    config = getattr(transformers, config_class_name)(**settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:  # "ln_": GPT-2's LayerNorms
                if name.endswith(".bias"):
                    p.uniform_(-0.5, 0.5)
                else:
                    p.uniform_(0.5, 1.5)
            elif random_biases and name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss: gate_up_proj_bias, sinks
                p.normal_(0.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_model_factory(tmp_path_factory):
    """make(config_class_name, seed=0, random_biases=False, **config settings) -> directory of
    a saved random model (cached per arguments). See `make_tiny_hf_model`."""
    cache: dict[str, Path] = {}

    def make(config_class_name: str, seed: int = 0, random_biases: bool = False, **settings) -> Path:
        key = json.dumps({"cls": config_class_name, "seed": seed, "biases": random_biases, **settings}, sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"tiny-{config_class_name.removesuffix('Config').lower()}")
            cache[key] = make_tiny_hf_model(directory, config_class_name, seed, random_biases, **settings)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def torch_single_thread():
    """PyTorch is only the reference in tests. On a small shared CPU its OpenMP threads spin-wait
    against JAX's and the other test processes (a 135M forward is ~6x slower with 2 threads
    than with 1), so run it single-threaded and restore the setting afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """make(**LlamaConfig overrides) -> directory of a saved random model (cached per settings)."""
    cache: dict[str, Path] = {}

    def make(seed: int = 0, **overrides) -> Path:
        key = json.dumps({"seed": seed, **overrides}, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """GQA (4 query heads over 2 KV heads), untied head, head_dim 16."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# The real default model's engine in the end-to-end tests (test_default_model.py,
# test_server_structured_default_model.py): two token buckets (32, 64), since a program of the
# 30-layer model takes 15-20 s to compile on 2 cores; a 64-token budget still splits ~40-token chat
# prompts into chunks beside decodes; a context that holds three tools' description and a reply.
# One setting for both modules, so the second builds nothing the first compiled.
DEFAULT_MODEL_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, min_token_bucket=32, max_model_len=512,
                            page_size=16, num_pages=264)


@pytest.fixture(scope="session")
def default_model_engine_settings() -> dict:
    """DEFAULT_MODEL_ENGINE (test modules cannot import conftest)."""
    return dict(DEFAULT_MODEL_ENGINE)


# The tiny engine's settings (tiny_engine_factory), for tests that build it another way.
TINY_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=256)


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama_dir):
    """Build LLMEngines on the tiny model; compile-heavy, so reuse them.

    One token bucket unless the test asks for more (`min_token_bucket`): each bucket is a step
    program that takes seconds to compile even for this model, and a test that does not look at
    bucketing runs the same steps, padded to the one bucket. The defaults are the settings most
    modules need, so that engines built alike in different modules share their programs (the
    run's persistent compilation cache)."""
    from orca_jax.engine.engine import LLMEngine

    def build(**overrides):
        settings = dict(model=str(tiny_llama_dir), **TINY_ENGINE)
        settings.update(overrides)
        settings.setdefault("min_token_bucket", settings["max_num_batched_tokens"])
        return LLMEngine(**settings)

    return build


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


class _HFLastLogits:
    """HF logits at the last position of a token sequence (memoised)."""

    def __init__(self, model):
        self.model = model
        self.cache: dict[tuple[int, ...], object] = {}  # tokens -> numpy logits

    def __call__(self, tokens: list[int]):
        import torch

        key = tuple(tokens)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model(torch.tensor([tokens], dtype=torch.long)).logits
            self.cache[key] = out[0, -1].float().numpy()
        return self.cache[key]


def logits_engine(**settings):
    """An LLMEngine whose steps also return their logits (`engine.last_step.output.logits`):
    the runner seam with `keep_logits`, one compiled program per bucket as in serving. One
    step at a time (each step() completes the step it dispatched), unless told otherwise;
    overlapped steps give the same tokens (tests/engine/test_async_scheduling.py)."""
    import functools

    from orca_jax.engine.engine import LLMEngine
    from orca_jax.worker.runner import ModelRunner

    settings.setdefault("async_scheduling", False)
    return LLMEngine(make_runner=functools.partial(ModelRunner, keep_logits=True), **settings)


def drive_engine_against_hf(engine, hf_model, rng, prompt_lengths=(5, 23, 12, 37), late_prompt_length=9,
                            max_tokens=5) -> dict:
    """Step an engine built by `logits_engine` and compare every row that produces a next
    token with HF's last-position logits on the same full token sequence. With a small token
    budget the long prompts are chunk-prefilled while the short ones decode, and one request
    arrives late, joining a running batch. Returns stats, with `max_diff` the largest absolute
    logit difference."""
    import numpy as np

    from orca_jax import SamplingParams

    vocab = engine.model_config.vocab_size
    hf_last = _HFLastLogits(hf_model)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in prompt_lengths]
    late_prompt = rng.integers(3, vocab, size=late_prompt_length).tolist()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(len(prompts))]

    diffs: list[float] = []
    stats = dict(steps=0, mixed_steps=0, partial_prefill_rows=0, compared_rows=0)
    while engine.has_unfinished_requests():
        if stats["steps"] == 3:
            engine.add_request("late", late_prompt, params)
            seqs.append(engine.requests["late"].seqs[0])
        steps_before = engine.num_steps
        engine.step()
        assert engine.num_steps == steps_before + 1, "an empty step while requests are unfinished"
        step = engine.last_step
        logits = step.output.logits
        assert logits.dtype == np.float32 and logits.shape[1] == vocab and logits.shape[0] >= len(step.scheduled)
        got_token = {row for row, _ in step.advanced}
        kinds = set()
        for row, (seq, cached_before) in enumerate(zip(step.scheduled.seqs, step.scheduled.starts)):
            kinds.add("decode" if cached_before >= seq.num_prompt_tokens else "prefill")
            if row in got_token:
                ref = hf_last(seq.prompt_token_ids + seq.output_token_ids[:-1])
                diffs.append(float(np.abs(logits[row] - ref).max()))
                assert seq.output_token_ids[-1] == int(np.argmax(logits[row])), "greedy = argmax of the logits"
                stats["compared_rows"] += 1
            else:
                stats["partial_prefill_rows"] += 1
        stats["steps"] += 1
        stats["mixed_steps"] += kinds == {"decode", "prefill"}

    # The run exercised what it is meant to exercise.
    assert all(len(s.output_token_ids) == max_tokens for s in seqs)
    assert stats["compared_rows"] == len(seqs) * max_tokens
    assert stats["partial_prefill_rows"] >= 3, stats  # chunked prefill happened
    assert stats["mixed_steps"] >= 2, stats  # prefill chunks and decodes in one step
    assert engine.allocator.num_used == 0  # every page came back
    stats["max_diff"] = max(diffs)
    return stats


def assert_greedy_matches_hf_generate(llm, hf_model, prompts, num_new: int) -> None:
    """`llm.generate` (greedy, ignore_eos) gives exactly HF `generate`'s tokens for every prompt,
    batched, and returns every page."""
    import torch

    from orca_jax import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True), use_tqdm=False)
    hf_model.generation_config.eos_token_id = None  # like ignore_eos: always num_new new tokens
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=num_new, pad_token_id=0)[0, len(prompt):].tolist()
        assert len(ref) == num_new
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.allocator.num_used == 0


@pytest.fixture(scope="session")
def greedy_matches_hf():
    """`assert_greedy_matches_hf_generate(llm, hf_model, prompts, num_new)` for model tests."""
    return assert_greedy_matches_hf_generate


@pytest.fixture(scope="session")
def make_logits_engine():
    """`make_logits_engine(**settings)`: see `logits_engine`."""
    return logits_engine


def run_to_completion(engine, requests, abort_at: dict[str, int] | None = None, max_steps: int = 5000) -> dict:
    """Add (request id, prompt, params) requests, step until idle, aborting request r at step
    abort_at[r]; the finished RequestOutput per request id."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for request_id, at in (abort_at or {}).items():
            if at == steps:
                engine.abort(request_id)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        steps += 1
        assert steps < max_steps
    return final


@pytest.fixture(scope="session")
def run_engine():
    """`run_to_completion(engine, requests, abort_at=None) -> {request id: final output}`."""
    return run_to_completion


def generated_token_ids(engine, requests: dict) -> dict[str, list[int]]:
    """{request id: (prompt, params)} run to completion -> {request id: its first output's token
    ids}; asserts that no KV page is left in use."""
    final = run_to_completion(engine, [(rid, prompt, params) for rid, (prompt, params) in requests.items()])
    assert engine.allocator.num_used == 0
    return {rid: list(out.outputs[0].token_ids) for rid, out in final.items()}


@pytest.fixture
def generate(engine):
    """`generated_token_ids` on the module's `engine` fixture."""
    return functools.partial(generated_token_ids, engine)


@pytest.fixture(scope="session")
def engine_parity():
    """`drive_engine_against_hf(engine, hf_model, rng, ...) -> stats` for parity tests (test
    modules cannot import each other under --import-mode=importlib)."""
    return drive_engine_against_hf


@pytest.fixture(scope="session")
def run_parallel_worker():
    """run(mode, *args) -> the JSON result of tests/parallel_worker.py (or `worker=` another such
    script, e.g. pipeline_worker.py), run in a subprocess on 8 forced host devices (JAX fixes
    its device count at start-up; this suite runs on one)."""
    import os
    import subprocess
    import sys

    def run(*args: str, timeout: float = 600, worker: str = "parallel_worker.py") -> dict:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        script = Path(__file__).with_name(worker)
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
        return json.loads(line.removeprefix("RESULT "))

    return run


def wait_until_idle(async_engine, timeout: float = 10.0) -> None:
    """Until nothing runs or waits and every KV page is free (the engine frees pages at the
    step after an abort, so allow it a moment)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = async_engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_pages_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"server not idle: {async_engine.stats()}")


@pytest.fixture(scope="session")
def server_idle_waiter():
    """`server_idle_waiter(async_engine)`: a function that waits until that engine is idle."""
    import functools

    return lambda async_engine: functools.partial(wait_until_idle, async_engine)


@pytest.fixture(scope="session")
def serve_in_thread():
    """`with serve_in_thread(app) as url:` runs an ASGI app under uvicorn on a free port of
    127.0.0.1 in a background thread, and stops it (and checks that it stopped) on exit."""
    import contextlib
    import socket
    import threading
    import time

    import uvicorn

    @contextlib.contextmanager
    def serve(app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # a free port, held from now on: no race with other processes
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(30)
            assert not thread.is_alive(), "server did not shut down"

    return serve


def check_tree_matches_model_init(loaded) -> None:
    """The loader's parameter tree is exactly (structure, shapes, dtypes) what the model's
    init produces for the loaded config."""
    import flax.linen as nn
    import jax
    import numpy as np

    from orca_jax.models import abstract_variables

    expected = nn.unbox(abstract_variables(loaded.config))  # init's tree without the logical axes
    got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), loaded.params)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    mismatched = [
        (jax.tree_util.keystr(path), g, e)
        for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected))
        if (g.shape, g.dtype) != (e.shape, e.dtype)
    ]
    assert not mismatched, mismatched


@pytest.fixture(scope="session")
def assert_tree_matches_model_init():
    """`assert_tree_matches_model_init(loaded_model)` (test modules cannot import each other)."""
    return check_tree_matches_model_init


# ---- MXFP4 checkpoints (gpt-oss's experts) ---------------------------------------------------
def float64_mxfp4_dequantize(blocks, scales):
    """The MXFP4 spec read value by value, in float64: each 4-bit code (sign, two exponent bits,
    one mantissa bit; low nibble first) -> its e2m1 value, times 2 ** (s - 127) of its block of 32.
    blocks u8[..., K/2], scales u8[..., K/32] -> [..., K]."""
    import numpy as np

    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = np.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * np.exp2(exponent - 1.0))
    values = (sign * magnitude).reshape(*scales.shape, 32)
    return (values * np.exp2(scales.astype(np.float64) - 127)[..., None]).reshape(*blocks.shape[:-1], -1)


@pytest.fixture(name="float64_mxfp4_dequantize", scope="session")
def float64_mxfp4_dequantize_fixture():
    """`float64_mxfp4_dequantize(blocks, scales)` for tests (modules cannot import each other)."""
    return float64_mxfp4_dequantize


@pytest.fixture(scope="session")
def make_mxfp4_checkpoint(tmp_path_factory):
    """make(float gpt-oss directory) -> (an MXFP4 checkpoint of it, laid out as the released
    ones: `*_blocks` [E, out, in/32, 16], `*_scales` [E, out, in/32], a quantization_config;
    a float checkpoint of exactly its dequantized weights). Cached per directory."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(float_dir: Path) -> tuple[Path, Path]:
        if str(float_dir) not in cache:
            cache[str(float_dir)] = _write_mxfp4_checkpoints(float_dir, tmp_path_factory)
        return cache[str(float_dir)]

    return make


def _write_mxfp4_checkpoints(float_dir: Path, tmp_path_factory) -> tuple[Path, Path]:
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from orca_jax.kernels import packed4

    tensors = load_file(str(float_dir / "model.safetensors"))
    packed, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = packed4.pack_mxfp4(np.swapaxes(tensors[name], -1, -2))  # rows: output channels
        del packed[name]
        packed[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16)
        packed[f"{name}_scales"] = scales
        dequantized[name] = np.ascontiguousarray(
            np.swapaxes(float64_mxfp4_dequantize(blocks, scales), -1, -2).astype(np.float32))
    dirs = []
    for kind, tree in (("mxfp4", packed), ("dequantized", dequantized)):
        directory = tmp_path_factory.mktemp(f"{float_dir.name}-{kind}")
        for file in float_dir.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, directory / file.name)
        save_file(tree, str(directory / "model.safetensors"), metadata={"format": "pt"})
        if kind == "mxfp4":
            config = json.loads((directory / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            (directory / "config.json").write_text(json.dumps(config))
        dirs.append(directory)
    return tuple(dirs)
