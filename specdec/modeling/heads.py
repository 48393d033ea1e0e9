"""A draft's reduced-vocabulary LM head: logits only over the tokens listed in ``head_vocab.json``.

A distilled draft keeps the target's full vocabulary for its *input* embeddings (a prompt may
contain any token) but computes output logits over a few thousand frequent tokens, which is most of
its per-token cost saved. Every other token gets logit -inf, i.e. q = 0: exactness is untouched,
because the verifier's residual max(p - q, 0) supplies any token the draft cannot propose.

The model directory stays a normal Hugging Face checkpoint (a full tied head loads anywhere);
``head_vocab.json`` is an optional speed-up that ``specdec.modeling.loading.load_model`` applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec.modeling.ops import linear

HEAD_VOCAB_FILE = "head_vocab.json"


class SubsetHead(nn.Module):
    """hidden [..., H] -> logits [..., V], finite only at ``token_ids``."""

    token_ids: torch.Tensor  # a buffer: the head vocabulary, [S]

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        if token_ids.ndim != 1 or len(token_ids) == 0:
            raise ValueError("head vocabulary must be a non-empty list of token ids")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise ValueError(f"head vocabulary has ids outside [0, {vocab_size})")
        if len(torch.unique(token_ids)) != len(token_ids):
            raise ValueError("head vocabulary lists a token twice")
        self.weight = nn.Parameter(weight[token_ids].detach().clone(), requires_grad=False)
        self.register_buffer("token_ids", token_ids.clone(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, twin: torch.Tensor | None = None) -> torch.Tensor:
        """``twin``: a bf16 copy of ``weight`` with the same values, read by the few-row kernel."""
        return full_vocab_logits(linear(hidden, self.weight, twin), self.token_ids, self.vocab_size)


def full_vocab_logits(subset: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a head vocabulary, [..., S] (column j is token ``token_ids[j]``), spread over
    the whole vocabulary, [..., V]: -inf (q = 0) for every token outside it."""
    full = subset.new_full((*subset.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, token_ids, subset)


def read_head_vocab(directory: str | Path) -> list[int] | None:
    path = Path(directory) / HEAD_VOCAB_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [int(t) for t in data["token_ids"]]


def write_head_vocab(directory: str | Path, token_ids: list[int], note: str = "") -> None:
    payload = {"token_ids": sorted(int(t) for t in token_ids), "note": note}
    (Path(directory) / HEAD_VOCAB_FILE).write_text(json.dumps(payload))


def apply_head_vocab(model, token_ids: list[int]):
    """Swap the model's LM head for a ``SubsetHead`` built from its own output weights."""
    head = model.get_output_embeddings()
    ids = torch.tensor(token_ids, dtype=torch.long, device=head.weight.device)
    model.set_output_embeddings(SubsetHead(head.weight, ids, head.weight.shape[0]))
    model.config.tie_word_embeddings = False  # the subset is a snapshot; never re-tie it
    return model
