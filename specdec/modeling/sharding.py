"""Tensor parallelism of the lean pass (issue 43, item 5): one rank's shard of a model and the two
collectives its pass needs (docs/batching.md, "Tensor-parallel targets").

Each rank keeps the attention heads ``[rank * h / N, (rank + 1) * h / N)`` (queries and the KV
heads they read, so a rank's KV cache holds only its heads), the same slice of the MLP's
intermediate width, and a slice of the vocabulary rows of the embedding and the output head.
A layer's attention output and MLP output are then partial sums over the ranks.

Why all-gather and add, not all-reduce: a reduction's order of addition depends on how the
library splits the buffer (a ring all-reduce splits it by its length, so a row's sum would be
added in another order when more rows share the pass), and the pass must give a row the same bits
whatever shares it. Gathering moves bits without arithmetic, and every rank adds the parts in
rank order, elementwise: the sum of a row is the same at any row count, and the same on every
rank, so every rank holds the same hidden state and the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# A rank's vocabulary rows come in multiples of this: a product with fewer output rows than that
# (a tiny vocabulary split) took another library kernel for 1-8 rows than for 16 here, so its
# rows were not row-count invariant; padded with zero rows, it is.
VOCAB_ALIGN = 64


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` in the process ``group`` (None: the default group)."""

    rank: int
    world: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")

    def part(self, total: int) -> slice:
        """This rank's slice of ``total`` items split evenly (``total`` divisible by the world)."""
        if total % self.world:
            raise ValueError(f"{total} does not split {self.world} ways")
        size = total // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def padded_part(self, total: int) -> slice:
        """This rank's slice of ``total`` items in ``world`` equal parts of ceil(total / world),
        rounded up to a multiple of VOCAB_ALIGN: the last parts may run past ``total`` (the
        vocabulary need not divide)."""
        size = -(-total // self.world)
        size = -(-size // VOCAB_ALIGN) * VOCAB_ALIGN
        return slice(self.rank * size, (self.rank + 1) * size)

    def _gather(self, part: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        part = part.contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part, group=self.group)
        return parts

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's ``partial``, added in rank order (see the module
        doc): the same bits on every rank and for every row count."""
        parts = self._gather(partial)
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def concat(self, part: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's ``part`` [..., w] side by side, cut to ``width`` columns."""
        return torch.cat(self._gather(part), dim=-1)[..., :width]

    def agree(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out


def _rows(tensor: torch.Tensor, part: slice) -> torch.Tensor:
    """Rows ``part`` of ``tensor``, zero rows appended where ``part`` runs past its end."""
    rows = tensor[part.start : min(part.stop, tensor.shape[0])]
    missing = (part.stop - part.start) - rows.shape[0]
    if missing:
        rows = torch.cat((rows, rows.new_zeros(missing, *rows.shape[1:])))
    return rows.contiguous()


def _keep(param: torch.nn.Parameter | None, value: torch.Tensor) -> None:
    if param is not None:
        param.data = value


def shard_in_place(model, shard: Shard) -> None:
    """Cut ``model`` (a whole model of the lean pass's architectures, on the host) down to
    ``shard``'s part, in place: the rest of each weight is freed. Afterwards only the lean pass
    built with the same shard computes it (its own modules' forward no longer does)."""
    config = model.config
    inner = model.model
    head_dim = int(inner.layers[0].self_attn.head_dim)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    q_part, kv_part = shard.part(heads), shard.part(kv_heads)
    q_rows = slice(q_part.start * head_dim, q_part.stop * head_dim)
    kv_rows = slice(kv_part.start * head_dim, kv_part.stop * head_dim)
    inter = shard.part(int(config.intermediate_size))
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj, rows in ((attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows)):
            _keep(proj.weight, proj.weight.data[rows].contiguous())
            if proj.bias is not None:
                _keep(proj.bias, proj.bias.data[rows].contiguous())
        _keep(attn.o_proj.weight, attn.o_proj.weight.data[:, q_rows].contiguous())
        for proj in (mlp.gate_proj, mlp.up_proj):
            _keep(proj.weight, proj.weight.data[inter].contiguous())
        _keep(mlp.down_proj.weight, mlp.down_proj.weight.data[:, inter].contiguous())
    vocab = shard.padded_part(int(config.vocab_size))
    embed, head = inner.embed_tokens.weight, model.get_output_embeddings().weight
    tied = head is embed or head.data_ptr() == embed.data_ptr()
    _keep(embed, _rows(embed.data, vocab))
    _keep(head, embed.data if tied else _rows(head.data, vocab))


def why_not_shardable(model, world: int) -> str | None:
    """Why the lean pass cannot run ``model`` split ``world`` ways (None: it can)."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", int(config.intermediate_size)),
    ):
        if value % world:
            return f"{name}={value} is not divisible by {world}"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its output head is a {type(head).__name__}, not a plain linear layer"
    return None
