"""A mixture-of-experts feed-forward layer on the flattened token axis (selective batching fits
it as it fits the dense MLP: the tokens of every request in the step are routed together).

    weights, experts = top_k(score(x @ router))          [T, k] each
    rows   = x[token of each (token, choice), sorted by expert]      [T*k, D]
    out_r  = expert_mlp[expert of r](rows[r])            grouped: one matmul per expert's rows
    y[t]   = sum over t's choices of weight * out        through the inverse permutation
    y     += sigmoid(x @ shared_gate) * shared_mlp(x)    (Qwen2-MoE's shared expert)

gpt-oss adds biases on the router and on every expert projection (`moe_bias`; the down
projection's bias is weighted and added once, after the devices' shares are summed) and its
clamped SwiGLU (`swiglu_limit`); its experts may be stored MXFP4 (`expert_format`): packed
leaves `*_blocks`/`*_scales` [E, out, in/2] and [E, out, in/32] in place of the float stacks,
unpacked only inside the grouped matmul (orca_jax/kernels/packed4.py).

Nothing of shape [tokens, experts, hidden] is built: the router's scores are [T, E], everything
after is [T*k, ...]. The grouped matmuls are `orca_jax.kernels.grouped_mlp` (`ragged_dot` on GPU
and TPU, a blocked loop on CPU). Padding tokens of the bucket (past `cu_q_lens[-1]`) join no
group, so experts spend no work on them.

Parallelism over the "model" mesh axis (orca_jax/distributed/parallel.py), on the same devices as the
attention's heads. Tensor parallelism (the default) splits every expert's intermediate axis,
as the dense MLP's; expert parallelism (`ModelConfig.expert_parallel`) gives each device
`E / devices` whole experts. Either way the activations reaching the layer are whole on every
device (the attention's output projection has all-reduced them), so no all-to-all is needed to
dispatch tokens: each device routes every token, runs the (token, choice) rows that fall to its
experts or its slice, and one all-reduce sums the partial outputs, the same single collective
as the dense MLP's row-parallel down projection. An all-to-all dispatch pays off when the tokens
themselves are spread over the devices (data-parallel attention), which this engine does not do.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from orca_jax.distributed import parallel
from orca_jax.config import ModelConfig
from orca_jax.kernels import grouped_mlp, packed4
from orca_jax.kernels.packed4 import PackedWeight
from orca_jax.kernels.lowering_target import target_backend
from orca_jax.models.layers import GatedMLP, activation


def route(router_logits, num_chosen: int, scoring: str, normalize: bool):
    """router_logits f32[T, E] -> (weights f32[T, k], experts i32[T, k]): each token's top-k
    experts by score (softmax over all experts, or each expert's sigmoid), their scores
    renormalised to sum to one when `normalize` (Mixtral, Qwen3-MoE; Qwen2-MoE keeps them)."""
    scores = jax.nn.softmax(router_logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(router_logits)
    weights, experts = jax.lax.top_k(scores, num_chosen)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def group_by_expert(experts, num_tokens, first_expert, num_local: int):
    """Sort the T*k (token, choice) pairs by expert, keeping those of experts
    [first_expert, first_expert + num_local) held here and of real tokens (index < num_tokens);
    the rest sort last, into no group. experts i32[T, k]. Returns (order i32[T*k]: pair of each
    sorted row, group_sizes i32[num_local])."""
    num_tokens_total, num_chosen = experts.shape
    local = experts.reshape(-1) - first_expert
    real = jnp.repeat(jnp.arange(num_tokens_total) < num_tokens, num_chosen)
    key = jnp.where(real & (local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros(num_local + 1, jnp.int32).at[key].add(1)[:num_local]
    return order, group_sizes


def combine(sorted_out, order, weights):
    """Each token's outputs back in place through the inverse permutation, weighted and summed
    over its choices: sorted_out [T*k, D], order i32[T*k], weights [T, k] -> [T, D]."""
    num_tokens, num_chosen = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_choice = sorted_out[inverse].reshape(num_tokens, num_chosen, -1)
    return jnp.einsum("TKD,TK->TD", per_choice, weights.astype(per_choice.dtype))


def routed_experts(x, weights, experts, num_tokens, expert_weights: "ExpertWeights", *, glu, impl: str,
                   first_expert=0):
    """The routed part of the layer on the experts held here (`ExpertWeights`: gate, up
    [E_local, D, F_local], down [E_local, F_local, D], float or packed, with their biases),
    whose ids start at `first_expert`. Returns this device's [T, D] share (the whole output on
    one device); the down projection's bias is the caller's (`down_bias_term`)."""
    gate, up, down, gate_bias, up_bias = expert_weights
    order, group_sizes = group_by_expert(experts, num_tokens, first_expert, grouped_mlp.groups_of(gate))
    rows = x[order // experts.shape[1]]
    sorted_out = grouped_mlp.grouped_mlp(rows, group_sizes, gate, up, down, None, impl, gate_bias=gate_bias,
                                         up_bias=up_bias, glu=glu)
    return combine(sorted_out, order, weights)


class ExpertWeights(NamedTuple):
    """One layer's routed experts as the grouped matmuls take them (a pytree, so it crosses
    `shard_map` whole): each projection a float stack or a `PackedWeight`, biases or None."""

    gate: Any
    up: Any
    down: Any
    gate_bias: Any = None
    up_bias: Any = None


def down_bias_term(down_bias, weights, experts):
    """sum over a token's choices of weight * its expert's down-projection bias: [T, D]. Added
    once, after the devices' shares are summed (inside, tensor parallelism would add it once per
    device)."""
    return jnp.einsum("TK,TKD->TD", weights.astype(down_bias.dtype), down_bias[experts])


def clamped_swiglu(limit: float, alpha: float):
    """gpt-oss's gated activation: glu(g, u) = (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
    g' = min(g, limit)."""
    def glu(gate, up):
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)

    return glu


