"""The few-row product kernel (specdec/modeling/kernels/fewrow.c): x [n, in] @ w [out, in]^T.

Why: the lean pass multiplies every weight of the target by k + 1 rows, and on the AMD EPYC this
project was measured on, MKL's products of 3 and 4 rows took far longer than of 2 rows although
they read the same weights. This kernel streams each weight row once for all the rows, so a
verify of a few proposals costs about what one target token costs; it matches MKL on the
target's 1-2-row products and beats it on a draft's small matrices. It takes any number of rows
(tiles of 8, weights blocked for L2), and each row's sum is computed the same way whatever n is:
a row's product never depends on the rows beside it (batch invariance). The figures are in
docs/performance.md.

The same library runs the decoder layers of a pass in one call (``fewrow_batch``: the norms,
rotary, cache writes, attention, residuals and SiLU as loops around these products), since what
a few-row pass spent outside its products was a score of small torch operations per layer, each
with a fixed cost -- for one sequence or for the ragged rows of several, each with its own cache
(continuous batching, docs/batching.md). Each row is computed on its own, so a block's logits
equal bit for bit those of one-row passes and a sequence's logits do not depend on what shares
its pass. ``SPECDEC_FEWROW_LAYERS=0`` keeps the layers in torch (the products stay here).

The C source is compiled on first use with the system C compiler into the specdec cache
(``$SPECDEC_CACHE_DIR``, default ``~/.cache/specdec``, ``/kernels``) and loaded with ctypes; the
call releases the GIL and runs on the OpenMP runtime torch already loaded (same team size as torch).
Where it cannot run -- not x86-64 Linux with AVX-512F, no compiler, a failed build, or
``SPECDEC_FEWROW_KERNEL=0`` -- :func:`few_row_product` returns None and callers keep torch's product;
:func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from specdec.paths import cache_dir, check_private_file, private_dir

SOURCE = Path(__file__).parent / "kernels" / "fewrow.c"
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]
SWITCH_ENV = "SPECDEC_FEWROW_KERNEL"
LAYERS_SWITCH_ENV = "SPECDEC_FEWROW_LAYERS"  # 0: the decoder layers in torch (the products stay here)
ROWS = (1, 2, 3, 4)  # the row counts the lean pass sends here (see the module docstring)

_lock = threading.Lock()
_state: dict = {}  # "function" or "reason", filled once


def _cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def kernel_dir() -> Path:
    return cache_dir() / "kernels"


def _build(compiler: str) -> Path:
    """The compiled library, built once per source, flags and compiler (atomically: processes
    starting together each build a private file and rename it into place).

    Loading a shared object runs its code, so the cache is trusted only as far as it is private:
    the directory is this user's with mode 0700, the library is named by the hash of what built
    it, and a manifest beside it holds the library's own SHA-256, checked before every load; a
    library that fails a check is rebuilt, one in a directory others can write is never loaded."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    directory = private_dir(kernel_dir())
    target = directory / f"fewrow-{key}.so"
    if _verified(target):
        return target
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    started = time.monotonic()
    result = subprocess.run(
        [compiler, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
    tmp.chmod(0o700)
    manifest = _manifest(target)
    manifest_tmp = manifest.with_name(f".{manifest.name}.{uuid.uuid4().hex}.tmp")
    manifest_tmp.write_text(_sha256(tmp))
    tmp.replace(target)
    manifest_tmp.replace(manifest)
    print(
        f"[specdec] compiled the few-row product kernel into {target} in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    if not _verified(target):  # another process replaced it meanwhile with a different build
        raise RuntimeError(f"{target} changed while it was being built; not loaded")
    return target


def _manifest(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(library: Path) -> bool:
    """Whether ``library`` exists, is this user's, and matches its manifest."""
    manifest = _manifest(library)
    if not (library.exists() and manifest.exists()):
        return False
    check_private_file(library)
    check_private_file(manifest)
    return manifest.read_text().strip() == _sha256(library)


def _switched_off() -> bool:
    return os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def _load():
    if _switched_off():
        raise RuntimeError(f"turned off by {SWITCH_ENV}=0")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}")
    if not _cpu_has_avx512f():
        raise RuntimeError("the CPU has no AVX-512F")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    library = ctypes.CDLL(str(_build(compiler)))
    function = library.fewrow_mm
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    function.restype = ctypes.c_int
    bf16 = library.fewrow_mm_bf16
    bf16.argtypes = function.argtypes
    bf16.restype = ctypes.c_int
    _state["bf16"] = bf16
    batch = library.fewrow_batch
    batch.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_int64] * 4
        + [ctypes.c_float] * 2
        + [ctypes.c_void_p, ctypes.c_int]
    )
    batch.restype = ctypes.c_int
    scratch = library.fewrow_batch_scratch
    scratch.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_int64] * 5
    scratch.restype = ctypes.c_int64
    _state["layers"] = (batch, scratch)
    return function


def _function():
    if not _state:
        with _lock:
            if not _state:
                try:
                    _state["function"] = _load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    _state["reason"] = str(exc)
                    if not _switched_off():  # say once why passes run slower here (unless asked for)
                        print(
                            f"[specdec] few-row product kernel unavailable ({exc}); using torch's product",
                            file=sys.stderr,
                            flush=True,
                        )
    return _state.get("function")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    _function()
    return _state.get("reason")


