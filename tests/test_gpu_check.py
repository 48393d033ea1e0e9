"""tools/gpu-check.sh, rehearsed on the CPU (it waits for a GPU to be lent): it runs end to end
with the shipped draft, both engines on the invariant torch backend, and reports every level; and
the sharded pass over three ranks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_the_cpu_and_reports_each_level():
    run = subprocess.run(
        [str(ROOT / "tools" / "gpu-check.sh"), "--device", "cpu", "--levels", "1,2", "--tokens", "4", "--tp", "3"],
        check=False,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "target pass backend torch-invariant" in out and "draft pass backend torch-invariant" in out, out
    assert "equals transformers' generate on" in out
    for level in (1, 2):
        for mode in ("target-only", "speculative"):
            line = next(x for x in out.splitlines() if f"{level:>3} streams {mode}" in x)
            # greedy: alone, together and with speculation, the same tokens (the backend is invariant)
            assert f"0 of {level} differ from alone, 0 from target-only's greedy" in line, line
        assert f"target pass of {level:>3} decode rows" in out
        assert f"TP=3 pass of {level:>3} decode rows" in out
    # the sharded pass (three gloo ranks here, NCCL on GPUs): invariant, rows alike alone and together
    assert "TP=3 pass backend torch-invariant" in out and "8 of 8 sequences the same bits alone and together" in out
