"""Reading an HF checkpoint's tensors (by name, PyTorch layout) into a Flax parameter tree:
the part every family's converter shares."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


class HFTensors:
    """A checkpoint's tensors by HF name. `take` removes each tensor as it is converted, so peak
    memory stays near one copy of the weights instead of two."""

    def __init__(self, tensors: dict[str, np.ndarray], num_layers: int, layer_prefix: str):
        self.tensors = tensors
        self.num_layers = num_layers
        self.layer_prefix = layer_prefix  # e.g. "model.layers": layer i is f"{prefix}.{i}.*"

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors.pop(name)

    def per_layer(self, suffix: str, convert: Callable[[np.ndarray], np.ndarray] = lambda w: w) -> np.ndarray:
        """`suffix` of every layer, converted, stacked on a leading layer axis (for the scan)."""
        return self.stack_layers(lambda i: convert(self.take(f"{self.layer_prefix}.{i}.{suffix}")))

    def stack_layers(self, read_layer: Callable[[int], Any]) -> Any:
        """`read_layer(i)` (an array, or a nested dict of arrays) of every layer, each leaf stacked
        on a leading layer axis. Each layer is copied into the stacked arrays as it is read, so
        the peak is one copy of the weights, not two."""
        stacked = None
        for i in range(self.num_layers):
            layer = read_layer(i)
            if stacked is None:
                stacked = jax.tree.map(lambda a: np.empty((self.num_layers, *a.shape), a.dtype), layer)
            jax.tree.map(lambda whole, part: whole.__setitem__(i, part), stacked, layer)
        return stacked
