"""`orca-jax generate` streams a completion and reports bad input as a clean error."""

from orca_jax import cli


def test_generate_streams_text(tiny_llama_dir, capsys):
    code = cli.main(["generate", "Paris is the", "--model", str(tiny_llama_dir), "--max-tokens", "6",
                     "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.endswith("\n") and len(out.strip()) > 0


def test_generate_chat_uses_template(tiny_llama_dir, monkeypatch):
    from orca_jax.engine import LLMEngine

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
