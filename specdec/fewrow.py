"""The few-row product kernel (specdec/kernels/fewrow.c): x [n, in] @ w [out, in]^T for n = 1..4.

Why: the lean pass multiplies every weight of the target by k + 1 rows. On the AMD EPYC this
project runs on, MKL's products of 3 and 4 rows took ~40% longer than of 2 rows although they read
the same weights (SmolLM2's 121 products of one pass, its real weights, medians of 7 rounds: MKL
17.1-18.0 ms for 2 rows, 25.0-28.2 / 25.5-26.9 ms for 3 / 4; this kernel 18.8-20.0 / 20.5-23.3 ms).
A whole verify of k = 2 then costs what k = 1 does (23-24 ms in process, was 30-37 ms), and k = 3
~30 ms (was 34-44). For 1-2 rows of the target it matches MKL's weight @ x^T (17.3 vs 17.2-18.1 ms
per pass); for a draft's small matrices on its one thread it is 2-3x faster than MKL (the shipped
draft's 8192-token head 397 -> 125 us, its 1024x256 MLP product 53 -> 21 us), so every product of
1-4 rows comes here and 5 or more (prefill) stay with MKL.

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

SOURCE = Path(__file__).parent / "kernels" / "fewrow.c"
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]
SWITCH_ENV = "SPECDEC_FEWROW_KERNEL"
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
    base = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(base) / "kernels"


def _build(compiler: str) -> Path:
    """The compiled library, built once per source, flags and compiler (atomically: processes
    starting together each build a private file and rename it into place)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = kernel_dir() / f"fewrow-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    started = time.monotonic()
    result = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
    tmp.replace(target)
    print(f"[specdec] compiled the few-row product kernel into {target} in {time.monotonic() - started:.1f}s",
          file=sys.stderr, flush=True)
    return target


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
                        print(f"[specdec] few-row product kernel unavailable ({exc}); using torch's product",
                              file=sys.stderr, flush=True)
    return _state.get("function")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    _function()
    return _state.get("reason")


def few_row_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` as a new [n, out] tensor for 1 <= n <= 4 float32 rows on the CPU, or None
    where the kernel does not cover the call (the caller then uses torch)."""
    if (x.ndim != 2 or weight.ndim != 2 or not 1 <= x.shape[0] <= 4 or x.shape[1] != weight.shape[1]
            or x.shape[1] % 16 or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # no autograd here
        return None
    function = _function()
    if function is None:
        return None
    x = x.contiguous()
    if not weight.is_contiguous():
        return None
    n, width = x.shape
    y = torch.empty(n, weight.shape[0], dtype=torch.float32)
    if function(weight.data_ptr(), x.data_ptr(), y.data_ptr(), weight.shape[0], width, n, torch.get_num_threads()):
        return None
    return y
