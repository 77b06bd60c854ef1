"""A mixture-of-experts feed-forward layer on the flattened token axis (selective batching fits
it as it fits the dense MLP: the tokens of every request in the step are routed together).

    weights, experts = top_k(score(x @ router))          [T, k] each
    rows   = x[token of each (token, choice), sorted by expert]      [T*k, D]
    out_r  = expert_mlp[expert of r](rows[r])            grouped: one matmul per expert's rows
    y[t]   = sum over t's choices of weight * out        through the inverse permutation
    y     += sigmoid(x @ shared_gate) * shared_mlp(x)    (Qwen2-MoE's shared expert)

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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from orca_jax.distributed import parallel
from orca_jax.config import ModelConfig
from orca_jax.kernels import grouped_mlp
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


def routed_experts(x, weights, experts, num_tokens, gate, up, down, *, act, impl: str, first_expert=0):
    """The routed part of the layer on the experts held here: gate, up [E_local, D, F_local],
    down [E_local, F_local, D], whose ids start at `first_expert`. Returns this device's [T, D]
    share (the whole output on one device)."""
    order, group_sizes = group_by_expert(experts, num_tokens, first_expert, gate.shape[0])
    rows = x[order // experts.shape[1]]
    sorted_out = grouped_mlp.grouped_mlp(rows, group_sizes, gate, up, down, act, impl)
    return combine(sorted_out, order, weights)


def expert_axes(expert_parallel: bool) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """Logical axes of the stacked expert weights ([E, D, F] gate/up, [E, F, D] down): experts
    whole per device under expert parallelism, else each expert's intermediate split as a dense
    MLP's (`parallel.LOGICAL_AXIS_RULES` maps the names)."""
    expert, inner = ("sharded_experts", "expert_mlp") if expert_parallel else ("experts", "mlp")
    return (expert, "embed", inner), (expert, inner, "embed")


class SparseMoE(nn.Module):
    """Router, routed experts and optional shared expert of one layer: x [T, D] -> [T, D].
    `num_tokens`: the real tokens of the step (the rest of T is padding)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    mesh: Any = None  # the "model" axis (tensor or expert parallelism); None: one device

    @nn.compact
    def __call__(self, x, num_tokens):
        c = self.config
        E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
        up_axes, down_axes = expert_axes(c.expert_parallel)
        init = nn.initializers.normal(0.02)
        # Router scores accumulate in float32 (as transformers' softmax is float32): a rounding
        # flip between two close scores changes which experts run.
        router = self.param("router", nn.with_logical_partitioning(init, ("embed", "experts")), (D, E), self.dtype)
        gate = self.param("gate_proj", nn.with_logical_partitioning(init, up_axes), (E, D, F), self.dtype)
        up = self.param("up_proj", nn.with_logical_partitioning(init, up_axes), (E, D, F), self.dtype)
        down = self.param("down_proj", nn.with_logical_partitioning(init, down_axes), (E, F, D), self.dtype)
        logits = jnp.einsum("TD,DE->TE", x, router, preferred_element_type=jnp.float32)
        weights, experts = route(logits, c.num_experts_per_tok, c.router_scoring, c.norm_topk_prob)
        out = self._routed(x, weights, experts, num_tokens, gate, up, down)
        if c.shared_expert_intermediate_size:
            out = out + self._shared_expert(x)
        return out

    @nn.nowrap
    def _routed(self, x, weights, experts, num_tokens, gate, up, down):
        c = self.config
        act = activation(c.hidden_act)
        impl = grouped_mlp.resolve_impl("auto", jax.default_backend())
        if self.mesh is None:
            return routed_experts(x, weights, experts, num_tokens, gate, up, down, act=act, impl=impl)
        up_axes, down_axes = expert_axes(c.expert_parallel)
        routed = functools.partial(routed_experts, act=act, impl=impl)
        return parallel.per_shard_experts(self.mesh, parallel.mesh_spec(up_axes), parallel.mesh_spec(down_axes),
                                          c.expert_parallel, routed)(x, weights, experts, num_tokens, gate, up, down)

    @nn.nowrap
    def _shared_expert(self, x):
        c = self.config
        shared = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, False, self.dtype, c.hidden_act,
                          c.quantization, name="shared_expert")(x)
        shared_gate = self.param("shared_expert_gate", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                                 (c.hidden_size,), self.dtype)
        return jax.nn.sigmoid(x @ shared_gate)[:, None].astype(shared.dtype) * shared
