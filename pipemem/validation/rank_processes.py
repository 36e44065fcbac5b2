"""Running a measuring module once per rank, as a launcher would: what the validate targets that
run a framework's own multi-process step on the CPU share (deepspeed, hf_trainer).

`run_ranks` writes the case to a file, starts `python -m MODULE CASE.json OUT_r.json` for each rank
with torchrun's environment (a gloo group on 127.0.0.1; none for a single process), waits for all
of them within one deadline, kills whatever is left, and returns every rank's JSON in rank order.
A rank that fails raises RuntimeError with the last lines of its stderr. `import_error` checks,
in a fresh interpreter, that the framework imports at all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def import_error(code: str, env: dict | None = None, timeout: float = 300) -> str | None:
    """None when `code` (imports, a check) runs in a fresh interpreter with `env` added to its
    environment, else why not: the last line of its error. In a fresh process, so that a library
    that sets itself up on import (DeepSpeed's accelerator) is checked as the ranks will see it."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not be checked ({type(e).__name__})"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, case: dict, world: int, timeout: float, env: dict, what: str) -> list[dict]:
    """`what` names the run in an error ("DeepSpeed case zero3", ...); `env` is added to each
    process's environment."""
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "case.json")
        with open(src, "w") as f:
            json.dump(case, f)
        procs = []
        for r in range(world):
            penv = dict(os.environ, OMP_NUM_THREADS="1", **env)
            if world > 1:
                penv.update(
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, src, os.path.join(d, f"rank{r}.json")],
                    env=penv,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline, errs = time.monotonic() + timeout, []
        try:
            for p in procs:
                errs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            r = bad[0]
            tail = "\n".join((errs[r] if r < len(errs) else "").strip().splitlines()[-8:])
            raise RuntimeError(f"{what} failed on rank {r} (exit {procs[r].returncode}):\n{tail}")
        out = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out
