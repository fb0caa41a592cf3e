"""A process that ends while a daemon thread is blocked in a torch store call.

    python exit_probe.py sys|kelastic DELAY

A daemon thread waits in ``TCPStore.get`` (the GIL released); a helper process sets the
key DELAY seconds after the main thread started to exit, so the call returns while the
interpreter ends. ``sys`` ends with ``sys.exit(3)`` (CPython before 3.14 aborts then:
SIGABRT, ``terminate called without an active exception``), ``kelastic`` with
``kelastic.agent.process_exit.exit_process(3)``. An ``atexit`` callback prints a line,
and a line is left unflushed before the exit.
"""

from __future__ import annotations

import atexit
import datetime
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from kelastic.agent.process_exit import exit_process

mode, delay = sys.argv[1], float(sys.argv[2])
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
waiter = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=60))
# The helper is its own program, connected before the exit starts: a process forked from this
# one (a store server's threads, a thread inside torch) could block on a lock copied held.
WAKER = (
    "import datetime, sys, time\n"
    "import torch.distributed as dist\n"
    "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=5))\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read(1)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "s.set('wake', '1')\n"
)
waker = subprocess.Popen(
    [sys.executable, "-c", WAKER, str(server.port), str(delay)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
)
assert waker.stdout is not None and waker.stdout.readline() == b"ready\n"
waker.stdout.close()
started = threading.Event()


def blocked() -> None:
    started.set()
    waiter.get("wake")


threading.Thread(target=blocked, daemon=True).start()
started.wait()
time.sleep(0.2)
atexit.register(lambda: print("atexit ran", flush=True))
print("unflushed;", end="")
assert waker.stdin is not None
waker.stdin.write(b"x")
waker.stdin.flush()
if mode == "sys":
    sys.exit(3)
exit_process(3)
