"""The KV cache of one sequence as the project's own passes keep it (the lean Llama pass, the
feature draft): preallocated, grown by doubling, cropped in O(1)."""

from __future__ import annotations

import torch


class LeanCache:
    """Keys and values of one sequence for every layer: [layers, kv_heads, capacity, head_dim]
    each, the first ``length`` positions valid. ``crop(-n)`` forgets the last n positions."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, max_length: int, capacity: int = 64
    ):
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_length = max_length
        self.length = 0
        self.keys = self._alloc(min(capacity, max_length))
        self.values = self._alloc(min(capacity, max_length))

    def _alloc(self, capacity: int) -> torch.Tensor:
        layers, heads, dim = self.shape
        return torch.empty(layers, heads, capacity, dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions (doubling, so appends are amortised O(1))."""
        if length <= self.capacity:
            return
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the model context of {self.max_length}")
        capacity = min(self.max_length, max(length, 2 * self.capacity))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._alloc(capacity)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, n: int) -> None:
        """transformers' convention: a negative ``n`` removes that many trailing positions."""
        if n >= 0:
            raise ValueError("LeanCache.crop takes a negative count of positions to remove")
        self.length = max(0, self.length + n)

    def nbytes(self) -> int:
        """Bytes the valid positions occupy (what the session accounts for)."""
        layers, heads, dim = self.shape
        return 2 * layers * heads * self.length * dim * self.keys.element_size()
