"""Converted GGUF models, cached between runs so that a second start neither parses nor
dequantizes the file again.

    CACHE_DIR/
      file_hashes.json             (absolute path, size, mtime_ns) -> sha256 of a GGUF file
      <sha256[:32]>-<dtype>/       laid out as an orca_jax checkpoint (`orca_jax.loading.checkpoint`), but
        orca_jax_checkpoint.json   the marker (ModelConfig, dtype, the key below, "params_format")
        params/                    the weights converted and cast to dtype, one .npy file per leaf
                                   (`orca_jax.loading.npy_tree`), memory-mapped when restored
        tokenizer/                 the tokenizer (`models.tokenizer.Tokenizer.save_pretrained`)
      .tmp-<entry>-<pid>-<hex>/    an entry being written

An entry is keyed by the file's content, not its path, so a moved or copied file still hits;
the index only spares hashing the whole file at every start, and a file whose size or mtime
changed is hashed again. The marker also records a fingerprint of the conversion code and
libraries (`converter_fingerprint`): an entry written by other conversion code is stale and
rebuilt in place, so at most one entry per file and dtype exists.

Nothing here is needed for correctness, so nothing here is fatal: an unwritable directory logs
a warning, an unreadable or stale entry is logged and rebuilt (also when it only fails while the
runner restores it, see `CachedCheckpoint`), and an entry appears only by one rename of a
finished directory, so a run killed while saving never leaves a half entry that a later run
would trust. The entry is written by a background thread while the engine places the weights
and compiles; it reads the host arrays and never changes them (the runner replaces the leaves of
the dicts it is given, so the thread keeps its own dicts). Several processes (multi-host) would
all write the same entry, so the cache is off then.

Why not orbax, as `orca-jax convert` writes: restoring an uncompressed orbax entry read and
copied the 514 MB of the default model's weights and imported orbax, 1.3-1.7 s of a warm start;
mapping the .npy files and placing them without a copy takes ~0.01 s (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.loading import checkpoint, npy_tree
from orca_jax.distributed import parallel
from orca_jax.kernels import quantization
from orca_jax.loading.checkpoint import Checkpoint, CheckpointError
from orca_jax.loading.tokenizer import Tokenizer  # the class the entry's tokenizer was saved from

logger = logging.getLogger(__name__)

INDEX_FILE = "file_hashes.json"
TEMP_PREFIX = ".tmp-"
_LIBRARIES = ("gguf", "tokenizers")  # their versions shape the converted result
_pending_saves: list[threading.Thread] = []


def load_gguf(path: Path, dtype: str, cache_dir: Path, convert: Callable[[Path], Any],
              loaded_model: Callable[..., Any]):
    """The converted model of the GGUF file `path`: from the cache entry for (file content,
    dtype) when there is a good one, else `convert(path)`, saved to the cache in the background.
    The loader passes its result type as `loaded_model` (`loader.LoadedModel`, called as
    (config, params, tokenizer, source, timings) on a hit): the loader imports this module, so
    this module does not import the loader."""
    if jax.process_count() > 1:
        return convert(path)
    cache = ModelCache(cache_dir)
    start = time.perf_counter()
    try:
        digest = cache.file_digest(path)
    except OSError as exc:
        logger.warning("model cache: cannot hash %s (%s); loading without the cache", path, exc)
        return convert(path)
    timings = {"cache_hash_s": time.perf_counter() - start}
    entry = cache.entry_path(digest, dtype)
    hit = cache.open_entry(entry, digest, dtype, timings)
    if hit is not None:
        opened, tokenizer = hit
        opened.timings = timings  # the same dict: the runner's restore adds its time to the model's
        opened.rebuild = lambda: _convert_and_save(cache, path, entry, digest, dtype, convert)
        loaded = loaded_model(opened.config, opened, tokenizer, str(path), timings)
        logger.info("model cache hit: %s (%s) in %s", path.name, dtype, entry)
        return loaded
    loaded = _convert_and_save(cache, path, entry, digest, dtype, convert)
    loaded.timings.update(timings)
    return loaded


def _convert_and_save(cache: ModelCache, path: Path, entry: Path, digest: str, dtype: str, convert):
    loaded = convert(path)
    cache.save_in_background(entry, loaded, dtype, digest)
    return loaded


def _is_sha256(value) -> bool:
    """A well-formed hex digest (a damaged index entry is rehashed, never trusted)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def wait_for_saves(timeout: float | None = None) -> None:
    """Block until the cache entries being written have been written (tests, benchmarks)."""
    for thread in list(_pending_saves):
        thread.join(timeout)


def converter_fingerprint() -> str:
    """A digest of what decides the converted weights and tokenizer: the sources that
    `fingerprint_sources` lists and the library versions. Any change there makes existing
    entries stale, so no one has to remember to bump a version."""
    digest = hashlib.sha256(f"checkpoint format {checkpoint.FORMAT_VERSION}".encode())
    for source in fingerprint_sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    for name in _LIBRARIES:
        digest.update(f"{name}=={importlib.metadata.version(name)}".encode())
    return digest.hexdigest()[:16]