class LayerWeights(ctypes.Structure):
    """One decoder layer's weights as the kernel reads them (kernels/fewrow.c: layer_weights)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "wqkv", "wo", "norm2", "wgu", "wdown")] + [
        ("bf16", ctypes.c_int32)
    ]  # 1: the four matrices are bfloat16 twins (see lossless_bf16)


class Segment(ctypes.Structure):
    """One sequence's part of a batched pass (kernels/fewrow.c: segment)."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("blocks", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("num_blocks", "block", "pool_blocks", "start", "rows")
    ]


def lossless_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of a float32 ``weight`` whose every value is a bfloat16 value (a draft
    shipped in bf16 and loaded as float32), else None. The kernel widens it back exactly, so
    products from the twin equal those from ``weight`` bit for bit, reading half the bytes."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
        return None
    flat = weight.reshape(-1)
    head = flat[:4096]
    if not torch.equal(head.bfloat16().float(), head):  # most float32 weights fail at once
        return None
    twin = weight.bfloat16()
    return twin if torch.equal(twin.float(), weight) else None


def layers_available() -> bool:
    """Whether :func:`batch_layers` runs here: the kernel loads and ``SPECDEC_FEWROW_LAYERS`` is not 0."""
    if os.environ.get(LAYERS_SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _function() is not None and "layers" in _state


def batch_layers(
    x: torch.Tensor,
    layers,
    keys: torch.Tensor,
    values: torch.Tensor,
    segments: list[tuple[torch.Tensor, int, int]],
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    scale: float,
) -> bool:
    """Run ``x`` [n, hidden] (float32, updated in place) through the decoder layers described by
    ``layers`` (a ctypes array of :class:`LayerWeights`) as ONE pass over several sequences whose
    KV lives in one paged pool, ``keys`` / ``values`` [layers, pool blocks, kv_heads, block,
    head_dim] (specdec.modeling.paged): ``segments`` lists, in the order of x's rows, each
    sequence's (block table, start, rows) -- its table (int64 block ids), the positions it has
    cached, and how many of x's rows are its new positions (written at [start, start + rows) of
    its blocks). ``cos`` / ``sin``: [n, head_dim], each row's rotary row. Each row attends to its
    own sequence only, and its values do not depend on the other sequences (see
    kernels/fewrow.c). False where the kernel declines (nothing was touched then). The kernel
    writes through raw pointers, so every shape, id and layout is checked here first."""
    if _function() is None or "layers" not in _state or not segments:
        return False
    n, hidden = x.shape if x.ndim == 2 else (0, 0)
    if (
        n < 1
        or sum(rows for _, _, rows in segments) != n
        or cos.shape != (n, head_dim)
        or sin.shape != (n, head_dim)
        or keys.ndim != 5
        or keys.shape[0] != len(layers)
        or keys.shape[2:] != (kv_heads, keys.shape[3], head_dim)
        or values.shape != keys.shape
        or any(
            t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
            for t in (x, cos, sin, keys, values)
        )
    ):
        return False
    pool_blocks, block = keys.shape[1], keys.shape[3]
    tables = [table for table, _, _ in segments]
    if any(t.ndim != 1 or t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous() for t in tables):
        return False
    ids = torch.cat(tables)  # every block id in range, checked at once
    if not ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= pool_blocks:
        return False
    array = (Segment * len(segments))()
    for slot, (table, start, rows) in zip(array, segments, strict=True):
        if rows < 1 or start < 0 or start + rows > table.shape[0] * block:
            return False
        slot.keys, slot.values, slot.blocks = keys.data_ptr(), values.data_ptr(), table.data_ptr()
        slot.num_blocks, slot.block, slot.pool_blocks = table.shape[0], block, pool_blocks
        slot.start, slot.rows = start, rows
    run, scratch_floats = _state["layers"]
    size = scratch_floats(ctypes.addressof(array), len(segments), hidden, heads, kv_heads, head_dim, intermediate)
    scratch = torch.empty(size, dtype=torch.float32)
    status = run(
        x.data_ptr(),
        hidden,
        ctypes.addressof(layers),
        len(layers),
        ctypes.addressof(array),
        len(segments),
        cos.data_ptr(),
        sin.data_ptr(),
        heads,
        kv_heads,
        head_dim,
        intermediate,
        eps,
        scale,
        scratch.data_ptr(),
        torch.get_num_threads(),
    )
    return status == 0


def few_row_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` as a new [n, out] tensor for n >= 1 float32 rows on the CPU (``weight``
    float32, or bfloat16: see :func:`lossless_bf16`), or None where the kernel does not cover the
    call (the caller then uses torch). Row i of the result depends on row i of x and the weight
    only, never on n or the other rows (the batch invariance of kernels/fewrow.c)."""
    if (
        x.ndim != 2
        or weight.ndim != 2
        or x.shape[0] < 1
        or x.shape[1] != weight.shape[1]
        or x.shape[1] % 16
        or x.dtype != torch.float32
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):  # no autograd here
        return None
    function = _function()
    if function is None:
        return None
    x = x.contiguous()
    if not weight.is_contiguous():
        return None
    n, width = x.shape
    y = torch.empty(n, weight.shape[0], dtype=torch.float32)
    if weight.dtype == torch.bfloat16:
        function = _state["bf16"]
    if function(weight.data_ptr(), x.data_ptr(), y.data_ptr(), weight.shape[0], width, n, torch.get_num_threads()):
        return None
    return y
