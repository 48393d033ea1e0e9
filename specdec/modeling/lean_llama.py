"""A lean forward pass for Llama-architecture models (and Mistral, Qwen2, Qwen3: :data:`ARCHITECTURES`),
its sessions' KV in one paged pool (``specdec.modeling.paged``).

Why: on a small CPU a good part of a transformers SmolLM2 decode step is not the matrix products
but the small tensor operations around them, dozens per layer (rotary embeddings re-derived
every call, a ``torch.cat`` to grow each cache tensor, ``repeat_kv`` copying the whole cache for
grouped-query attention, a causal mask rebuilt per call, separate q/k/v and gate/up products).
This pass runs the same model, with the same weights, in far fewer operations
(docs/performance.md has the measurements):

- q, k and v come from one matrix product and gate/up from another (the module's own weights are
  re-pointed into the fused tensors, so no memory is duplicated and the module stays usable);
- rotary cos/sin come from a table computed once by the model's own rotary module;
- keys/values are written in place into the blocks of the replica's pool, every row of a pass in
  one indexed write per layer; a rollback gives whole blocks back;
- attention reads each sequence's blocks through its block table (``scaled_dot_product_attention``
  with ``enable_gqa`` on the fast backend: no ``repeat_kv`` copy);
- on the ``kernel`` backend every pass -- one sequence's or the batched passes of many
  (:meth:`LeanLlama.forward_batch`, what the engines use) -- runs all its decoder layers in one C
  call (``specdec.modeling.fewrow``), reading the same pool.

Embedding, RMSNorm, rotary and output head are the model's own modules, called as they are.

It is the same function of the weights as the transformers forward, up to float rounding (the
tests compare logits, greedy continuations and the cache after rollbacks against transformers).
Models it does not cover (other architectures, dynamic rotary scaling, MLP or output biases,
sliding windows, a sharded model)
keep the transformers forward: :func:`lean_runner` returns ``None`` for them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.modeling.attention import (
    Segment,
    attention_rows_invariant,
    fused_attention_paged,
    invariant_attention_many,
)
from specdec.modeling.dimensions import context_length
from specdec.modeling.fewrow import (
    LayerWeights,
    batch_layers,
    few_row_product,
    layers_available,
    lossless_bf16,
)
from specdec.modeling.heads import SubsetHead, full_vocab_logits
from specdec.modeling.invariant import ChunkedLinear, rows_invariant
from specdec.modeling.ops import RopeTable, apply_rotary, product, rms_norm
from specdec.modeling.paged import BlockPool, PagedCache
from specdec.modeling.sharding import Shard

log = logging.getLogger(__name__)

# Rotary types whose cos/sin depend on the position only (a table can hold them).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")

# The backends of the batched pass (docs/batching.md), one chosen when a model loads:
KERNEL = "kernel"  # kernels/fewrow.c: float32 on an x86 CPU with AVX-512; row-count invariant
TORCH_INVARIANT = "torch-invariant"  # torch, every device and dtype; products and attention invariant
TORCH = "torch"  # torch's fastest operations, whose rounding depends on the shape of the pass
INVARIANT_ENV = "SPECDEC_BATCH_INVARIANT"  # 0: the torch backend takes the fast operations


def batch_invariant_requested() -> bool:
    """Whether the torch backend should be row-count invariant (``SPECDEC_BATCH_INVARIANT``, on
    unless 0; the services' ``--no-batch-invariant`` sets it)."""
    return os.environ.get(INVARIANT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# Architectures the lean pass runs: Llama's decoder, with what each adds to it.
ARCHITECTURES = {
    "llama": "Llama, Llama-3 (grouped-query attention, llama3 rope scaling), SmolLM2",
    "mistral": "Mistral (without a sliding window shorter than the context)",
    "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 (per-head q/k RMSNorm)",
}


def _supported(model) -> str | None:
    """Why the lean pass cannot run ``model`` (None: it can)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rotary type {rope_type!r} depends on the sequence length"
    window = getattr(config, "sliding_window", None)
    if window and window < context_length(model):  # (Qwen2 without use_sliding_window has None)
        return f"a sliding window of {window} positions, shorter than the context"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "layers of sliding-window attention"
    for layer in model.model.layers:
        attn = layer.self_attn
        biases = [attn.q_proj.bias is not None, attn.k_proj.bias is not None, attn.v_proj.bias is not None]
        if any(biases) and not all(biases):
            return "biases on some of q/k/v only"
        if attn.o_proj.bias is not None:
            return "an output projection bias"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "a tensor-parallel shard"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "weights on the meta device"
    return None


def _fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor for the weights (or biases) of several linears over the same input; each
    module's becomes a view into it, so the fused tensor costs no extra memory and the module
    computes as before."""
    fused = torch.cat([part.detach() for part in parts], dim=0).contiguous()
    start = 0
    for part in parts:
        rows = part.shape[0]
        part.data = fused[start : start + rows]
        start += rows
    return fused


def _fused_biases(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    return None if any(b is None for b in biases) else _fuse(biases)  # type: ignore[arg-type]


class LeanLlama:
    """The forward pass of one loaded model of :data:`ARCHITECTURES` (see the module docstring)."""

    def __init__(self, model, batch_invariant: bool | None = None, shard: Shard | None = None) -> None:
        """``batch_invariant``: take the invariant torch operations where the kernel does not run
        (None: :func:`batch_invariant_requested`). ``shard``: ``model`` holds one tensor-parallel
        rank's part (``specdec.modeling.sharding.shard_in_place``); every rank of the group runs
        the same passes, in the same order."""
        self.model = model
        self.shard = shard
        world = shard.world if shard is not None else 1
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.head = model.get_output_embeddings()
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads) // world  # this rank's
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // world
        self.scaling = float(first.scaling)
        self.max_length = context_length(model)
        self.vocab_size = int(config.vocab_size)
        self.layers = []
        # what Llama's decoder lacks, per layer: Qwen2's fused q/k/v bias, Qwen3's q/k norms
        self.qkv_biases: list[torch.Tensor | None] = []
        self.qk_norms: list[tuple[torch.nn.Module, torch.nn.Module] | None] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv_biases.append(_fused_biases([attn.q_proj, attn.k_proj, attn.v_proj]))
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.qk_norms.append((q_norm, k_norm) if q_norm is not None and k_norm is not None else None)
            self.layers.append(
                (
                    layer.input_layernorm,
                    _fuse([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    attn.o_proj.weight,
                    layer.post_attention_layernorm,
                    _fuse([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    mlp.down_proj.weight,
                )
            )
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self._rotary = inner.rotary_emb
        self._rope = RopeTable(self._model_rope, self.max_length)
        self.intermediate = int(config.intermediate_size) // world
        self.eps = float(inner.layers[0].input_layernorm.variance_epsilon)
        # every session's KV, in blocks (specdec.modeling.paged): one pool per replica (per rank)
        self.pool = BlockPool(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)
        self._twins: list[torch.Tensor] = []
        self._kernel_layers = self._layers_for_kernel()
        head_weight = getattr(self.head, "weight", None)
        self._head_twin = lossless_bf16(head_weight) if self._twins and head_weight is not None else None
        self._chunked: list[tuple[ChunkedLinear, ...]] = []
        self._chunked_head: ChunkedLinear | None = None
        self.backend, self.backend_reason = self._choose_backend(
            batch_invariant_requested() if batch_invariant is None else batch_invariant
        )
        if shard is not None and len(set(shard.agree(self.backend))) > 1:  # every rank must round alike
            self._chunked, self._chunked_head = [], None
            self.backend, self.backend_reason = TORCH, "the ranks' invariance checks disagreed"
        log.info("batched pass for %s: %s (%s)", self.device, self.backend, self.backend_reason)

    def _choose_backend(self, invariant: bool) -> tuple[str, str]:
        """The backend of this model's passes, and why (see the module-level names)."""
        if self._kernel_layers is not None:
            return KERNEL, "float32 on a CPU with AVX-512: the layer kernel"
        if not invariant:
            return TORCH, "batch invariance switched off"
        self._chunked = [
            (ChunkedLinear(wqkv), ChunkedLinear(wo), ChunkedLinear(wgu), ChunkedLinear(wdown))
            for _, wqkv, wo, _, wgu, wdown in self.layers
        ]
        head_weight = getattr(self.head, "weight", None)
        plain_head = type(self.head) is torch.nn.Linear and self.head.bias is None
        if head_weight is not None and (plain_head or isinstance(self.head, SubsetHead)):
            self._chunked_head = ChunkedLinear(head_weight)
        failed = self._invariance_failures()
        if failed:
            self._chunked, self._chunked_head = [], None
            return TORCH, f"not row-count invariant here: {failed}"
        return TORCH_INVARIANT, f"{self.dtype} on {self.device.type}: chunked products, bucketed attention"

    def _invariance_failures(self) -> str:
        """What of the invariant operations gives a row other bits among other rows, checked on
        this model's own weights and shapes with this device's library ('' where nothing)."""
        failed = [
            name
            for name, fn in zip(("qkv", "o", "gate/up", "down"), self._chunked[0], strict=True)
            if not rows_invariant(fn, fn.in_features, self.dtype, self.device)
        ]
        if self._chunked_head is not None and not rows_invariant(
            self._chunked_head, self._chunked_head.in_features, self.dtype, self.device, rows=(1, 2, 5, 8), reference=16
        ):
            failed.append("head")
        if not attention_rows_invariant(self.heads, self.kv_heads, self.head_dim, self.dtype, self.device):
            failed.append("attention")
        return ", ".join(failed)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's results are the same bits whatever else shares its passes and however
        its positions are split into passes (so chunked prefill and copied prefixes are exact)."""
        return self.backend in (KERNEL, TORCH_INVARIANT)

    def _layers_for_kernel(self):
        """The layers' weights as kernels/fewrow.c's ``fewrow_batch`` reads them, or None where it
        cannot run this model (not float32 on the CPU, a width it does not cover, norms with
        different epsilons): passes then stay in torch. A snapshot: it holds raw
        pointers (and bf16 copies) of the weights, which the engines never change after loading."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not layers_available():
            return None
        if self.shard is not None:
            return None  # the kernel runs whole layers, with no place for the ranks' sums
        if any(b is not None for b in self.qkv_biases) or any(n is not None for n in self.qk_norms):
            return None  # the kernel computes Llama's layer only
        hidden = self.layers[0][1].shape[1]
        if self.head_dim % 16 or hidden % 16 or self.intermediate % 16:
            return None
        array = (LayerWeights * len(self.layers))()
        for slot, (norm1, wqkv, wo, norm2, wgu, wdown) in zip(array, self.layers, strict=True):
            tensors = (norm1.weight, wqkv, wo, norm2.weight, wgu, wdown)
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
                return None
            if float(norm1.variance_epsilon) != self.eps or float(norm2.variance_epsilon) != self.eps:
                return None
            # A model whose weights are all bfloat16 values (a draft shipped in bf16) is read from
            # bf16 twins: the same products at half the bytes (see fewrow.lossless_bf16).
            twins = [lossless_bf16(t) for t in (wqkv, wo, wgu, wdown)]
            if all(t is not None for t in twins):
                self._twins.extend(twins)  # kept alive here: the array holds raw pointers
                tensors = (norm1.weight, twins[0], twins[1], norm2.weight, twins[2], twins[3])
                slot.bf16 = 1
            for name, t in zip(("norm1", "wqkv", "wo", "norm2", "wgu", "wdown"), tensors, strict=True):
                setattr(slot, name, t.data_ptr())
        return array

    def new_cache(self) -> PagedCache:
        """An empty cache of one sequence, its blocks from this model's pool."""
        return PagedCache(self.pool, self.max_length)

    def _model_rope(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, size) from the model's own rotary module, [size, D] each."""
        positions = torch.arange(size, device=self.device).unsqueeze(0)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self._rotary(probe, positions)
        return cos[0], sin[0]

    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, length) (or more): see :class:`~specdec.modeling.ops.RopeTable`."""
        return self._rope.upto(length)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: PagedCache, logits_to_keep: int = 1) -> torch.Tensor:
        """Logits [rows, V] of the last ``logits_to_keep`` of ``input_ids`` (1-D), appending their
        keys/values to ``cache``."""
        return self.forward_with_features(input_ids, cache, logits_to_keep)[0]

    @torch.inference_mode()
    def forward_with_features(
        self, input_ids: torch.Tensor, cache: PagedCache, logits_to_keep: int = 1, feature_rows: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, and the final normed hidden states (what the head reads) of the last
        ``feature_rows`` positions, [feature_rows, H] (None for 0): one sequence's
        :meth:`forward_batch`."""
        return self.forward_batch([Pass(input_ids, cache, logits_to_keep, feature_rows)])[0]

    def _kernel_pass(self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """The decoder layers over x in the layer kernel (False where it does not run: nothing
        was touched, the caller runs torch's layers); ``segments`` as for fewrow.batch_layers."""
        if self._kernel_layers is None:
            return False
        return batch_layers(
            x,
            self._kernel_layers,
            self.pool.keys,
            self.pool.values,
            segments,
            cos,
            sin,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scaling,
        )

    @property
    def batches(self) -> bool:
        """Whether :meth:`forward_batch` runs its sequences as one pass: on every backend."""
        return True

    @torch.inference_mode()
    def forward_batch(self, passes: list[Pass]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several sequences' passes as ONE forward pass over their rows (no padding): each
        :class:`Pass` appends its tokens to its own cache, and gets the logits of its last
        ``logits_to_keep`` rows [keep, V] and the final normed hidden states of its last
        ``feature_rows`` rows (None for 0), as :meth:`forward_with_features` would give it.

        The rows of all sequences go through each product together; attention is per sequence,
        over its own cache. On an invariant backend (:attr:`batch_invariant`) a sequence's results are
        the same bits whatever else shares the pass and however its positions are split into
        passes, one sequence alone included -- so the engines send every pass here."""
        if not passes:
            return []
        caches, segments, cos_rows, sin_rows = [], [], [], []
        for p in passes:
            n, start = int(p.input_ids.shape[-1]), p.cache.length
            if p.cache.pool is not self.pool:
                raise ValueError("a cache of another model's pool")
            p.cache.prepare_write(start, start + n)  # may grow the pool: its tensors are read after
            cos_table, sin_table = self._rope_table(start + n)
            cos_rows.append(cos_table[start : start + n])
            sin_rows.append(sin_table[start : start + n])
            caches.append(p.cache)
            segments.append((p.cache.table(), start, n))
        x = self._embed(torch.cat([p.input_ids.reshape(-1) for p in passes])).contiguous()
        cos, sin = torch.cat(cos_rows).contiguous(), torch.cat(sin_rows).contiguous()
        # the kernel where it runs (it checks every shape at load; should it decline, torch's layers)
        if not (self.backend == KERNEL and self._kernel_pass(x, segments, cos, sin)):
            x = self._torch_layers(x, segments, cos, sin)
        kept, features, offset = [], [], 0
        for p, cache, (_, start, n) in zip(passes, caches, segments, strict=True):
            cache.length = start + n
            keep = min(p.logits_to_keep, n)
            last = max(keep, p.feature_rows)
            normed = rms_norm(x[offset + n - last : offset + n], self.norm)  # per sequence: the shape it has alone
            kept.append(normed[last - keep :])
            features.append(normed[last - p.feature_rows :] if p.feature_rows else None)
            offset += n
        kept_rows = torch.cat(kept)
        logits = self._batch_head(kept_rows) if len(kept_rows) else kept_rows.new_empty(0, self.vocab_size)
        out, row = [], 0
        for rows, feature in zip((len(k) for k in kept), features, strict=True):
            out.append((logits[row : row + rows], feature))
            row += rows
        return out

    def _batch_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over every kept row of a batch in one product, row-count invariant on
        an invariant backend."""
        head = self.head
        if self.backend == TORCH:
            return self._head(hidden)
        if self.shard is not None:
            assert self._chunked_head is not None  # a shard's head is a plain linear (sharding.why_not_shardable)
            return self.shard.concat(self._chunked_head(hidden), self.vocab_size)
        if self._chunked_head is not None:
            logits = self._chunked_head(hidden)
            if isinstance(head, SubsetHead):
                return full_vocab_logits(logits, head.token_ids, head.vocab_size)
            return logits
        weight = self._head_twin if self._head_twin is not None else getattr(head, "weight", None)
        plain = type(head) is torch.nn.Linear and head.bias is None
        if self.backend == KERNEL and weight is not None and (plain or isinstance(head, SubsetHead)):
            subset = few_row_product(hidden.contiguous(), weight)
            if subset is not None:
                return subset if plain else full_vocab_logits(subset, head.token_ids, head.vocab_size)
        return torch.cat([self._head(row.unsqueeze(0)) for row in hidden])  # row by row: the same for any batch

    def _torch_layers(
        self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The decoder layers over the rows x [N, H] of several sequences in torch operations:
        ``segments`` lists, in the order of x's rows, each sequence's (block table, start, rows)
        -- its rows are its positions [start, start + rows), their keys/values written there in
        its blocks of the pool; cos/sin [N, D] are each row's rotary rows. Products over all rows
        at once; each sequence attends over its own positions. Invariant or fast operations by
        the backend."""
        n = x.shape[0]
        h_q, h_kv, d = self.heads, self.kv_heads, self.head_dim
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, D]: the same rotation for every head of a row
        blocks, offsets = self._row_slots(segments)
        for index, (norm1, _, _, norm2, _, _) in enumerate(self.layers):
            qkv_of, o_of, gu_of, down_of = self._products(index)
            qkv = qkv_of(rms_norm(x, norm1))  # [N, (h_q + 2 h_kv) d]
            bias, qk_norms = self.qkv_biases[index], self.qk_norms[index]
            if bias is not None:
                qkv = qkv + bias
            qk = qkv[:, : (h_q + h_kv) * d].view(n, h_q + h_kv, d)
            if qk_norms is not None:
                q_norm, k_norm = qk_norms
                qk = torch.cat((rms_norm(qk[:, :h_q], q_norm), rms_norm(qk[:, h_q:], k_norm)), dim=1)
            qk = apply_rotary(qk, cos, sin)  # [N, heads, d]
            keys, values = self.pool.keys[index], self.pool.values[index]  # [blocks, h_kv, block, d]
            keys[blocks, :, offsets] = qk[:, h_q:]  # every row's key/value into its slot: one write each
            values[blocks, :, offsets] = qkv[:, (h_q + h_kv) * d :].view(n, h_kv, d)
            x = x + self._across_ranks(o_of(self._attend(qk[:, :h_q], keys, values, segments)))
            gate, up = gu_of(rms_norm(x, norm2)).chunk(2, dim=-1)
            x = x + self._across_ranks(down_of(F.silu(gate) * up))
        return x

    def _row_slots(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool block and the offset in it of each row of the pass, [N] each."""
        size = self.pool.block
        blocks, offsets = [], []
        for table, start, rows in segments:
            positions = torch.arange(start, start + rows, device=table.device)
            blocks.append(table[positions // size])
            offsets.append(positions % size)
        return torch.cat(blocks), torch.cat(offsets)

    def _across_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-sharded product's output summed over the ranks (itself without a shard)."""
        return partial if self.shard is None else self.shard.sum(partial)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` (1-D) [n, H]; with a shard, each rank looks up the ids
        of its vocabulary rows and the ranks' rows are summed (one of them nonzero: exact)."""
        if self.shard is None:
            return self.embed(ids.reshape(1, -1))[0]
        weight = self.embed.weight
        first = self.shard.padded_part(self.vocab_size).start
        local = ids - first
        mine = (local >= 0) & (local < weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), weight)
        return self.shard.sum(torch.where(mine.unsqueeze(-1), rows, 0))

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segments: list[Segment]
    ) -> torch.Tensor:
        """Attention of the rows q [N, Hq, D] of several sequences, each over its own positions
        of one layer's pool (keys/values [blocks, Hkv, block, D])."""
        if self.backend == TORCH_INVARIANT:
            return invariant_attention_many(q, keys, values, segments, self.scaling)
        return fused_attention_paged(q, keys, values, segments, self.scaling)

    def _products(self, index: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """Layer ``index``'s four products (qkv, o, gate/up, down) as the backend computes them."""
        if self.backend == TORCH_INVARIANT:
            return self._chunked[index]
        _, wqkv, wo, _, wgu, wdown = self.layers[index]
        return tuple(functools.partial(_product_by, w) for w in (wqkv, wo, wgu, wdown))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        if self.shard is not None:
            return self.shard.concat(product(hidden, head.weight), self.vocab_size)
        if type(head) is torch.nn.Linear and head.bias is None:
            return product(hidden, head.weight, self._head_twin)  # the widest product of the pass: see product()
        if isinstance(head, SubsetHead):
            return head(hidden, self._head_twin)
        return head(hidden)


def _product_by(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return product(x, weight)


class Pass:
    """One sequence's part of :meth:`LeanLlama.forward_batch`."""

    __slots__ = ("cache", "feature_rows", "input_ids", "logits_to_keep")

    def __init__(self, input_ids: torch.Tensor, cache: PagedCache, logits_to_keep: int = 1, feature_rows: int = 0):
        self.input_ids = input_ids
        self.cache = cache
        self.logits_to_keep = logits_to_keep
        self.feature_rows = feature_rows


def why_not_lean(model) -> str | None:
    """Why the lean pass does not run ``model`` (None: it does)."""
    if os.environ.get("SPECDEC_LEAN_FORWARD", "1") == "0":
        return "SPECDEC_LEAN_FORWARD=0"
    return _supported(model)


def lean_runner(model, batch_invariant: bool | None = None) -> LeanLlama | None:
    """The lean pass for ``model``, or None where it does not apply or SPECDEC_LEAN_FORWARD=0."""
    return None if why_not_lean(model) is not None else LeanLlama(model, batch_invariant)
