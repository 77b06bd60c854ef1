"""Presets: a model and engine settings for one kind of machine, stored as TOML in `configs/`.

    description = "..."
    model = "meta-llama/Llama-3.2-1B-Instruct"   # hub id or path; omit for the embedded default
    [engine]                                     # EngineConfig's own field names
    dtype = "bfloat16"
    max_num_seqs = 128

TOML has no null, so "the embedded default model" is spelled by leaving `model` out;
`load_preset` fills it in as None so every loaded preset has the same keys.

Where the files live: `configs/` at the repository root is the one copy. pyproject.toml maps
it into the wheel as the data-only package `orca_jax.configs` (`package-dir`), so an installed
package finds the presets with `importlib.resources` and a source checkout finds the same files
next to the package. Neither a symlink (lost on some platforms and in sdists) nor a second copy
(which drifts) is involved.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from pathlib import Path
from typing import Any

from orca_jax.config import EngineConfig

TOP_LEVEL_KEYS = ("description", "model", "engine")
# `model` is a top-level key; `token_buckets` is derived from the model, never set by hand.
ENGINE_KEYS = tuple(
    f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name not in ("model", "token_buckets")
)
_SOURCE_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load_preset(path_or_name: str | Path) -> dict[str, Any]:
    """Read and check a preset. `path_or_name` is a file (".toml" may be left off) or the
    name of a shipped preset ("smollm2-cpu", also accepted as "configs/smollm2-cpu").

    Returns {"name", "path", "description", "model", "engine": {EngineConfig field: value}}.
    """
    path = _find_preset(path_or_name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    _check_keys(data, TOP_LEVEL_KEYS, path, where="")
    engine = data.get("engine", {})
    if not isinstance(engine, dict):
        raise ValueError(f"{path}: 'engine' must be a table ([engine]), got {type(engine).__name__}")
    _check_keys(engine, ENGINE_KEYS, path, where="engine.")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{path}: 'model' must be a string (a hub id or a path), got {model!r}")
    return {"name": path.stem, "path": str(path), "description": data.get("description", ""),
            "model": model, "engine": dict(engine)}


def engine_config_from_preset(preset: dict[str, Any], **overrides) -> EngineConfig:
    """EngineConfig from a loaded preset; `overrides` (EngineConfig names, `model` included)
    win over the preset's values. Bad values are EngineConfig's ValueError, naming the file."""
    unknown = sorted(set(overrides) - {"model", *ENGINE_KEYS})
    if unknown:
        raise ValueError(f"unknown engine setting(s) {', '.join(map(repr, unknown))}")
    settings = {"model": preset.get("model"), **preset.get("engine", {}), **overrides}
    try:
        _check_types(settings)
        return EngineConfig(**settings)
    except (ValueError, TypeError) as exc:
        source = preset.get("path") or preset.get("name")
        if not source:
            raise ValueError(str(exc)) from None
        given = f" with {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else ""
        raise ValueError(f"{source}{given}: {exc}") from None


def list_presets() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.name.removesuffix(".toml") for p in _presets_dir().iterdir() if p.name.endswith(".toml"))


def _presets_dir():
    """The shipped presets: the wheel's `orca_jax.configs`, else the source checkout's configs/."""
    try:
        packaged = importlib.resources.files("orca_jax.configs")
        if packaged.is_dir():
            return packaged
    except ModuleNotFoundError:  # running from a source tree that was never installed
        pass
    return _SOURCE_CONFIGS


def _find_preset(path_or_name: str | Path) -> Path:
    text = str(path_or_name)
    with_suffix = text if text.endswith(".toml") else text + ".toml"  # not with_suffix(): "qwen2.5-7b"
    for candidate in (Path(text), Path(with_suffix)):
        if candidate.is_file():
            return candidate
    # A bare name, or "configs/NAME" typed from another directory: look among the shipped ones.
    parent = Path(with_suffix).parent
    if parent.name in ("", "configs"):
        shipped = _presets_dir() / Path(with_suffix).name
        if shipped.is_file():
            return Path(str(shipped))
    raise FileNotFoundError(
        f"no preset {text!r}: not a file, and not one of the shipped presets ({', '.join(list_presets())})"
    )


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], path: Path, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ValueError(f"{path}: unknown key '{where}{key}'; allowed: {', '.join(allowed)}")


def _check_types(settings: dict[str, Any]) -> None:
    """EngineConfig trusts its callers' types; a preset is typed by hand, so check them here
    (a quoted number or a float page count would otherwise fail far from the file, or not at all)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name not in settings or settings[f.name] is None and "None" in str(f.type):
            continue
        value, kind = settings[f.name], str(f.type)
        types = {"str"} if kind.startswith("Literal") else {t.strip() for t in kind.split("|")}
        if "int" in types:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif "float" in types:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif "bool" in types:
            ok = isinstance(value, bool)
        elif "str" in types:  # Literal[...] too: which strings are allowed is EngineConfig's check
            ok = isinstance(value, str)
        else:  # any other type: left to EngineConfig
            ok = True
        if not ok:
            raise ValueError(f"{f.name} must be {kind}, got {value!r}")
