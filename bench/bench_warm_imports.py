"""Benchmark: a worker restart with and without the script's imports preloaded.

One ``kelastic-agent --standalone`` with one rank runs a script that imports torch and
some installed packages that torch does not (``--imports``, by default kopf, kubernetes,
networkx and IPython: about a second together on a quiet core) and then fails, so the
agent restarts it, ``--restarts`` times, before it succeeds. The script writes the time
it is done importing and the time it exits; a restart costs the time from one worker's
exit to the next worker being done importing (the agent noticing the failure, the
rendezvous round, the worker start and its imports). Three ways:

1. ``cold``: no ``--warm-start``, every worker a fresh ``python``;
2. ``torch``: ``--warm-start --warm-imports torch``, workers forked from a server that
   imported torch only;
3. ``script``: ``--warm-start`` (``--warm-imports script``, the default), workers forked
   from a server that also imported the script's packages.

Run: python bench/bench_warm_imports.py [--restarts 5] [--imports kopf,networkx] [--modes torch,script]
Prints the medians; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The training script, after its ``import`` lines: stamps, then fails until the last run.
BODY = """
import os, sys, time
ready = time.time()
out = os.environ["BENCH_OUT"]
runs = len(os.listdir(out))
with open(os.path.join(out, f"run_{runs:03d}"), "w") as f:
    f.write(f"{ready} {time.time()}\\n")
sys.exit(0 if runs >= int(os.environ["BENCH_RESTARTS"]) else 1)
"""

MODES = {
    "cold": [],
    "torch": ["--warm-start", "--warm-imports", "torch"],
    "script": ["--warm-start", "--warm-imports", "script"],
}


def measure(mode: str, imports: list[str], restarts: int) -> list[float]:
    """The seconds of each restart of one agent run in ``mode``."""
    with tempfile.TemporaryDirectory(prefix="bench_warm_imports_") as tmp:
        script, out = Path(tmp) / "train.py", Path(tmp) / "runs"
        out.mkdir()
        script.write_text("import torch\n" + "".join(f"import {m}\n" for m in imports) + BODY)
        env = {**os.environ, "BENCH_OUT": str(out), "BENCH_RESTARTS": str(restarts)}
        cmd = [sys.executable, "-m", "kelastic.agent", "--standalone", "--max-restarts", str(restarts)]
        proc = subprocess.run(
            [*cmd, *MODES[mode], str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp
        )
        if proc.returncode != 0:
            raise SystemExit(f"the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        stamps = [tuple(map(float, p.read_text().split())) for p in sorted(out.iterdir())]
    return [stamps[i + 1][0] - stamps[i][1] for i in range(len(stamps) - 1)]


def import_seconds(imports: list[str]) -> float:
    """What the imports cost a fresh interpreter that has already imported torch."""
    code = (
        "import time, torch, torch.distributed, torch._dynamo\nt = time.perf_counter()\n"
        + "".join(f"import {m}\n" for m in imports)
        + "print(time.perf_counter() - t)"
    )
    return float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--restarts", type=int, default=5, help="worker restarts per agent run (default 5)")
    p.add_argument("--imports", default="kopf,kubernetes,networkx,IPython", help="the script's imports")
    p.add_argument("--modes", default="cold,torch,script", help="which of cold,torch,script (default all)")
    args = p.parse_args()
    imports = [m for m in args.imports.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    print(f"the script imports {', '.join(imports)}: {import_seconds(imports):.2f} s after torch", flush=True)
    for mode in modes:
        began = time.monotonic()
        seconds = measure(mode, imports, args.restarts)
        shown = " ".join(f"{s:.2f}" for s in seconds)
        print(
            f"{mode:>6}: restart median {statistics.median(seconds):.2f} s "
            f"(min {min(seconds):.2f}; {shown}); the run took {time.monotonic() - began:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
