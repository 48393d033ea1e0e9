"""A feature draft: one decoder layer that drafts from the target's own hidden states.

The idea is EAGLE's (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): the target's last hidden state ("feature") already says most of what comes next,
so a draft that reads it needs far less capacity than a standalone small LM. At position t the
draft reads the token x_t and the target's feature f_{t-1} (the hidden state that predicted x_t),
and predicts f_t; tokens are read off the prediction with (a subset of) the target's output head.
To draft several tokens it feeds its own predictions back in place of the target's features.

Exactness does not depend on any of this: the draft still ships the q it sampled from, and the
target verifies as for any draft. The features only make the proposals better.

Shapes: V vocabulary, H the target's hidden size (= this draft's width), E the draft's token
embedding width, S the head vocabulary (tokens it can propose; the rest get q = 0, supplied by
the verifier's residual).

A model directory holds ``config.json`` (``model_type`` = ``specdec_feature_draft``, the fields
of :class:`FeatureDraftConfig`), ``model.safetensors`` and the target's tokenizer files;
``specdec.modeling.loading.load_model`` recognises it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.modeling.cache import LeanCache
from specdec.modeling.heads import full_vocab_logits
from specdec.modeling.ops import RopeTable, apply_rotary, causal_mask, linear

MODEL_TYPE = "specdec_feature_draft"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class FeatureDraftConfig:
    vocab_size: int
    hidden_size: int  # the target's hidden size: features in and out
    embed_size: int  # the draft's own token embedding width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    head_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target: str = ""  # the model whose features it was trained on
    target_fingerprint: str = ""  # that model's tokenizer fingerprint
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = MODEL_TYPE
    num_hidden_layers: int = 1  # what the KV accounting reads
    _name_or_path: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureDraftConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def is_feature_draft_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (ValueError, OSError):
        return False


class FeatureDraft(nn.Module):
    head_token_ids: torch.Tensor  # a buffer: the head vocabulary, [S]

    def __init__(self, config: FeatureDraftConfig, head_token_ids: torch.Tensor | None = None):
        super().__init__()
        c = self.config = config
        h, d = c.hidden_size, c.head_dim
        self.embed = nn.Embedding(c.vocab_size, c.embed_size)
        self.fuse = nn.Linear(c.embed_size + h, h, bias=False)  # [token embedding; feature] -> H
        self.attn_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.qkv = nn.Linear(h, (c.num_attention_heads + 2 * c.num_key_value_heads) * d, bias=False)
        self.o = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        self.head = nn.Linear(h, c.head_vocab_size, bias=False)  # rows of the target's head
        ids = head_token_ids if head_token_ids is not None else torch.arange(c.head_vocab_size)
        self.register_buffer("head_token_ids", ids.to(torch.long).clone())
        # kept in float32 whatever the weights' dtype (not a buffer, so .to(dtype) leaves it alone)
        self._inv_freq = (1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float()
        self._rope = RopeTable(self._rope_rows, c.max_position_embeddings)

    # -- pieces --------------------------------------------------------------------------------
    def _rope_rows(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, size) in float32, [size, D] each."""
        device = self.fuse.weight.device
        freqs = torch.outer(torch.arange(size, dtype=torch.float32, device=device), self._inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [0, length) in the weights' dtype, [length, D]."""
        cos, sin = self._rope.upto(length)
        dtype = self.fuse.weight.dtype
        return cos[:length].to(dtype), sin[:length].to(dtype)

    def inputs(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[..., T] tokens and [..., T, H] preceding features -> the layer's input [..., T, H]."""
        return linear(torch.cat((self.embed(token_ids), features.to(self.fuse.weight.dtype)), dim=-1), self.fuse.weight)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys, values of input rows x [B, T, H]: [B, heads, T, D] each (rotated)."""
        c = self.config
        b, t, _ = x.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = linear(self.attn_norm(x), self.qkv.weight).view(b, t, hq + 2 * hkv, d).transpose(1, 2)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP: x [B, T, H], attended [B, heads, T, D] -> [B, T, H]."""
        b, _, t, _ = attended.shape
        x = x + linear(attended.transpose(1, 2).reshape(b, t, -1), self.o.weight)
        gate, up = linear(self.mlp_norm(x), self.gate_up.weight).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down.weight)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head vocabulary only, [..., S] (training and the fast paths)."""
        return linear(hidden, self.head.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, -inf outside the head vocabulary, [..., V] float32."""
        return full_vocab_logits(linear(hidden, self.head.weight).float(), self.head_token_ids, self.config.vocab_size)

    # -- inference: one sequence over a KV cache (specdec.modeling.lean_llama.LeanCache, one layer) -----
    def new_cache(self) -> LeanCache:
        c = self.config
        return LeanCache(
            1,
            c.num_key_value_heads,
            c.head_dim,
            self.fuse.weight.dtype,
            self.fuse.weight.device,
            c.max_position_embeddings,
        )

    @torch.inference_mode()
    def extend(self, token_ids: torch.Tensor, features: torch.Tensor, cache) -> torch.Tensor:
        """Append n positions (tokens [n], preceding features [n, H]) to ``cache``; returns the
        predicted features of those positions, [n, H]."""
        n = int(token_ids.shape[0])
        start, end = cache.length, cache.length + n
        cache.reserve(end)
        cos, sin = self.rope(end)
        x = self.inputs(token_ids.view(1, n), features.view(1, n, -1))
        q, k, v = self.project(x, cos[start:end], sin[start:end])
        cache.keys[0, :, start:end] = k[0]
        cache.values[0, :, start:end] = v[0]
        mask = causal_mask(n, start, x.device)
        attended = F.scaled_dot_product_attention(
            q,
            cache.keys[:, :, :end],
            cache.values[:, :, :end],
            attn_mask=mask,
            scale=1.0 / math.sqrt(self.config.head_dim),
            enable_gqa=True,
        )
        cache.length = end
        return self.finish(x, attended)[0]

    # -- training: several drafting steps unrolled over whole sequences ------------------------
    def unrolled(self, token_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Predicted features [B, T, H] for drafting steps 1..``steps`` over teacher-forced tokens.

        Step 1 reads the target's features (``features[:, t]`` precedes token t), exactly as the
        first proposal does. Step s reads, at position t, step s-1's prediction for t-1 -- what the
        s-th proposal of a block reads -- and attends to what that proposal's cache holds: step-1
        keys up to position t-s+1 (fed with the target's features) and step-m keys at position
        t-s+m for m = 2..s (fed with the draft's own). So training sees the drafting it is used for
        (EAGLE-3's "training-time test"). Rows of step s are meaningful for t >= s - 1."""
        t = token_ids.shape[1]
        cos, sin = self.rope(t)
        position = torch.arange(t, device=token_ids.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        previous = features
        for s in range(1, steps + 1):
            if s > 1:  # the prediction for t - 1 stands in for the target's feature at t - 1
                previous = torch.cat((features[:, :1] * 0, outputs[-1][:, :-1]), dim=1)
            x = self.inputs(token_ids, previous)
            q, k, v = self.project(x, cos, sin)
            keys.append(k)
            values.append(v)
            blocks = [position[None, :] <= position[:, None] - s + 1]  # step-1 keys
            blocks += [position[None, :] == position[:, None] - s + m for m in range(2, s + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, s T]; the diagonal of block s is always allowed
            attended = F.scaled_dot_product_attention(
                q,
                torch.cat(keys, dim=2),
                torch.cat(values, dim=2),
                attn_mask=mask,
                scale=1.0 / math.sqrt(self.config.head_dim),
                enable_gqa=True,
            )
            outputs.append(self.finish(x, attended))
        return outputs

    # -- files ---------------------------------------------------------------------------------
    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in self.state_dict().items()
        }
        state["head_token_ids"] = state["head_token_ids"].to(torch.int32)  # ids < 2^31: half the bytes
        save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt", "model_type": MODEL_TYPE})
        (directory / "config.json").write_text(self.config.to_json())

    @classmethod
    def load(cls, directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> FeatureDraft:
        from safetensors.torch import load_file

        directory = Path(directory)
        config = FeatureDraftConfig.from_dict(json.loads((directory / "config.json").read_text()))
        config._name_or_path = str(directory)
        state = load_file(directory / WEIGHTS_FILE)
        state["head_token_ids"] = state["head_token_ids"].long()
        model = cls(config, state["head_token_ids"])
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
