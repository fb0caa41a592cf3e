"""Every setup path installs torch the same way: first, with the same pin, and with PyTorch's
CPU wheel index offered for CPU-only machines (the plain pin takes the CUDA build from the
public package index).

The paths: the README's install commands, ``make install`` (with and without
``TORCH_PIP_ARGS``), CI's ``.ci/run`` and the Dockerfile's build notes.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_PIN = re.compile(r"torch==(\d+\.\d+\.\d+)")


def pip_installs(text: str) -> list[list[str]]:
    """The ``pip install`` command lines of a text, as argument lists (continuations joined)."""
    joined = text.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if "pip install" in line and not line.startswith(("RUN", "#")):
            found.append(shlex.split(line))
        elif line.startswith("RUN") and "pip install" in line:
            found.append(shlex.split(line[3:].split("&&")[0]))
    return found


def torch_pins(commands: list[list[str]]) -> list[str]:
    return [m.group(1) for cmd in commands for arg in cmd if (m := _PIN.fullmatch(arg))]


def readme_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    install = text[text.index("## Install") : text.index("## Run the example job")]
    return re.findall(r"```bash\n(.*?)```", install, flags=re.S)


def make_install(*args: str) -> list[list[str]]:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "install", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return pip_installs(out)


def test_readme_installs_torch_first_pinned_on_both_kinds_of_machine() -> None:
    blocks = readme_blocks()
    assert len(blocks) == 2, "one block for a GPU machine, one for a CPU-only machine"
    gpu, cpu = (pip_installs(b) for b in blocks)
    for commands in (gpu, cpu):
        assert torch_pins(commands[:1]) and torch_pins(commands) == torch_pins(gpu)[:1]
        assert commands[-1][-2:] == ["-e", ".[local,dev]"], (
            "the README installs the local cluster (the local extra) and the tools"
        )
    assert "--index-url" not in gpu[0], "the GPU path takes the CUDA build of the public index"
    assert cpu[0][cpu[0].index("--index-url") + 1] == CPU_INDEX


def test_readme_does_not_promise_the_cpu_build_from_the_plain_pin() -> None:
    text = (REPO / "README.md").read_text()
    assert "installs the CPU build" not in text


def test_every_setup_path_pins_the_same_torch() -> None:
    readme = torch_pins(pip_installs("\n".join(readme_blocks())))
    make = torch_pins(make_install())
    ci = torch_pins(pip_installs((REPO / ".ci" / "run").read_text()))
    docker = re.search(r"^ARG TORCH_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), flags=re.M)
    assert docker is not None
    assert set(readme) == set(make) == set(ci) == {docker.group(1)}


def test_make_install_takes_torch_first_and_passes_the_cpu_index_to_torch_only() -> None:
    plain = make_install()
    assert torch_pins(plain[:1]) and "--index-url" not in plain[0]
    cpu = make_install(f"TORCH_PIP_ARGS=--index-url {CPU_INDEX}")
    assert torch_pins(cpu[:1]) and cpu[0][cpu[0].index("--index-url") + 1] == CPU_INDEX
    assert all("--index-url" not in cmd for cmd in cpu[1:]), "kelastic itself comes from the usual index"


def test_ci_and_dockerfile_name_the_cpu_index_and_ci_says_why_it_keeps_the_plain_pin() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert CPU_INDEX in ci and "not" in ci and "reachable" in ci
    assert all("--index-url" not in cmd for cmd in pip_installs(ci)), "CI reaches only the package index"
    assert f'TORCH_PIP_ARGS="--index-url {CPU_INDEX}"' in (REPO / "Dockerfile").read_text()