def fingerprint_sources() -> list[Path]:
    """The model families (each family's config parser and weight converter, orca_jax/models/*.py),
    the readers of GGUF files (reading and its metadata mapping, tokenizer building: loader,
    gguf_arch, gguf_tokenizer, tokenizer, jinja_chat in orca_jax/loading/), the config and
    checkpoint modules (an entry's ModelConfig is rebuilt from its marker: a field added later
    would otherwise silently take its default), and the entry's own format (this module,
    npy_tree.py)."""
    loading = Path(checkpoint.__file__).parent
    package = loading.parent
    readers = ("loader", "gguf_arch", "gguf_tokenizer", "tokenizer", "jinja_chat", "checkpoint", "npy_tree",
               "model_cache")
    return sorted([*(package / "models").glob("*.py"), package / "config" / "__init__.py",
                   *(loading / f"{name}.py" for name in readers)])


@dataclasses.dataclass
class CachedCheckpoint(Checkpoint):
    """A cache entry handed to the runner like a converted checkpoint. Its arrays are memory maps
    of the entry's .npy files (`orca_jax.loading.npy_tree`), not read by orbax: on one CPU device the
    weights are placed without a copy. If they cannot be mapped (the marker was fine but the
    arrays are damaged), it converts the GGUF file again instead of failing, and records the
    restore time in the model's timings."""

    rebuild: Callable[[], Any] | None = dataclasses.field(default=None, repr=False)
    timings: dict = dataclasses.field(default_factory=dict, repr=False)

    def restore_host(self, dtype=None) -> dict:
        """The parameters as numpy arrays in `dtype` (quantized leaves as saved): memory maps
        where the dtype is the saved one, so nothing is read yet; converted copies otherwise."""
        dtype = jnp.dtype(dtype or self.dtype)
        try:
            tree = npy_tree.load_tree(self.path / checkpoint.PARAMS_DIR)
        except ValueError as exc:
            raise CheckpointError(f"model cache entry {self.path}: {exc}") from exc
        return parallel.map_with_path(
            lambda name, leaf: np.asarray(leaf, quantization.stored_dtype(name, leaf.dtype, dtype)), tree)

    def restore(self, dtype=None, mesh=None, kv_head_repeats: int = 1) -> dict:
        start = time.perf_counter()
        dtype = jnp.dtype(dtype or self.dtype)
        try:
            host = self.restore_host(dtype)
        except CheckpointError as exc:
            host = self._convert_again(exc)
        if mesh is None:
            # device_put, not jnp.asarray: a mapped leaf becomes a device array without a copy
            # (an .npy file's data is 64-byte aligned), and uncommitted, as converted weights
            # are placed, so the step's HLO and its persistent-cache entries are the same.
            params = jax.tree.map(jax.device_put, host)
        else:
            params = checkpoint.place_host_params(host, dtype, mesh, kv_head_repeats, config=self.config)
        self.timings["cache_restore_s"] = time.perf_counter() - start
        return params

    def restore_stages(self, dtype, mesh, stage_meshes, holders: dict[str, list[int]]) -> list[dict]:
        """Pipeline stages (see `Checkpoint.restore_stages`): each stage's slice of the layers
        and the other weights it holds, from the mapped arrays, placed on its row of the mesh."""
        dtype = jnp.dtype(dtype or self.dtype)
        try:
            host = self.restore_host(dtype)["params"]
        except CheckpointError as exc:
            host = self._convert_again(exc)["params"]
        per_stage = self.config.num_layers // len(stage_meshes)
        stages = []
        for s, row in enumerate(stage_meshes):
            layers = jax.tree.map(lambda leaf, s=s: leaf[s * per_stage:(s + 1) * per_stage], host["layers"])
            held = {key: value for key, value in host.items() if key != "layers" and s in holders.get(key, ())}
            stages.append(checkpoint.place_host_params({"params": {"layers": layers, **held}}, dtype, row,
                                                       config=self.config))
        return stages

    def _convert_again(self, error: CheckpointError) -> dict:
        """The host parameters of a fresh conversion, when this entry cannot be used."""
        if self.rebuild is None:
            raise error
        logger.warning("model cache entry %s cannot be restored (%s); converting the GGUF file again", self.path, error)
        _remove_tree(self.path)
        loaded = self.rebuild()
        self.timings.update(loaded.timings)
        return loaded.params


