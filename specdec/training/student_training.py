"""What training the standalone draft is made of: batches of corpus records, the distillation
loss (KL to the teacher over the head vocabulary) and the held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.training.logprob_corpus import Record
from specdec.training.trainer import quiet_mixed_norm, student_autocast

# The cosine schedule's floor (a fraction of --lr) that the standalone drafts were trained with.
LR_FLOOR = 0.1


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] attention mask
    rows: torch.Tensor  # [N] batch row of each supervised position
    cols: torch.Tensor  # [N] position whose hidden state predicts the next token
    top_ids: torch.Tensor  # [N, K]
    top_logp: torch.Tensor  # [N, K]

    def to(self, device) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (self.ids, self.mask, self.rows, self.cols, self.top_ids, self.top_logp)
            )
        )


def make_batch(records: list[Record], seq_len: int) -> Batch:
    width = min(seq_len, max(len(r.ids) for r in records))
    ids = torch.zeros(len(records), width, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    rows, cols, tids, tlogp = [], [], [], []
    for i, r in enumerate(records):
        seq = r.ids[:width]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        g = max(0, min(len(r.top_ids), width - r.start))  # generated tokens that fit
        rows.append(torch.full((g,), i, dtype=torch.long))
        cols.append(torch.arange(r.start - 1, r.start - 1 + g))
        tids.append(r.top_ids[:g].long())
        tlogp.append(r.top_logp[:g].float())
    return Batch(ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(tids), torch.cat(tlogp))


def distill_loss(student, batch: Batch, head: torch.Tensor, slot: torch.Tensor, temperature: float, bf16: bool = False):
    """(KL over the head vocabulary, top-1 agreement count, positions). The teacher's top tokens
    outside the head are dropped and the rest renormalised: the draft cannot propose them anyway.
    With ``bf16`` the student's matrix products run in bf16 (autocast); the softmax and KL in fp32."""
    device = batch.ids.device
    with student_autocast(device, bf16), quiet_mixed_norm():
        hidden = student.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        h = hidden[batch.rows, batch.cols]  # [N, H]
        weight = student.get_output_embeddings().weight
        logits = h @ weight[head].T
    logq = F.log_softmax(logits.float() / temperature, dim=-1)  # [N, S]
    where = slot[batch.top_ids]  # [N, K], -1 = outside the head
    inside = where >= 0
    logp = torch.where(inside, batch.top_logp / temperature, float("-inf"))
    keep = inside.any(-1)
    logp = torch.log_softmax(logp[keep], dim=-1)
    p = logp.exp()
    logq_at = logq[keep].gather(-1, where[keep].clamp(min=0))
    kl = (p * (torch.where(inside[keep], logp, 0.0) - logq_at)).sum(-1)
    agree = (head[logq.argmax(-1)] == batch.top_ids[:, 0]).sum()
    return kl.mean() * temperature**2, int(agree), len(batch.rows)


@torch.no_grad()
def evaluate(student, records: list[Record], head, slot, temperature: float, seq_len: int) -> tuple[float, float]:
    """(mean KL, top-1 agreement) over ``records``."""
    was_training = student.training
    student.eval()
    device = head.device
    kl_sum = agree = total = 0.0
    for i in range(0, len(records), 32):
        batch = make_batch(records[i : i + 32], seq_len).to(device)
        kl, a, n = distill_loss(student, batch, head, slot, temperature)
        kl_sum += float(kl) * n
        agree += a
        total += n
    student.train(was_training)
    return kl_sum / max(1, total), agree / max(1, total)
