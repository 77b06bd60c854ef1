"""AttentionMetadata: the one form in which a step's ragged structure reaches attention.

Built once per step on the host (`orca_jax.worker.batch.build_batch`, numpy), sent to the device as
part of the batch, read by RoPE (positions), by `write_kv` (slot_mapping) and by every
`ragged_paged_attention` implementation (the rest), and shifted onto each layer's pages by
`for_layer`. A registered pytree dataclass, so it passes through `jit`, `nn.scan` and
`shard_map` whole; all fields are data (arrays), none static: shapes alone pick the program.

T is the token bucket (every scheduled token of every sequence, back to back, then padding),
S the sequence bucket (scheduled sequences, then padding rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T]: position of each token in its sequence (RoPE; 0 for padding)
    slot_mapping: jax.Array  # i32[T]: cache slot of each token's K/V, page * page_size + offset; padding -> page 0
    page_table: jax.Array  # i32[S, max_pages_per_seq]: pages of each sequence, in order; unused -> page 0
    kv_lens: jax.Array  # i32[S]: tokens in the cache per sequence, this step's included
    cu_q_lens: jax.Array  # i32[S + 1]: offsets of each sequence's query tokens in T
    num_seqs: jax.Array  # i32[1]: real sequences; rows past it are padding

    def for_layer(self, layer, pages_per_layer: int, page_size: int) -> "AttentionMetadata":
        """The same step pointed at one layer's pages of the flat all-layer cache, where layer
        l's page p is page `l * pages_per_layer + p` (`layer` may be traced: the scan index)."""
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping + layer * pages_per_layer * page_size,
            page_table=self.page_table + layer * pages_per_layer,
        )


jax.tree_util.register_dataclass(
    AttentionMetadata, data_fields=[f.name for f in dataclasses.fields(AttentionMetadata)], meta_fields=[]
)
