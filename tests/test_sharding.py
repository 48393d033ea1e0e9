"""The lean pass split over tensor-parallel ranks (specdec/modeling/sharding.py): three gloo ranks
in separate processes, each holding a third of the heads, the MLP and the vocabulary. A sharded
pass computes the model (against transformers' logits on the whole model), and a row's logits are
the same bits alone and among other sequences (the ranks' sums are gathered and added in rank
order, not all-reduced)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from specdec.modeling.tiny import smollm2_shaped

pytestmark = pytest.mark.integration

WORLD = 3
LENGTHS = (5, 9, 1, 12)
VOCAB = 1000  # not divisible by 3: the last rank's vocabulary rows are padded


def build(architecture: str, dtype: torch.dtype):
    model = smollm2_shaped(layers=2, vocab_size=VOCAB, seed=4)
    if architecture == "qwen2":  # the same weights with q/k/v biases (Qwen2's one addition)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**{k: v for k, v in model.config.to_dict().items() if k != "model_type"})
        qwen = Qwen2ForCausalLM(config).eval()
        qwen.load_state_dict(model.state_dict(), strict=False)
        generator = torch.Generator().manual_seed(2)
        for layer in qwen.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data = torch.randn(proj.bias.shape, generator=generator) * 0.5
        model = qwen
    return model.to(dtype).requires_grad_(False)


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in LENGTHS]


def rank_main(rank: int, port: int, architecture: str, dtype: torch.dtype, results) -> None:
    import torch.distributed as dist

    from specdec.modeling.lean_llama import LeanLlama, Pass
    from specdec.modeling.sharding import Shard, shard_in_place

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        model = build(architecture, dtype)
        shard = Shard(rank, WORLD)
        shard_in_place(model, shard)
        lean = LeanLlama(model, batch_invariant=True, shard=shard)
        seqs = sequences()

        def run(indices):
            passes = [Pass(seqs[i], lean.new_cache(), len(seqs[i])) for i in indices]
            return [out for out, _ in lean.forward_batch(passes)]

        alone = [run([i])[0] for i in range(len(seqs))]
        together = run(list(range(len(seqs))))
        reordered = run([3, 1, 0, 2])
        results.put(
            (
                rank,
                lean.backend,
                lean.heads,
                lean.kv_heads,
                all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)),
                all(torch.equal(alone[i], out) for i, out in zip([3, 1, 0, 2], reordered, strict=True)),
                [a.float().tolist() for a in alone],
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("architecture", "dtype", "tolerance"),
    [("llama", torch.float32, 1e-4), ("llama", torch.bfloat16, 0.1), ("qwen2", torch.float32, 1e-4)],
)
def test_a_sharded_pass_computes_the_model_and_a_row_is_the_same_bits_alone_and_among_others(
    architecture, dtype, tolerance
):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, port, architecture, dtype, results)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    try:
        answers = sorted(results.get(timeout=240) for _ in range(WORLD))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    whole = build(architecture, dtype)
    for rank, backend, heads, kv_heads, batched_same, reordered_same, logits in answers:
        assert backend == "torch-invariant", rank
        assert (heads, kv_heads) == (3, 1)  # a third of 9 over 3
        assert batched_same and reordered_same, rank
        assert logits == answers[0][-1]  # every rank holds the same logits
        for seq, rows in zip(sequences(), logits, strict=True):
            expected = whole(seq.unsqueeze(0)).logits[0].float()
            got = torch.tensor(rows)
            assert got.shape == (len(seq), VOCAB)
            assert torch.allclose(got, expected, atol=tolerance, rtol=tolerance), float((got - expected).abs().max())
