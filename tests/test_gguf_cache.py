"""The converted copy of a GGUF model: written by the first float32 load, read by the next ones,
bit-identical to the dequantized tensors, keyed so a changed file never reuses a stale copy, and
never in the way (an unwritable cache is skipped, a switch turns it off)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.modeling import gguf_cache
from specdec.modeling.loading import load_model, load_tokenizer, resolve, tokenizer_fingerprint
from specdec.modeling.tiny import tiny_llama, word_tokenizer


def test_the_key_follows_the_file_and_the_switch_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV, raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = gguf_cache.converted_dir(gguf)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-")
    assert gguf_cache.converted_dir(gguf) == first  # stable
    gguf.write_bytes(b"other")  # size (and mtime) change: another copy
    assert gguf_cache.converted_dir(gguf) != first
    assert gguf_cache.find_converted(gguf) is None
    monkeypatch.setenv(gguf_cache.SWITCH_ENV, "0")
    assert gguf_cache.converted_dir(gguf) is None and gguf_cache.find_converted(gguf) is None


def test_an_unwritable_cache_is_skipped_with_a_warning(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert gguf_cache.write_converted(gguf, tiny_llama(32, seed=1), word_tokenizer(32)) is None
    assert "could not keep a converted copy" in capsys.readouterr().err
    assert gguf_cache.find_converted(gguf) is None


def test_a_written_copy_loads_as_the_same_model(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV, raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    model = tiny_llama(32, seed=3)
    folder = gguf_cache.write_converted(gguf, model, word_tokenizer(32))
    assert folder == gguf_cache.find_converted(gguf)
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left
    copy = load_model(str(folder), "cpu", torch.float32, quiet=True)
    reference = model.state_dict()
    assert all(torch.equal(reference[k], v) for k, v in copy.state_dict().items())
    # a second writer (a concurrent first load) keeps the finished copy
    assert gguf_cache.write_converted(gguf, model, word_tokenizer(32)) == folder


def test_a_tied_head_is_stored_as_the_input_embedding_like_any_checkpoint(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV, raising=False)
    gguf = tmp_path / "tied.gguf"
    gguf.write_bytes(b"x")
    model = tiny_llama(32, seed=4)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    folder = gguf_cache.write_converted(gguf, model, word_tokenizer(32))
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        assert torch.equal(weights.get_tensor("model.embed_tokens.weight"), model.model.embed_tokens.weight)
    copy = load_model(str(folder), "cpu", torch.float32, quiet=True)
    assert torch.equal(copy.lm_head.weight, model.model.embed_tokens.weight)  # re-tied on load


@pytest.mark.slow
def test_default_target_first_load_writes_the_copy_and_the_next_load_reads_it(tmp_path, monkeypatch):
    """In fresh processes with an empty cache: the dequantized model and the copy are bit-identical,
    the copy's tokenizer is the GGUF's, and the second load says where it loaded from."""
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV, raising=False)
    script = (
        "import sys, torch; from specdec.modeling.loading import load_model; "
        "m = load_model('smollm2', 'cpu', torch.float32); torch.save(m.state_dict(), sys.argv[1])"
    )
    first = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.pt")], capture_output=True, text=True, timeout=600, check=False
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "converted copy" not in first.stderr
    source = resolve("smollm2")
    folder = gguf_cache.find_converted(Path(source.location) / source.gguf_file)
    assert folder is not None and folder.parent == tmp_path / "cache" / "gguf"
    second = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "b.pt")], capture_output=True, text=True, timeout=600, check=False
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"from its converted copy {folder}" in second.stderr
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from_copy = load_tokenizer("smollm2")  # reads the copy now
    monkeypatch.setenv(gguf_cache.SWITCH_ENV, "0")
    from_gguf = load_tokenizer("smollm2")
    assert tokenizer_fingerprint(from_copy) == tokenizer_fingerprint(from_gguf)
    assert from_copy.chat_template == from_gguf.chat_template
