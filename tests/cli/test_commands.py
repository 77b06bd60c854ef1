"""`orca-jax generate` streams a completion and reports bad input as a clean error."""

from orca_jax.cli import commands as cli


def test_generate_streams_text(tiny_llama_dir, capsys):
    code = cli.main(["generate", "Paris is the", "--model", str(tiny_llama_dir), "--max-tokens", "6",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.endswith("\n") and len(out.strip()) > 0


def test_generate_chat_uses_template(tiny_llama_dir, monkeypatch):
    from orca_jax.engine.engine import LLMEngine

    seen = {}
    original = LLMEngine.add_request

    def spy(self, request_id, prompt, params=None):
        seen["text"] = self.tokenizer.decode(prompt)
        return original(self, request_id, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    code = cli.main(["generate", "hello", "--chat", "--model", str(tiny_llama_dir), "--max-tokens", "3",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128"])
    assert code == 0
    # The tiny tokenizer's template (tests/conftest.py) wraps turns as "<s>role: content</s>".
    assert seen["text"] == "<s>user: hello</s><s>assistant: "


def test_generate_bad_model_path_is_a_clean_error(capsys):
    code = cli.main(["generate", "hi", "--model", "/nonexistent/model"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


# ---- the flags a vLLM user types ------------------------------------------------------------
import argparse  # noqa: E402

import pytest  # noqa: E402

from orca_jax.config import EngineConfig  # noqa: E402


def _config(*argv: str) -> EngineConfig:
    return cli._engine_config(cli.build_parser().parse_args(list(argv)))


def test_serve_takes_the_model_as_a_positional_argument():
    assert _config("serve", "/models/llama").model == "/models/llama"
    with pytest.raises(ValueError, match="two models"):
        _config("serve", "/models/a", "--model", "/models/b")


def test_engine_settings_have_flags():
    config = _config("serve", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "bfloat16", "--seed", "7",
                     "--enable-chunked-prefill", "--compilation-cache-dir", "/tmp/xla-cache")
    assert (config.gpu_memory_utilization, config.kv_cache_dtype, config.seed) == (0.5, "bfloat16", 7)
    assert config.compilation_cache_dir == "/tmp/xla-cache"
    assert EngineConfig().compilation_cache_dir is not None  # on by default
    quantized = _config("generate", "hi", "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3")
    assert (quantized.quantization, quantized.kv_cache_dtype) == ("int8", "fp8_e4m3")
    off = _config("generate", "hi", "--no-compilation-cache", "--no-model-cache")
    assert off.compilation_cache_dir is None and off.model_cache_dir is None
    assert off.enable_prefix_caching is True, "prefix caching is on by default"
    assert _config("serve", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert _config("generate", "hi", "--enable-prefix-caching").enable_prefix_caching is True
    with pytest.raises(ValueError, match="contradicts"):
        _config("serve", "--no-compilation-cache", "--compilation-cache-dir", "/tmp/x")


def test_every_flag_has_help_text():
    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    missing = [f"{p.prog} {a.option_strings or a.dest}" for p in parsers(cli.build_parser()) for a in p._actions
               if not a.help and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    assert missing == []


@pytest.mark.parametrize("argv, level", [
    (["serve"], "INFO"), (["generate", "hi"], "WARNING"),
    (["serve", "--log-level", "debug"], "DEBUG"), (["--log-level", "error", "serve"], "ERROR"),
    (["generate", "hi", "--log-level", "INFO"], "INFO"),
])
def test_log_level_defaults_to_info_for_serve_and_is_accepted_after_the_subcommand(argv, level):
    assert cli._log_level(cli.build_parser().parse_args(argv)) == level


def test_generate_sampling_flags_reach_the_request(tiny_llama_dir, monkeypatch, capsys):
    from orca_jax.engine.engine import LLMEngine

    seen = {}
    original = LLMEngine.add_request

    def spy(self, request_id, prompt, params=None):
        seen["params"] = params
        return original(self, request_id, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    code = cli.main(["generate", "Paris is", "--model", str(tiny_llama_dir), "--max-tokens", "4", "--top-k", "5",
                     "--temperature", "0.8", "--seed", "3", "--stop", "zzz", "--stop", "yyy", "--ignore-eos",
                     "--n", "2", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128"])
    assert code == 0
    p = seen["params"]
    assert (p.top_k, p.stop, p.ignore_eos, p.n, p.seed) == (5, ["zzz", "yyy"], True, 2, 3)
    out = capsys.readouterr().out
    assert out.count("--- sample ") == 2 and "--- sample 0 (length) ---" in out and "--- sample 1 (length) ---" in out


def test_bench_results_do_not_overwrite_the_committed_docs_by_default():
    args = cli.build_parser().parse_args(["bench", "orca"])
    assert not args.json.startswith("docs/") and not args.plot.startswith("docs/")
    args = cli.build_parser().parse_args(["bench", "simulate"])
    assert not args.json.startswith("docs/") and not args.plot.startswith("docs/")


# ---- convert --------------------------------------------------------------------------------
def test_convert_hands_its_arguments_to_orca_jax_convert(monkeypatch, tmp_path, capsys):
    """`orca-jax convert` is orca_jax.loading.convert.convert ("default": the embedded model, None);
    the conversion itself is tested in tests/loading/test_checkpoint.py."""
    import orca_jax.loading.convert

    calls = []

    def fake_convert(model, out_dir, dtype, tensor_parallel_size, quantization):
        calls.append((model, out_dir, dtype, tensor_parallel_size, quantization))
        return {"convert_s": 1.0, "total_s": 2.0}

    monkeypatch.setattr(orca_jax.loading.convert, "convert", fake_convert)
    out = str(tmp_path / "ckpt")
    assert cli.main(["convert", "default", out, "--dtype", "bfloat16", "--tensor-parallel-size", "2"]) == 0
    assert cli.main(["convert", "/models/llama", out, "--quantization", "int8"]) == 0
    assert calls == [(None, out, "bfloat16", 2, None), ("/models/llama", out, "float32", 1, "int8")]
    assert f"use it as --model {out}" in capsys.readouterr().out


def test_serve_tool_calling_flags_reach_the_server_settings(monkeypatch):
    from orca_jax.entrypoints import server

    args = cli.build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    settings = server.ServerSettings("m", enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    assert settings.auto_tool_parser == "llama3_json"
    assert server.ServerSettings("m", tool_call_parser="hermes").auto_tool_parser is None  # auto off
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        server.ServerSettings("m", enable_auto_tool_choice=True)
    with pytest.raises(SystemExit):  # an unknown parser is refused by argparse, listing the known ones
        cli.build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


def test_vllm_spellings_of_engine_flags():
    assert _config("serve", "-tp", "2").tensor_parallel_size == 2
    assert _config("serve", "--max-logprobs", "5").max_logprobs == 5


def test_chat_template_and_cors_flags_are_read(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert cli.read_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert cli.read_chat_template("{% for m in messages %}{% endfor %}") == "{% for m in messages %}{% endfor %}"
    with pytest.raises(SystemExit, match="neither a file"):
        cli.read_chat_template(str(tmp_path / "missing.jinja"))
    assert cli.parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(SystemExit, match="JSON object"):
        cli.parse_template_kwargs("[1]")
    assert cli.parse_json_list('["https://a.example"]', "--allowed-origins") == ["https://a.example"]
    with pytest.raises(SystemExit, match="JSON list"):
        cli.parse_json_list('"*"', "--allowed-origins")
    args = cli.build_parser().parse_args(["serve", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                                          "--root-path", "/llm"])
    assert (args.ssl_keyfile, args.ssl_certfile, args.root_path) == ("k.pem", "c.pem", "/llm")


# ---- generate's own defaults (start-up: docs/benchmarks.md) ----------------------------------
@pytest.mark.parametrize("argv,seqs,overlapped", [
    ([], 1, False),
    (["--n", "3"], 3, False),
    (["--n", "40"], EngineConfig.max_num_seqs, False),  # never more rows than the engine's default
    (["--max-num-seqs", "8", "--async-scheduling"], 8, True),  # a flag wins
    (["--config", "smollm2-cpu"], None, None),  # so does a preset's setting, where it has one
])
def test_generate_sizes_its_rows_to_its_samples_and_runs_one_step_at_a_time(monkeypatch, argv, seqs, overlapped):
    from orca_jax.engine import engine as engine_module
    from orca_jax.entrypoints.presets import load_preset

    built = {}

    class Stop(Exception):
        pass

    def capture(config, **kwargs):
        built["config"] = config
        raise Stop

    monkeypatch.setattr(engine_module, "LLMEngine", capture)
    with pytest.raises(Stop):
        cli.cmd_generate(cli.build_parser().parse_args(["generate", "hi", *argv]))
    config = built["config"]
    if seqs is None:  # the preset's own values, else generate's
        preset = load_preset("smollm2-cpu")["engine"]
        assert config.max_num_seqs == preset.get("max_num_seqs", 1)
        assert config.async_scheduling == preset.get("async_scheduling", False)
    else:
        assert (config.max_num_seqs, config.async_scheduling) == (seqs, overlapped)
    assert _config("serve").max_num_seqs == EngineConfig.max_num_seqs, "serve keeps the engine's defaults"
