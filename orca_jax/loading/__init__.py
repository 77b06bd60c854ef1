"""Files -> weights and tokenizers: HF safetensors and config.json, GGUF, orbax checkpoints, the
converted-model cache, and the tokenizers and chat templates read beside them. A layer above
models: it reads a checkpoint into the parameters of a model family, never the other way."""