@dataclasses.dataclass
class ModelCache:
    root: Path

    # ---- the file's content hash, through the index ---------------------------------------------
    def file_digest(self, path: Path) -> str:
        """sha256 of the file, looked up by (absolute path, size, mtime_ns); hashed on a miss."""
        path = Path(path).absolute()
        stat = path.stat()
        key = str(path)
        index = self._read_index()
        known = index.get(key)
        if (isinstance(known, dict) and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns
                and _is_sha256(known.get("sha256"))):
            return known["sha256"]
        start = time.perf_counter()
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        logger.info("model cache: hashed %s in %.2f s", path.name, time.perf_counter() - start)
        index[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        self._write_index(index)
        return digest

    def _read_index(self) -> dict:
        try:
            index = json.loads((self.root / INDEX_FILE).read_text())
        except (OSError, ValueError):  # none yet, or damaged: every file is simply hashed again
            return {}
        return index if isinstance(index, dict) else {}

    def _write_index(self, index: dict) -> None:
        # Written whole and renamed into place: a concurrent reader sees the old or the new one.
        temp = self.root / f"{TEMP_PREFIX}{INDEX_FILE}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            temp.write_text(json.dumps(index, indent=1))
            os.replace(temp, self.root / INDEX_FILE)
        except OSError as exc:  # the save that follows says so at warning level
            logger.debug("model cache: cannot write %s: %s", self.root / INDEX_FILE, exc)
            _remove_tree(temp)

    # ---- entries ---------------------------------------------------------------------------------
    def entry_path(self, digest: str, dtype: str) -> Path:
        return self.root / f"{digest[:32]}-{dtype}"

    def open_entry(self, entry: Path, digest: str, dtype: str, timings: dict) -> tuple[CachedCheckpoint, Any] | None:
        """The opened entry and its tokenizer, or None (logged) when it is absent, stale or damaged.
        The parameters stay on disk until the runner restores them."""
        if not entry.exists():
            return None
        try:
            start = time.perf_counter()
            opened = checkpoint.open_checkpoint(entry)
            cache_info = opened.marker.get("cache", {})
            expected = {"gguf_sha256": digest, "converter": converter_fingerprint()}
            if {k: cache_info.get(k) for k in expected} != expected or opened.dtype != dtype:
                logger.info("model cache entry %s was written by other conversion code; rebuilding it", entry)
                return None
            timings["cache_restore_open_s"] = time.perf_counter() - start
            start = time.perf_counter()
            tokenizer = Tokenizer.from_pretrained(entry / checkpoint.TOKENIZER_DIR)
            timings["tokenizer_s"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - any damage means: convert again
            logger.warning("model cache entry %s is unreadable (%s: %s); rebuilding it", entry, type(exc).__name__, exc)
            return None
        fields = {f.name: getattr(opened, f.name) for f in dataclasses.fields(Checkpoint)}
        # The key above proves which code wrote this tree; checking it again would cost a trace.
        fields["verify_shapes"] = False
        return CachedCheckpoint(**fields), tokenizer

    def save_in_background(self, entry: Path, loaded, dtype: str, digest: str) -> threading.Thread:
        # New dicts over the same arrays: the runner replaces the leaves of loaded.params as it
        # moves them to the device, the arrays themselves are never written.
        params = jax.tree.map(lambda x: x, loaded.params)
        thread = threading.Thread(
            target=self._save, name="orca-jax-model-cache-save",
            args=(entry, params, loaded.tokenizer, loaded.config, dtype, loaded.source, digest, loaded.timings),
        )
        # Not a daemon: a short run (one `generate`) still finishes the entry before the process exits.
        thread.start()
        _pending_saves[:] = [t for t in _pending_saves if t.is_alive()] + [thread]
        return thread

    def _save(self, entry: Path, params: dict, tokenizer, config, dtype: str, source: str, digest: str,
              timings: dict) -> None:
        start = time.perf_counter()
        temp = self.root / f"{TEMP_PREFIX}{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_abandoned_temps()
            target = jnp.dtype(dtype)
            host = parallel.map_with_path(  # no copy when already in dtype
                lambda name, x: np.asarray(x, quantization.stored_dtype(name, np.asarray(x).dtype, target)), params)
            del params
            temp.mkdir(parents=True)
            npy_tree.save_tree(temp / checkpoint.PARAMS_DIR, host)
            del host
            tokenizer.save_pretrained(temp / checkpoint.TOKENIZER_DIR)
            # The marker last, as in an orbax checkpoint (`checkpoint.open_checkpoint` reads it).
            checkpoint.write_marker(temp, config, dtype, source, extra={
                "cache": {"gguf_sha256": digest, "converter": converter_fingerprint()}, "params_format": "npy"})
            self._publish(temp, entry)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written only costs time
            logger.warning("model cache: could not save %s (%s: %s); the next start converts the file again",
                           entry, type(exc).__name__, exc)
            _remove_tree(temp)
            return
        timings["cache_save_s"] = time.perf_counter() - start
        logger.info("model cache: saved %s in %.2f s", entry, timings["cache_save_s"])

    def _publish(self, temp: Path, entry: Path) -> None:
        """Move a finished entry into place. An entry already there was found stale or damaged
        (or another process has just written one): it is moved aside and removed first."""
        if entry.exists():
            trash = self.root / f"{TEMP_PREFIX}trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(entry, trash)
            except OSError:
                pass  # gone meanwhile
            _remove_tree(trash)
        try:
            os.rename(temp, entry)
        except OSError:  # another process published the same entry between the two renames
            _remove_tree(temp)

    def _remove_abandoned_temps(self) -> None:
        """Entries half-written by processes that no longer run (killed while saving)."""
        for temp in self.root.glob(f"{TEMP_PREFIX}*"):
            try:
                pid = int(temp.name.rsplit("-", 2)[-2])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not _process_alive(pid):
                _remove_tree(temp)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_tree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)
