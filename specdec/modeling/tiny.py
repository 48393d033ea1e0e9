"""Tiny random transformers models (and a matching tokenizer) built on the fly.

The statistical certificate needs models whose vocabulary is small enough (8-64) that the exact
law of the first tokens can be enumerated; tests need models that load in milliseconds. These are
real ``LlamaForCausalLM`` instances, run through exactly the code paths big models use.
"""

from __future__ import annotations

import torch


def tiny_llama(
    vocab_size: int = 16,
    seed: int = 0,
    hidden_size: int = 16,
    num_layers: int = 1,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    init_range: float = 0.5,
    max_positions: int = 128,
    eos_token_id: int | None = None,
):
    """A random Llama. ``init_range`` well above the usual 0.02 makes the next-token
    distributions peaked and varied, so filters like top-p and min-p actually bite."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()
    model.requires_grad_(False)
    return model


def negated_head(model):
    """A copy of ``model`` whose LM head is negated: its most likely tokens are the original's
    least likely, so under top-k its support is disjoint from the original's (forced rejections)."""
    import copy

    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.neg_()
    return clone


def word_tokenizer(vocab_size: int):
    """A WordLevel tokenizer over words ``w0 .. w{V-1}`` (whitespace-separated), for tests that
    need text: token id i <-> word ``w{i}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def char_tokenizer(tokens: list[str], eos: str = "<eos>"):
    """A byte-level BPE tokenizer over exactly ``tokens`` (id = index): ``eos`` is a special token,
    every other token one printable ASCII character (or a space) or two of the one-character
    tokens (a merge). Unlike
    :func:`word_tokenizer`, a grammar engine can read it (each token's bytes are known), so tests
    and the selftest can constrain a tiny model's output (issue 45)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    singles = {t for t in tokens if len(t) == 1}
    for t in tokens:
        plain = t.isascii() and t.isprintable()
        if t != eos and not (plain and (len(t) == 1 or (len(t) == 2 and set(t) <= singles))):
            raise ValueError(f"token {t!r}: one printable ASCII character, or two of the one-character tokens")
    # byte-level BPE spells a space "Ġ" (GPT-2's byte-to-character map; other printable ASCII is itself)
    spelled = [t if t == eos else t.replace(" ", "Ġ") for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [(t[0], t[1]) for t in spelled if t != eos and len(t) == 2]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def perturbed(model, scale: float = 0.5, seed: int = 0):
    """A copy of ``model`` with seeded Gaussian noise (``scale`` x each tensor's std) added to
    every weight: a draft that agrees with the target often but not always, so both the accept
    and the reject paths are exercised."""
    import copy

    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            std = float(param.std()) if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=generator) * std * scale)
    return clone


def smollm2_shaped(
    layers: int = 30,
    vocab_size: int = 49152,
    seed: int = 0,
    max_positions: int = 8192,
    heads: int = 9,
    kv_heads: int = 3,
):
    """A random Llama of SmolLM2-135M's widths (hidden 576, 9 heads of 64 over 3 key/value heads,
    intermediate 1536): the products and attention the default target runs, without its weights
    (``layers`` and ``vocab_size`` smaller for tests; other ``heads`` / ``kv_heads`` of 64 for a
    split SmolLM2 cannot take, e.g. 2 ways)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64 * heads,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.04,
    )
    return LlamaForCausalLM(config).eval()
