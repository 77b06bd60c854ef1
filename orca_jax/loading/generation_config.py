"""The model's recommended sampling values (generation_config.json) as request defaults.

vLLM's `--generation-config`:
    auto   (default) the model directory's generation_config.json, if it has one
    vllm   none: a request's missing fields take SamplingParams' own defaults
    DIR    the generation_config.json in DIR

Of that file only the sampling values are read, as vLLM reads them: temperature, top_p, top_k,
min_p, repetition_penalty. They are defaults only: a request that sets a field keeps its value.
`do_sample: false` is not read (vLLM does not either): a creator who wants greedy decoding
says temperature 0. A GGUF file and the embedded default model carry no such file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a directory
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty"}


def sampling_defaults(source: str, model_path: Path | None) -> dict[str, float | int]:
    """The SamplingParams defaults `source` gives for the model at `model_path` (a directory, a
    file, or None for the embedded default). Raises ValueError for a DIR without the file."""
    if source == "vllm":
        return {}
    if source == "auto":
        directory = model_path if model_path is not None and model_path.is_dir() else None
        file = directory / "generation_config.json" if directory is not None else None
        if file is None or not file.exists():
            return {}
    else:
        file = Path(source).expanduser() / "generation_config.json"
        if not file.exists():
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
    values = json.loads(file.read_text())
    defaults = {field: values[key] for key, field in SAMPLING_KEYS.items() if values.get(key) is not None}
    if defaults:
        logger.info("default sampling parameters from %s: %s (a request's own values win; "
                    "--generation-config vllm ignores the file)", file,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