def expert_glu(config: ModelConfig):
    if config.swiglu_limit is not None:
        return clamped_swiglu(config.swiglu_limit, config.swiglu_alpha)
    act = activation(config.hidden_act)
    return lambda gate, up: act(gate) * up


def expert_axes(expert_parallel: bool) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """Logical axes of the stacked expert weights ([E, D, F] gate/up, [E, F, D] down): experts
    whole per device under expert parallelism, else each expert's intermediate split as a dense
    MLP's (`parallel.LOGICAL_AXIS_RULES` maps the names). A packed weight stores each matrix
    transposed (output rows, packed contraction), so its axes are the other projection's."""
    expert, inner = ("sharded_experts", "expert_mlp") if expert_parallel else ("experts", "mlp")
    return (expert, "embed", inner), (expert, inner, "embed")


def expert_bias_axes(expert_parallel: bool) -> tuple[str, str]:
    """The axes of the gate and up projections' biases [E, F]: their weights' experts and width."""
    up_axes, _ = expert_axes(expert_parallel)
    return up_axes[0], up_axes[2]


def expert_logical_axes(expert_weights: ExpertWeights, expert_parallel: bool) -> ExpertWeights:
    """The logical axes of each leaf of `expert_weights`, in its structure (shard_map's specs):
    a float stack's from `expert_axes`, a packed one's transposed, a bias its weight's experts
    and intermediate axes."""
    up_axes, down_axes = expert_axes(expert_parallel)

    def axes(weight, float_axes, packed_axes):
        return PackedWeight(packed_axes, packed_axes, weight.format) if isinstance(weight, PackedWeight) else float_axes

    bias_axes = None if expert_weights.gate_bias is None else expert_bias_axes(expert_parallel)
    return ExpertWeights(axes(expert_weights.gate, up_axes, down_axes), axes(expert_weights.up, up_axes, down_axes),
                         axes(expert_weights.down, down_axes, up_axes), bias_axes, bias_axes)


