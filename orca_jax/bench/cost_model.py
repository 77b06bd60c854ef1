"""Step time of one iteration of a large model on a multi-GPU machine, from FLOPs and bytes:
the clock of `bench simulate`.

The model (stated, deliberately small):
- The model is a GPT-style stack: 12 * hidden^2 parameters per layer (attention 4h^2, MLP
  8h^2) plus a vocab x hidden LM head; KV cache 2 * hidden values per token per layer.
- Tensor parallelism splits every layer's weights, FLOPs, KV cache and KV reads evenly over
  `tensor_parallel` GPUs and costs two ring all-reduces of the step's activations per layer
  (after attention and after the MLP). Pipeline parallelism splits the layers over
  `pipeline_parallel` stages as the engine does (`stage_layers`: L // P each, the first L % P
  stages one more) and sends the activations once between consecutive stages (`hop_time`:
  internode latency + bytes / bandwidth), a transfer that occupies neither stage.
- Per stage (`stage_times`): its layers, and on the last stage the LM head. One batch crossing
  every stage takes `step_time` = step_overhead_s (host work, once per iteration, before the
  batch reaches the first stage) + the stage times + the hops between them. How batches
  overlap across the stages (Orca keeps one in flight per stage) is the simulator's event
  model (simulate.py), not this file's.
- Per layer on one GPU, time = max(compute, memory) (a roofline): compute is the matmul FLOPs
  (2 per weight per token) plus attention (4 * hidden per query-key pair) at
  `efficiency.matmul` of peak; memory is weights + KV read + KV written at
  `efficiency.memory` of HBM bandwidth.
- The LM head runs only for rows that produce a token; embeddings, norms and sampling are
  not counted; a fixed `step_overhead_s` per iteration stands for them and the host.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from pathlib import Path

DEFAULT_COST_MODEL = "gpt3-175b-16xa100"
_SECTIONS = {
    "model": ("name", "num_layers", "hidden_size", "num_heads", "vocab_size", "bytes_per_value"),
    "parallelism": ("tensor_parallel", "pipeline_parallel"),
    "gpu": ("peak_flops", "hbm_bytes_per_s", "memory_bytes", "reserved_bytes"),
    "interconnect": ("nvlink_bytes_per_s", "allreduce_latency_s", "internode_bytes_per_s", "internode_latency_s"),
    "efficiency": ("matmul", "memory", "step_overhead_s"),
    "engine": ("max_num_seqs", "max_num_batched_tokens", "page_size"),
}


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one iteration computes: new tokens, KV tokens read (every scheduled sequence reads
    its whole cache once per layer), query-key pairs of attention, rows that need logits."""

    new_tokens: int
    kv_tokens_read: int
    attention_pairs: int
    logit_rows: int


