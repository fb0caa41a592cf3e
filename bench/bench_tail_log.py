"""Benchmark: kelastic's TailLog against torch.distributed.elastic's TailLog.

8 rank processes write 200,000 lines each to their log files while both tailers —
each in its own process, started before the files exist — tail the *same* files to
their stdout, a pipe read by a small "console" process per tailer (what a pod's
runtime sees), which saves the bytes to a file and when each chunk arrived. Two phases:

1. burst:  the ranks write as fast as they can (lines/s, CPU s, delays under backlog);
2. steady: the ranks write at a fixed total rate (the delay a user actually sees).

Each line carries its write time (CLOCK_MONOTONIC, shared by all processes); its
write→console delay is the time its chunk reached the console minus that; lines/s counts from
the first line written to the last line delivered. CPU seconds are the tailer process's
own user+system time from just before start() to after stop().

Run: python bench/bench_tail_log.py [--lines 200000] [--ranks 8]
Prints figures; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def writer_main(path: str, count: int, rate: float) -> None:
    """A rank: write ``count`` lines ``"<i> <monotonic_ns>"``; ``rate`` lines/s (0 = burst).

    A burst writes blocks of 1,000 lines stamped with the block's write time, built with
    C-speed joins so the ranks outrun the tailers and the tailers are what is measured.
    """
    now = time.monotonic_ns
    with open(path, "w") as f:
        if rate <= 0:
            numbers = [str(i) for i in range(count)]
            for start in range(0, count, 1000):
                stamp = f" {now()}\n"
                f.write(stamp.join(numbers[start : start + 1000]) + stamp)
            return
        begin = time.monotonic()
        batch = 20
        for start in range(0, count, batch):
            for i in range(start, min(start + batch, count)):
                f.write(f"{i} {now()}\n")
            f.flush()
            ahead = begin + (start + batch) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


def tailer_main(kind: str, files_dir: str, ranks: int) -> None:
    """A tailer process: tail the rank files to stdout until stdin closes; report CPU on stderr."""
    files = {rank: os.path.join(files_dir, f"{rank}.log") for rank in range(ranks)}
    if kind == "kelastic":
        from kelastic.agent.multiprocessing import TailLog as Tail
    else:
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog as Tail
    tail = Tail("bench", files, sys.stdout)
    cpu0 = time.process_time()
    tail.start()
    sys.stdin.read()  # the bench closes our stdin once every rank has exited
    tail.stop()
    sys.stdout.flush()
    cpu = time.process_time() - cpu0
    sys.stderr.write(json.dumps({"cpu": cpu}) + "\n")


def receiver_main(out_path: str) -> None:
    """The console: read stdin, note when each chunk arrived; at EOF save data and arrival times."""
    chunks: list[tuple[int, bytes]] = []
    while True:
        data = os.read(0, 1 << 20)
        if not data:
            break
        chunks.append((time.monotonic_ns(), data))
    with open(out_path, "wb") as out:
        out.write(b"".join(data for _, data in chunks))
    with open(out_path + ".arrivals", "w") as index:
        json.dump([(arrived, len(data)) for arrived, data in chunks], index)


def analyse(out_path: Path) -> dict[str, float]:
    """Delays and throughput from a receiver's record; lines/s counts from the first line
    written to the last line delivered."""
    data = out_path.read_bytes()
    arrivals = json.loads(Path(str(out_path) + ".arrivals").read_text())
    delays: list[int] = []
    first_written = None
    last_ns = 0
    offset = 0
    line_start = 0
    for arrived, size in arrivals:
        offset += size
        cut = data.rfind(b"\n", line_start, offset)
        if cut < line_start:
            continue
        stamps = [int(line.rsplit(b" ", 1)[1]) for line in data[line_start:cut].split(b"\n")]
        line_start = cut + 1
        delays.extend(arrived - stamp for stamp in stamps)
        first = min(stamps)
        first_written = first if first_written is None else min(first_written, first)
        last_ns = arrived
    seconds = (last_ns - first_written) / 1e9 if first_written is not None else 0.0
    delays.sort()
    return {
        "lines": len(delays),
        "seconds": seconds,
        "lines_per_s": len(delays) / seconds if seconds > 0 else 0.0,
        "median_ms": statistics.median(delays) / 1e6 if delays else float("nan"),
        "p99_ms": delays[int(len(delays) * 0.99)] / 1e6 if delays else float("nan"),
    }


def run_phase(
    label: str, ranks: int, lines: int, rate_per_rank: float, workdir: Path
) -> dict[str, dict[str, float]]:
    files_dir = workdir / label
    files_dir.mkdir()
    me = str(Path(__file__).resolve())
    tailers = {}
    receivers = {}
    for kind in ("kelastic", "torch"):
        read_fd, write_fd = os.pipe()
        try:  # a 1 MiB pipe (default 64 KiB) so the console side limits neither tailer
            fcntl.fcntl(write_fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except OSError:
            pass
        receivers[kind] = subprocess.Popen(
            [sys.executable, me, "--receiver", str(workdir / f"{label}-{kind}.out")], stdin=read_fd
        )
        tailers[kind] = subprocess.Popen(
            [sys.executable, me, "--tailer", kind, "--dir", str(files_dir), "--ranks", str(ranks)],
            stdin=subprocess.PIPE,
            stdout=write_fd,
            stderr=subprocess.PIPE,
        )
        os.close(read_fd)
        os.close(write_fd)
    time.sleep(3.0)  # let both tailers import and start before the first line is written
    writers = [
        subprocess.Popen(
            [sys.executable, me, "--writer", str(files_dir / f"{r}.log"), str(lines), str(rate_per_rank)]
        )
        for r in range(ranks)
    ]
    for w in writers:
        if w.wait(120) != 0:
            raise SystemExit(f"a writer failed with code {w.returncode}")
    results = {}
    for proc in tailers.values():
        proc.stdin.close()
    for kind, proc in tailers.items():
        err = proc.stderr.read().decode()
        if proc.wait(120) != 0:
            raise SystemExit(f"{kind} tailer failed:\n{err}")
        if receivers[kind].wait(120) != 0:
            raise SystemExit(f"the receiver of the {kind} tailer failed")
        figures = analyse(workdir / f"{label}-{kind}.out")
        figures["cpu_s"] = json.loads(err.strip().splitlines()[-1])["cpu"]
        results[kind] = figures
    return results


def report(label: str, results: dict[str, dict[str, float]], expected: int) -> None:
    print(f"\n{label}")
    print(f"  {'tailer':<9} {'lines':>9} {'lines/s':>11} {'CPU s':>7} {'median delay':>13} {'p99 delay':>10}")
    for kind, r in results.items():
        complete = "" if r["lines"] == expected else f"  (expected {expected})"
        print(
            f"  {kind:<9} {r['lines']:>9} {r['lines_per_s']:>11,.0f} {r['cpu_s']:>7.2f}"
            f" {r['median_ms']:>10.1f} ms {r['p99_ms']:>7.0f} ms{complete}"
        )
    ours, theirs = results["kelastic"], results["torch"]
    print(
        f"  ratios kelastic/torch: throughput {ours['lines_per_s'] / theirs['lines_per_s']:.2f}x, "
        f"CPU {ours['cpu_s'] / theirs['cpu_s']:.2f}x, median delay {ours['median_ms'] / theirs['median_ms']:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=200_000, help="lines per rank in the burst phase")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steady-rate", type=float, default=40_000, help="total lines/s in the steady phase")
    parser.add_argument("--steady-seconds", type=float, default=5.0)
    parser.add_argument("--writer", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--tailer", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        writer_main(args.writer[0], int(args.writer[1]), float(args.writer[2]))
        return
    if args.receiver:
        receiver_main(args.receiver)
        return
    if args.tailer:
        tailer_main(args.tailer, args.dir, args.ranks)
        return
    with tempfile.TemporaryDirectory(prefix="kelastic-bench-tail-") as tmp:
        workdir = Path(tmp)
        print(
            f"TailLog benchmark: {args.ranks} ranks; both tailers on the same files in the same run; console = a pipe"
        )
        burst = run_phase("burst", args.ranks, args.lines, 0, workdir)
        report(
            f"burst: {args.ranks} x {args.lines:,} lines written as fast as possible",
            burst,
            args.ranks * args.lines,
        )
        per_rank = int(args.steady_rate * args.steady_seconds / args.ranks)
        steady = run_phase("steady", args.ranks, per_rank, args.steady_rate / args.ranks, workdir)
        report(
            f"steady: {args.ranks} x {per_rank:,} lines at {args.steady_rate:,.0f} lines/s in total",
            steady,
            args.ranks * per_rank,
        )


if __name__ == "__main__":
    main()
