"""A converted copy of each GGUF model, so that it is dequantized once rather than at every start.

transformers dequantizes a GGUF file on every load: for the default target (SmolLM2-135M, Q4_1)
that is ~20 s for the weights and ~5 s for the tokenizer on 2 cores, paid by every service, every
tensor-parallel rank and every `specdec run`. The same float32 tensors saved as safetensors (with
the config and tokenizer files) load in about a second. The first float32 load of a GGUF file
writes such a copy; later loads read it.

Where: ``$SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``) ``/gguf/<file stem>-<key>``, where the
key hashes the file's resolved path, size and modification time and the transformers version, so
a changed file or another dequantizer never reuses a stale copy. The copy holds the dequantized
tensors bit for bit (tests compare them). ``SPECDEC_GGUF_CACHE=0`` turns the cache off; a cache
that cannot be written is skipped with a warning and the GGUF file is used as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from specdec.paths import CACHE_DIR_ENV, cache_dir

SWITCH_ENV = "SPECDEC_GGUF_CACHE"
COMPLETE_MARKER = "specdec-converted.json"  # written last: a copy without it is unfinished
# 2: a standard checkpoint (a tied head stored as the input embedding, as other engines read it);
# copies of an older layout get a new key and are rewritten.
COPY_FORMAT = 2


def cache_root() -> Path | None:
    """The cache folder, or None when ``SPECDEC_GGUF_CACHE`` turns the cache off."""
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return cache_dir() / "gguf"


def _identity(gguf: Path) -> dict:
    import transformers

    st = gguf.stat()
    return {
        "gguf": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "transformers": transformers.__version__,
        "format": COPY_FORMAT,
    }


def converted_dir(gguf: Path) -> Path | None:
    """Where the converted copy of ``gguf`` lives (whether or not it exists yet)."""
    root = cache_root()
    if root is None:
        return None
    key = hashlib.sha256(json.dumps(_identity(gguf), sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{gguf.stem}-{key}"


def find_converted(gguf: Path) -> Path | None:
    """The finished converted copy of ``gguf``, or None."""
    folder = converted_dir(gguf)
    return folder if folder is not None and (folder / COMPLETE_MARKER).is_file() else None


def standard_weights(model) -> dict:
    """The model's tensors as a Hugging Face checkpoint stores them: a head tied to the input
    embedding is stored once, as ``model.embed_tokens.weight`` (from_pretrained re-ties it, and
    engines that read checkpoints themselves, vLLM among them, find the embedding there)."""
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def write_converted(gguf: Path, model, tokenizer) -> Path | None:
    """Save ``model`` (loaded from ``gguf`` in float32, on the CPU, unsharded) and ``tokenizer`` as
    the converted copy; atomic (written aside, then renamed), so concurrent loaders never see half a
    copy. Returns the folder, or None (with a warning) when it cannot be written."""
    from safetensors.torch import save_file

    folder = converted_dir(gguf)
    if folder is None:
        return None
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.mkdir(parents=True)
        save_file(standard_weights(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)  # the copy is plain float32, not a GGUF
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({**_identity(gguf), "written": time.time()}, indent=2))
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / COMPLETE_MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same copy first
        return folder
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"[specdec] could not keep a converted copy of {gguf.name} in {folder.parent} ({exc}); "
            f"later loads will dequantize the GGUF again (set {CACHE_DIR_ENV} to a writable folder, "
            f"or {SWITCH_ENV}=0 to silence this)",
            file=sys.stderr,
            flush=True,
        )
        return None
