"""What a model's config says about its size: the context it accepts and the KV bytes a token costs."""

from __future__ import annotations

import torch


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers (from the model config)."""
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * layers * heads * head_dim * torch.empty(0, dtype=dtype).element_size()
