"""kelastic local images (image → interpreter) and mount-path relocation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kelastic.localcluster.kubelet.images import ImageMap, mount_table, parse_image_option, relocate


def test_parse_image_option() -> None:
    assert parse_image_option(f"torch:2={sys.executable}") == ("torch:2", sys.executable)
    with pytest.raises(ValueError, match="expected NAME=PYTHON"):
        parse_image_option("torch:2")
    with pytest.raises(ValueError, match="not an executable interpreter"):
        parse_image_option("torch:2=/nonexistent/python")


def test_a_mapped_image_runs_its_interpreter_and_scripts(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    tool = bin_dir / "tool"
    for exe in (python, tool):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    images = ImageMap({"torch:2": str(python)})
    mapped = {"image": "torch:2", "command": ["python3", "train.py"]}
    # argv as the default environment resolved it: argv[0] is taken from the container again.
    assert images.resolve(mapped, [sys.executable, "train.py"], {}) == [str(python), "train.py"]
    assert images.resolve({"image": "torch:2", "args": ["tool", "-x"]}, ["tool", "-x"], {}) == [
        str(tool),
        "-x",
    ]
    assert images.resolve({"image": "torch:2", "command": ["/bin/sh"]}, ["/bin/sh"], {}) == ["/bin/sh"]
    env = images.environment(mapped, {"PATH": "/usr/bin"})
    assert env["PATH"] == os.pathsep.join([str(bin_dir), "/usr/bin"])
    # Images that are not mapped keep the default.
    other = {"image": "busybox", "command": ["python"]}
    assert images.resolve(other, [sys.executable], {}) == [sys.executable]
    assert images.environment(other, {"PATH": "/usr/bin"}) == {"PATH": "/usr/bin"}


def test_relocate_replaces_mount_paths_where_a_path_starts() -> None:
    table = {"/data": "/host/vol", "/data/sub": "/host/other", "/opt/agent": "/host/agent"}
    assert relocate("/data", table) == "/host/vol"
    assert relocate("/data/x/y", table) == "/host/vol/x/y"
    assert relocate("/data/sub/z", table) == "/host/other/z"  # the longer mount path wins
    assert relocate("--checkpoint-dir=/data/{run_id}", table) == "--checkpoint-dir=/host/vol/{run_id}"
    assert relocate("/opt/agent/lib:/data", table) == "/host/agent/lib:/host/vol"
    assert relocate("/database", table) == "/database"  # a longer name is not the mount
    assert relocate("x/data", table) == "x/data"  # not at the start of a path
    assert relocate("/data", {}) == "/data"


def test_mount_table_lists_relocated_kinds_and_keeps_hostpaths(tmp_path: Path) -> None:
    pod = {
        "spec": {
            "volumes": [
                {"name": "agent", "emptyDir": {}},
                {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "host", "hostPath": {"path": "/data/shared"}},
            ]
        }
    }
    container = {
        "volumeMounts": [
            {"name": "agent", "mountPath": "/kelastic-agent"},
            {"name": "ckpt", "mountPath": "/data/", "subPath": "run"},
            {"name": "host", "mountPath": "/data/shared"},
        ]
    }
    volumes = {"agent": tmp_path / "a", "ckpt": tmp_path / "c", "host": Path("/data/shared")}
    table = mount_table(pod, container, volumes)
    assert table == {
        "/kelastic-agent": str(tmp_path / "a"),
        "/data": str(tmp_path / "c" / "run"),
        "/data/shared": "/data/shared",  # a hostPath inside a relocated mount stays where it is
    }
    assert relocate("/data/shared/x", table) == "/data/shared/x"
    assert relocate("/data/y", table) == f"{tmp_path / 'c' / 'run'}/y"


def test_relocate_argv_keeps_the_resolved_interpreter_and_moves_the_containers_paths() -> None:
    from kelastic.localcluster.kubelet.images import relocate_argv

    table = {"/tmp": "/data/pod/volumes/tmp"}
    resolved = ["/tmp/venv/bin/python", "/tmp/x", "--out=/tmp/y"]
    assert relocate_argv(resolved, "python", table) == [
        "/tmp/venv/bin/python",
        "/data/pod/volumes/tmp/x",
        "--out=/data/pod/volumes/tmp/y",
    ]
    # the container's own absolute command is its path, inside the volume
    assert relocate_argv(["/tmp/run.sh"], "/tmp/run.sh", table) == ["/data/pod/volumes/tmp/run.sh"]
    assert relocate_argv([], "python", table) == []