@dataclasses.dataclass(frozen=True)
class CostModel:
    name: str
    description: str
    model: dict
    parallelism: dict
    gpu: dict
    interconnect: dict
    efficiency: dict
    engine: dict

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return self.parallelism["tensor_parallel"] * self.parallelism["pipeline_parallel"]

    @property
    def layer_params(self) -> float:
        return 12.0 * self.model["hidden_size"] ** 2

    @property
    def num_params(self) -> float:
        m = self.model
        return m["num_layers"] * self.layer_params + m["vocab_size"] * m["hidden_size"]

    @property
    def num_stages(self) -> int:
        return self.parallelism["pipeline_parallel"]

    @property
    def stage_layers(self) -> list[int]:
        """Layers per pipeline stage, the engine's split: L // P each, one more on the first L % P."""
        L, P = self.model["num_layers"], self.num_stages
        return [L // P + (s < L % P) for s in range(P)]

    @property
    def layers_per_stage(self) -> int:
        """The largest stage's layers: its GPUs hold the most KV per token."""
        return max(self.stage_layers)

    def kv_bytes_per_token_per_gpu(self) -> float:
        m, tp = self.model, self.parallelism["tensor_parallel"]
        return self.layers_per_stage * 2 * m["hidden_size"] / tp * m["bytes_per_value"]

    def weight_bytes_per_gpu(self) -> float:
        return self.num_params * self.model["bytes_per_value"] / self.num_gpus

    def kv_pool_pages(self) -> int:
        """KV pages that fit beside the weights on every GPU (all GPUs hold the same tokens)."""
        free = self.gpu["memory_bytes"] - self.gpu["reserved_bytes"] - self.weight_bytes_per_gpu()
        if free <= 0:
            raise ValueError(f"{self.name}: the weights ({self.weight_bytes_per_gpu() / 1e9:.1f} GB per GPU) "
                             "leave no memory for the KV cache")
        return int(free // (self.kv_bytes_per_token_per_gpu() * self.engine["page_size"]))

    # ---- time ---------------------------------------------------------------------------------
    def step_time(self, work: StepWork) -> float:
        """Seconds for one iteration crossing every pipeline stage, alone: the host's
        step_overhead_s, every stage's time (`stage_times`) and the hops between stages."""
        m, eff = self.model, self.efficiency
        return (m["num_layers"] * self._layer_time(work) + self._head_time(work)
                + (self.num_stages - 1) * self.hop_time(work) + eff["step_overhead_s"])

    def stage_times(self, work: StepWork) -> list[float]:
        """Seconds stage s spends on the iteration: its `stage_layers[s]` layers, plus the LM
        head on the last stage. `step_time` = step_overhead_s + sum(stage_times) + (P - 1) *
        `hop_time`."""
        layer = self._layer_time(work)
        times = [n * layer for n in self.stage_layers]
        times[-1] += self._head_time(work)
        return times

    def hop_time(self, work: StepWork) -> float:
        """Seconds for the step's activations to go from one stage to the next (InfiniBand)."""
        h, bpv = self.model["hidden_size"], self.model["bytes_per_value"]
        return (self.interconnect["internode_latency_s"]
                + work.new_tokens * h * bpv / self.interconnect["internode_bytes_per_s"])

    @property
    def step_overhead_s(self) -> float:
        """Host work per iteration (scheduling, input build, launches), paid at dispatch."""
        return self.efficiency["step_overhead_s"]

    def _layer_time(self, work: StepWork) -> float:
        """One layer on one GPU of a stage: the roofline of its compute and its memory traffic,
        plus two all-reduces over the tensor-parallel group."""
        m, tp, eff = self.model, self.parallelism["tensor_parallel"], self.efficiency
        h, bpv = m["hidden_size"], m["bytes_per_value"]
        flops = 2.0 * self.layer_params * work.new_tokens + 4.0 * h * work.attention_pairs
        bytes_moved = (self.layer_params + 2.0 * h * (work.kv_tokens_read + work.new_tokens)) * bpv
        layer = max(flops / tp / (self.gpu["peak_flops"] * eff["matmul"]),
                    bytes_moved / tp / (self.gpu["hbm_bytes_per_s"] * eff["memory"]))
        return layer + 2 * self._allreduce_time(work.new_tokens * h * bpv)

    def _head_time(self, work: StepWork) -> float:
        m, tp, eff = self.model, self.parallelism["tensor_parallel"], self.efficiency
        h, bpv = m["hidden_size"], m["bytes_per_value"]
        return max(2.0 * m["vocab_size"] * h * work.logit_rows / tp / (self.gpu["peak_flops"] * eff["matmul"]),
                   m["vocab_size"] * h * bpv / tp / (self.gpu["hbm_bytes_per_s"] * eff["memory"]))

    def _allreduce_time(self, message_bytes: float) -> float:
        tp = self.parallelism["tensor_parallel"]
        if tp == 1:
            return 0.0
        ring = 2.0 * (tp - 1) / tp * message_bytes / self.interconnect["nvlink_bytes_per_s"]
        return self.interconnect["allreduce_latency_s"] + ring

    def describe(self) -> dict:
        return {
            "name": self.name, "description": self.description, **{k: getattr(self, k) for k in _SECTIONS},
            "derived": {"num_params": self.num_params, "num_gpus": self.num_gpus,
                        "weight_bytes_per_gpu": self.weight_bytes_per_gpu(),
                        "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu(),
                        "kv_pool_pages": self.kv_pool_pages(),
                        "kv_pool_tokens": self.kv_pool_pages() * self.engine["page_size"]},
        }


def load_cost_model(name_or_path: str | Path = DEFAULT_COST_MODEL) -> CostModel:
    """A shipped cost model by name (orca_jax/bench/cost_models/NAME.toml) or a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        text, where = path.read_text(), str(path)
    else:
        resource = importlib.resources.files("orca_jax.bench") / "cost_models" / f"{name_or_path}.toml"
        if not resource.is_file():
            shipped = sorted(p.name.removesuffix(".toml") for p in (importlib.resources.files("orca_jax.bench")
                                                                  / "cost_models").iterdir())
            raise FileNotFoundError(f"no cost model {name_or_path!r}; shipped: {', '.join(shipped)}")
        text, where = resource.read_text(), str(resource)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_SECTIONS) - {"description"})
    for section, keys in _SECTIONS.items():
        table = data.get(section, {})
        unknown += [f"{section}.{k}" for k in sorted(set(table) - set(keys))]
        if missing := [f"{section}.{k}" for k in keys if k not in table]:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    return CostModel(name=Path(where).stem, description=data.get("description", ""),
                     **{section: dict(data[section]) for section in _SECTIONS})
