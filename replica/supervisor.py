"""The supervisor of a tensor-parallel target: ``specdec target --tp N`` starts N rank processes
and watches them (the ranks themselves: ``specdec.engine.tensor_parallel``).

If any rank dies the supervisor tells rank 0 (SIGUSR1: health NOT_SERVING, deregister, stop at
once), kills the group and exits non-zero: a broken group never hangs a caller.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def supervise(argv: list[str], tp: int) -> int:
    """Start ``tp`` ranks of ``specdec target ... --tp N`` and watch them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(tp):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(tp),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SPECDEC_TP_RANK_PROCESS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, "-m", "specdec", *argv], env=env))
    print(f"[specdec] target: {tp} tensor-parallel ranks, pids {[p.pid for p in procs]}", file=sys.stderr, flush=True)

    stopping = {"flag": False}

    def forward(sig, _frame):
        stopping["flag"] = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, then tells the others to stop

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while True:
            dead = [(i, p) for i, p in enumerate(procs) if p.poll() is not None]
            if dead and (not stopping["flag"] or dead[0][0] != 0):
                if stopping["flag"] and all(p.poll() is not None for p in procs):
                    return max(p.returncode or 0 for p in procs)
                if not stopping["flag"]:
                    rank, proc = dead[0]
                    print(
                        f"[specdec] target: rank {rank} exited ({proc.returncode}); taking the group down",
                        file=sys.stderr,
                        flush=True,
                    )
                    if procs[0].poll() is None:
                        procs[0].send_signal(signal.SIGUSR1)  # NOT_SERVING + deregister, at once
                    deadline = time.monotonic() + 3.0
                    while procs[0].poll() is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    for p in procs:
                        p.wait()
                    return 1
            if stopping["flag"] and procs[0].poll() is not None:
                deadline = time.monotonic() + 10.0
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.1)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return procs[0].returncode or 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