class SparseMoE(nn.Module):
    """Router, routed experts and optional shared expert of one layer: x [T, D] -> [T, D].
    `num_tokens`: the real tokens of the step (the rest of T is padding)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    mesh: Any = None  # the "model" axis (tensor or expert parallelism); None: one device

    @nn.compact
    def __call__(self, x, num_tokens):
        c = self.config
        E, D = c.num_experts, c.hidden_size
        init = nn.initializers.normal(0.02)
        # Router scores accumulate in float32 (as transformers' softmax is float32): a rounding
        # flip between two close scores changes which experts run.
        router = self.param("router", nn.with_logical_partitioning(init, ("embed", "experts")), (D, E), self.dtype)
        logits = jnp.einsum("TD,DE->TE", x, router, preferred_element_type=jnp.float32)
        if c.moe_bias:
            logits = logits + self._bias("router_bias", ("experts",), (E,)).astype(jnp.float32)
        weights, experts = route(logits, c.num_experts_per_tok, c.router_scoring, c.norm_topk_prob)
        expert_weights = self._expert_weights()
        out = self._routed(x, weights, experts, num_tokens, expert_weights)
        if c.moe_bias:
            # Replicated like the router ([E, D] is small): added once, outside the shards.
            down_bias = self._bias("down_bias", ("experts", "embed"), (E, D))
            out = out + down_bias_term(down_bias, weights, experts).astype(out.dtype)
        if c.shared_expert_intermediate_size:
            out = out + self._shared_expert(x)
        return out

    @nn.nowrap
    def _bias(self, name: str, axes: tuple[str, ...], shape: tuple[int, ...]):
        return self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, self.dtype)

    @nn.nowrap
    def _expert_weights(self) -> ExpertWeights:
        c = self.config
        E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
        up_axes, down_axes = expert_axes(c.expert_parallel)
        if c.expert_format is None:
            init = nn.initializers.normal(0.02)
            gate, up = (self.param(name, nn.with_logical_partitioning(init, up_axes), (E, D, F), self.dtype)
                        for name in ("gate_proj", "up_proj"))
            down = self.param("down_proj", nn.with_logical_partitioning(init, down_axes), (E, F, D), self.dtype)
        else:  # stored [E, out, in / 2]: the transposed matrix's axes
            gate, up = (self._packed(name, down_axes, F, D) for name in ("gate_proj", "up_proj"))
            down = self._packed("down_proj", up_axes, D, F)
        if not c.moe_bias:
            return ExpertWeights(gate, up, down)
        bias_axes = expert_bias_axes(c.expert_parallel)
        return ExpertWeights(gate, up, down, self._bias("gate_bias", bias_axes, (E, F)),
                             self._bias("up_bias", bias_axes, (E, F)))

    @nn.nowrap
    def _packed(self, name: str, axes: tuple[str, str, str], rows: int, contraction: int) -> PackedWeight:
        """A packed [E, rows, contraction] weight (`packed4`): its codes, two per byte, and a scale
        byte per block. Random init: random codes at a scale of 2 ** -5 (values up to 0.19)."""
        c = self.config
        block = packed4.packed_format(c.expert_format).block_size
        if contraction % block:
            raise ValueError(f"{c.expert_format} experts need widths that are multiples of {block}; {name} "
                             f"contracts over {contraction}")
        E = c.num_experts

        def random_bytes(key, shape, dtype):
            return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(dtype)

        def scale_bytes(key, shape, dtype):
            return jnp.full(shape, packed4.E8M0_BIAS - 5, dtype)

        blocks = self.param(f"{name}_blocks", nn.with_logical_partitioning(random_bytes, axes),
                            (E, rows, contraction // 2), jnp.uint8)
        scales = self.param(f"{name}_scales", nn.with_logical_partitioning(scale_bytes, axes),
                            (E, rows, contraction // block), jnp.uint8)
        return PackedWeight(blocks, scales, c.expert_format)

    @nn.nowrap
    def _routed(self, x, weights, experts, num_tokens, expert_weights: ExpertWeights):
        c = self.config
        impl = grouped_mlp.resolve_impl("auto", target_backend())
        routed = functools.partial(routed_experts, glu=expert_glu(c), impl=impl)
        if self.mesh is None:
            return routed(x, weights, experts, num_tokens, expert_weights)
        specs = jax.tree.map(parallel.mesh_spec, expert_logical_axes(expert_weights, c.expert_parallel),
                             is_leaf=lambda node: isinstance(node, tuple) and all(isinstance(a, str) for a in node))
        return parallel.per_shard_experts(self.mesh, specs, c.expert_parallel, routed)(
            x, weights, experts, num_tokens, expert_weights)

    @nn.nowrap
    def _shared_expert(self, x):
        c = self.config
        shared = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, False, self.dtype, c.hidden_act,
                          c.quantization, name="shared_expert")(x)
        shared_gate = self.param("shared_expert_gate", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                                 (c.hidden_size,), self.dtype)
        return jax.nn.sigmoid(x @ shared_gate)[:, None].astype(shared.dtype) * shared
