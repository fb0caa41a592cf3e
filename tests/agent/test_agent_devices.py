"""Counting GPUs without initialising CUDA, and the warm start's refusal to fork a process
that did (kelastic.agent.devices, kelastic.agent.warm).

On a CPU build of torch CUDA can never be initialised, so what these tests can show here
is the pure rules, that counting leaves CUDA alone, and that a process with the CUDA
driver mapped (a stand-in library under the driver's file name, loaded for real) gets a
fresh fork server instead of a fork of itself. tests/gpu/ checks the same on GPUs.
"""

from __future__ import annotations

import _bisect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent import devices
from kelastic.agent.cli import parse_nproc_per_node


@pytest.mark.parametrize(
    ("visible", "physical", "expected"),
    [
        (None, 4, 4),  # unset: every device
        ("", 4, 0),  # empty: none
        ("0,1", 4, 2),
        ("3", 4, 1),
        ("1,3,2", 4, 3),
        ("2,7,1", 4, 1),  # the list stops at the first ordinal the node lacks
        ("1gpu,2x", 4, 2),  # strtoul: the leading digits count
        ("0,-1,2", 4, 1),  # a negative entry ends the list
        ("0,foo,2", 4, 1),  # so does an unparsable one
        ("0,1,0", 4, 0),  # a repeated ordinal hides every device
        (" 0 , 1 ", 4, 2),
        ("0", 0, 0),  # no GPU at all
        ("GPU-6a1f0c3e-1111-2222-3333-444455556666", 4, None),  # UUIDs: NVML must say
        ("MIG-0a1b", 4, None),
    ],
)
def test_visible_count_follows_cuda_rules(visible: str | None, physical: int, expected: int | None) -> None:
    assert devices.visible_count(visible, physical) == expected


def test_the_driver_is_recognised_in_proc_maps_and_the_runtime_alone_is_not() -> None:
    runtime = "7f00-7f10 r-xp 00000000 08:01 42 /usr/local/lib/python3/site-packages/nvidia/libcudart.so.12\n"
    driver = "7f20-7f30 r-xp 00000000 08:01 43 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
    anon = "7f40-7f50 rw-p 00000000 00:00 0 \n"
    assert not devices.maps_load_cuda_driver(runtime + anon)
    assert devices.maps_load_cuda_driver(runtime + driver + anon)
    assert devices.maps_load_cuda_driver("7f-8f r-xp 0 0:0 1 /lib/libcuda.so.1")


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.slow
def test_counting_devices_for_nproc_per_node_leaves_cuda_uninitialised() -> None:
    done = _python(
        "import json, torch; from kelastic.agent import devices;"
        "from kelastic.agent.cli import parse_nproc_per_node as p;"
        "n = p('auto');"
        "print(json.dumps([n, devices.cuda_device_count(), torch.cuda.is_initialized(), devices.cuda_touched()]))"
    )
    assert done.returncode == 0, done.stderr
    nproc, gpus, initialized, touched = json.loads(done.stdout.splitlines()[-1])
    assert (initialized, touched) == (False, False)
    # auto: one worker per GPU where there are GPUs, else one per CPU
    assert nproc == (gpus if gpus > 0 else os.cpu_count())


@pytest.mark.slow
def test_nproc_per_node_gpu_without_cuda_says_so() -> None:
    if devices.cuda_device_count() > 0:
        pytest.skip("this machine has CUDA devices")
    with pytest.raises(ValueError, match="--nproc-per-node gpu: CUDA is not available on this node"):
        parse_nproc_per_node("gpu")


_FORK = (
    "import ctypes, json, logging, sys; logging.basicConfig(level=logging.INFO);"
    "from kelastic.agent import devices, warm;"
    "[ctypes.CDLL(p) for p in sys.argv[1:]];"
    "touched = devices.cuda_touched();"
    "forked = warm.fork_forkserver(('torch',), here=('torch',));"
    "print(json.dumps([touched, forked]))"
)


@pytest.mark.slow
def test_warm_start_forks_the_agent_unless_cuda_was_initialised_in_it(tmp_path: Path) -> None:
    # A real library loaded under the CUDA driver's file name maps into the process as
    # libcuda does once CUDA is initialised (this one is only an extension of Python's).
    fake_driver = tmp_path / "libcuda.so.1"
    shutil.copyfile(_bisect.__file__, fake_driver)
    clean = subprocess.run(
        [sys.executable, "-c", _FORK], capture_output=True, text=True, timeout=180, check=False
    )
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout.splitlines()[-1]) == [False, True]
    poisoned = subprocess.run(
        [sys.executable, "-c", _FORK, str(fake_driver)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert poisoned.returncode == 0, poisoned.stderr
    assert json.loads(poisoned.stdout.splitlines()[-1]) == [True, False]
    assert "starting a fresh fork server: CUDA was initialised in this process" in poisoned.stderr
