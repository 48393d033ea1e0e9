import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

from specdec.modeling.tiny import perturbed, tiny_llama

VOCAB = 32


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(VOCAB, seed=3, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session")
def draft_model(target_model):
    # Close to the target so blocks are partly accepted: both paths get exercised.
    return perturbed(target_model, scale=0.04, seed=5)


@pytest.fixture(scope="session")
def other_draft_model():
    return tiny_llama(VOCAB, seed=99, hidden_size=16, num_layers=1)


@pytest.fixture(scope="session")
def smollm2():
    """The default target (SmolLM2-135M-Instruct GGUF), loaded once per test session."""
    from specdec.modeling.loading import load_model, load_tokenizer

    torch.manual_seed(0)
    return load_model("smollm2", "cpu", torch.float32, quiet=True), load_tokenizer("smollm2")
