"""The local cluster's Go builds (localcluster/controlplane/build.sh, localcluster/kueue/build.sh,
localcluster/node/build.sh) and what they share (localcluster/gobuild.sh), run as ``make`` runs
them, with stand-ins for the go command: a complete directory is reused without Go, a missing Go
and a version the module proxy refuses are named, a second build waits for the first and reuses
its result, and a build that succeeds leaves a complete directory with each step's environment
as the script asks. The builds themselves run in CI's control-plane, Kueue and real-node lanes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = REPO / "localcluster" / "controlplane" / "build.sh"
KUEUE = REPO / "localcluster" / "kueue" / "build.sh"
NODE = REPO / "localcluster" / "node" / "build.sh"
BUILDKIT = REPO / "localcluster" / "node" / "buildkit.sh"
NODE_PINS = "kubernetes v1.37.2 containerd v2.4.2 runc v1.5.3 cni-plugins v1.10.0 kube-router v2.1.0 pause"


def _installed(package: str) -> bool:
    if shutil.which("dpkg-query") is None:
        return False
    done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return "install ok installed" in done.stdout


#: node/build.sh stops before Go without runc's seccomp headers or gcc.
needs_node_tools = pytest.mark.skipif(
    not (_installed("libseccomp-dev") and shutil.which("gcc")),
    reason="node/build.sh needs gcc and libseccomp-dev before it asks for Go: apt-get install -y gcc libseccomp-dev",
)

#: A go command whose module proxy refuses every module.
REFUSING_GO = """#!/usr/bin/env bash
case "$1" in
    env) echo "/nowhere/$2" ;;
    *) echo "go: $REFUSED: reading https://proxy.example/x.info: 404 Not Found" >&2; exit 1 ;;
esac
"""


#: A go command whose every step succeeds: ``mod download -json`` answers with $FAKE_SRC (a
#: module holding what the scripts read: a go.mod with staging modules, pause.c, Kueue's CRDs),
#: ``build`` and ``install`` write a stand-in binary per package. Each call is recorded in
#: $FAKE_GO_CALLS with the GOFLAGS and CGO_ENABLED it saw.
BUILDING_GO = r"""#!/usr/bin/env bash
echo "GOFLAGS=${GOFLAGS:-}|CGO_ENABLED=${CGO_ENABLED:-}|$*" >>"$FAKE_GO_CALLS"
command=$1
shift
case "$command" in
    env) case "$1" in GOVERSION) echo go1.26.0 ;; GOPROXY) echo https://proxy.example ;; *) echo "/nowhere/$1" ;; esac ;;
    mod) printf '{\n\t"Info": "%s",\n\t"GoMod": "%s",\n\t"Dir": "%s",\n\t"Sum": "h1:x"\n}\n' \
            "$FAKE_SRC/info" "$FAKE_SRC/go.mod" "$FAKE_SRC" ;;
    list) ;;
    build|install)
        out= packages=()
        while [[ $# -gt 0 ]]; do
            case "$1" in
                -o) out=$2; shift 2 ;;
                -ldflags|-tags) shift 2 ;;
                -*) shift ;;
                *) packages+=("${1%@*}"); shift ;;
            esac
        done
        for package in "${packages[@]}"; do
            if [[ $command == install ]]; then target=$GOBIN/${package##*/}
            elif [[ $out == */ ]]; then target=$out${package##*/}
            else target=$out; fi
            printf '#!/bin/sh\necho "%s (stand-in)"\n' "${package##*/}" >"$target"
            chmod +x "$target"
        done ;;
esac
"""


def fake_source(root: Path) -> Path:
    """What ``go mod download`` would unpack, as far as the scripts read it."""
    (root / "build" / "pause" / "linux").mkdir(parents=True)
    (root / "build" / "pause" / "linux" / "pause.c").write_text("int main(void) { return 0; }\n")
    (root / "config" / "components" / "crd" / "bases").mkdir(parents=True)
    (root / "config" / "components" / "crd" / "bases" / "workloads.yaml").write_text("kind: CRD\n")
    (root / "config" / "components" / "webhook").mkdir(parents=True)
    (root / "config" / "components" / "webhook" / "manifests.yaml").write_text("kind: Webhook\n")
    (root / "go.mod").write_text(
        "module k8s.io/kubernetes\n\ngo 1.26.0\n\nreplace (\n"
        "\tk8s.io/api => ./staging/src/k8s.io/api\n\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n)\n"
    )
    (root / "info").write_text('{"Version": "v1.37.2", "Time": "2026-01-01T00:00:00Z"}\n')
    return root


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    fake = tmp_path / "go"
    fake.write_text(REFUSING_GO)
    fake.chmod(0o755)
    yield {
        **os.environ,
        "GO": str(fake),
        "KELASTIC_K8S_CACHE": str(tmp_path / "k8s"),
        "KELASTIC_KUEUE_CACHE": str(tmp_path / "kueue"),
        "KELASTIC_NODE_CACHE": str(tmp_path / "node"),
        "KELASTIC_BUILD_HEARTBEAT": "60",
        "K8S_VERSION": "v1.37.2",
        "ETCD_VERSION": "v3.7.3",
        "KUEUE_VERSION": "v0.17.0",
    }


def build(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def complete_control_plane(root: Path) -> Path:
    bin_dir = root / "v1.37.2" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / ".kelastic-complete").write_text("kubernetes v1.37.2 etcd v3.7.3\n")
    return bin_dir


def complete_kueue(root: Path) -> Path:
    dest = root / "v0.17.0"
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "kueue").write_text("#!/bin/sh\n")
    (dest / "bin" / "kueue").chmod(0o755)
    (dest / ".kelastic-complete").write_text("kueue v0.17.0\n")
    return dest


def complete_node(root: Path) -> Path:
    bin_dir = root / "v1.37.2" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / ".kelastic-complete").write_text(NODE_PINS + "\n")
    return bin_dir


def test_a_complete_build_is_reused_without_go(env: dict[str, str]) -> None:
    env["GO"] = "/nonexistent/go"
    cp = complete_control_plane(Path(env["KELASTIC_K8S_CACHE"]))
    kueue = complete_kueue(Path(env["KELASTIC_KUEUE_CACHE"]))
    node = complete_node(Path(env["KELASTIC_NODE_CACHE"]))
    for script, expected in ((CONTROL_PLANE, cp), (KUEUE, kueue), (NODE, node)):
        done = build(script, env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == str(expected) and done.stderr == ""


@pytest.mark.parametrize(
    ("script", "minimum"),
    [(CONTROL_PLANE, "1.26"), (KUEUE, "1.25"), pytest.param(NODE, "1.26", marks=needs_node_tools)],
)
def test_a_missing_go_is_named(env: dict[str, str], script: Path, minimum: str) -> None:
    env["GO"] = "/nonexistent/go"
    done = build(script, env)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no Go toolchain ('/nonexistent/go' is not on PATH); install Go {minimum} or newer" in done.stderr


def test_the_refused_module_and_version_are_named(env: dict[str, str]) -> None:
    env["REFUSED"] = "sigs.k8s.io/kueue@v0.17.0"
    done = build(KUEUE, env)
    assert done.returncode == 1 and done.stdout == ""
    assert "kueue build: ERROR: fetching sigs.k8s.io/kueue@v0.17.0 failed" in done.stderr
    assert "refused module sigs.k8s.io/kueue version v0.17.0 (404 Not Found)" in done.stderr
    root = Path(env["KELASTIC_KUEUE_CACHE"])
    assert not list(root.glob("partial.*/")) and not (root / "v0.17.0").exists()


@pytest.mark.parametrize(
    ("script", "name", "cache"),
    [
        (CONTROL_PLANE, "control-plane build", "KELASTIC_K8S_CACHE"),
        pytest.param(NODE, "node build", "KELASTIC_NODE_CACHE", marks=needs_node_tools),
    ],
)
def test_a_refused_kubernetes_module_is_named_and_the_work_kept(
    env: dict[str, str], script: Path, name: str, cache: str
) -> None:
    env["REFUSED"] = "k8s.io/kubernetes@v1.37.2"
    done = build(script, env)
    assert done.returncode == 1 and done.stdout == ""
    assert f"{name}: ERROR: fetching k8s.io/kubernetes@v1.37.2's go.mod failed" in done.stderr
    assert "refused module k8s.io/kubernetes version v1.37.2 (404 Not Found)" in done.stderr
    dest = Path(env[cache]) / "v1.37.2"
    kept = list(dest.glob("work.*"))
    assert len(kept) == 1 and f"the work directory stays for inspection: {kept[0]}" in done.stderr
    assert not list(dest.glob("bin.partial.*")) and not (dest / "bin").exists()


def test_a_second_build_waits_for_the_first_and_reuses_its_result(
    env: dict[str, str], tmp_path: Path
) -> None:
    root = Path(env["KELASTIC_KUEUE_CACHE"])
    root.mkdir()
    lock = root / ".v0.17.0.lock"
    holder = subprocess.Popen(
        ["flock", str(lock), "bash", "-c", "echo held; read -r _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.Popen(
            ["bash", str(KUEUE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert second.stderr is not None
        line = second.stderr.readline()
        assert "another build of Kueue v0.17.0 is running; waiting for it" in line, line
        dest = complete_kueue(root)  # what the first build leaves
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.splitlines()[-1] == str(dest)


def test_the_package_ships_the_build_scripts_and_what_they_share() -> None:
    """The scripts source localcluster/gobuild.sh: a wheel holds all five or none works."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {Path(folder): name for name, folder in setuptools["package-dir"].items()}
    data = setuptools["package-data"]
    for script in (CONTROL_PLANE, KUEUE, NODE, BUILDKIT, REPO / "localcluster" / "gobuild.sh"):
        rel = script.relative_to(REPO)
        package = (
            f"{folders[Path('localcluster')]}." + ".".join(rel.parent.parts[1:])
            if rel.parent.parts[1:]
            else "kelastic.localcluster"
        )
        assert package in setuptools["packages"], package
        assert any(fnmatch(script.name, pattern) for pattern in data.get(package, [])), (package, script.name)
    for script in (CONTROL_PLANE, KUEUE, NODE, BUILDKIT):
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/../gobuild.sh"' in script.read_text()


@pytest.fixture
def building(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "building-go"
    fake.write_text(BUILDING_GO)
    fake.chmod(0o755)
    env.update(
        GO=str(fake), FAKE_SRC=str(fake_source(tmp_path / "src")), FAKE_GO_CALLS=str(tmp_path / "calls")
    )
    return env


def calls(env: dict[str, str], *words: str) -> list[str]:
    """The recorded go calls whose arguments hold every one of ``words``."""
    lines = Path(env["FAKE_GO_CALLS"]).read_text().splitlines()
    return [line for line in lines if all(word in line.split("|", 2)[2] for word in words)]


def assert_published(done: subprocess.CompletedProcess[str], dest: Path, marker: Path, want: str) -> None:
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(dest)
    assert marker.read_text() == want + "\n"
    assert not [p.name for p in dest.parent.iterdir() if "partial" in p.name or p.name.startswith("work.")]


@needs_node_tools
def test_a_node_build_gives_each_step_its_own_environment_and_publishes_whole(
    building: dict[str, str],
) -> None:
    done = build(NODE, building)
    bin_dir = Path(building["KELASTIC_NODE_CACHE"]) / "v1.37.2" / "bin"
    assert_published(done, bin_dir, bin_dir / ".kelastic-complete", NODE_PINS)
    for binary in ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc",
                   "kube-router", "pause", "cni/bridge", "cni/host-local", "cni/loopback", "cni/portmap"):  # fmt: skip
        assert os.access(bin_dir / binary, os.X_OK), binary
    # The throwaway Kubernetes module's steps write its go.sum (-mod=mod); the kubelet is static.
    for line in calls(building, "k8s.io/kubernetes"):
        assert "-mod=mod" in line.split("|")[0], line
    (kubelet,) = calls(building, "build", "cmd/kubelet")
    assert "CGO_ENABLED=0|" in kubelet and "-X k8s.io/component-base/version.gitMinor=37" in kubelet
    # runc is cgo with seccomp; the go installs run outside the throwaway module.
    (runc,) = calls(building, "install", "opencontainers/runc@v1.5.3")
    assert runc.startswith("GOFLAGS=|CGO_ENABLED=1|") and "-tags seccomp" in runc
    assert "node build:   done at" in done.stderr and "2 staging modules pinned to v0.37.2" in done.stderr


def test_the_control_plane_and_kueue_builds_publish_whole(building: dict[str, str]) -> None:
    done = build(CONTROL_PLANE, building)
    bin_dir = Path(building["KELASTIC_K8S_CACHE"]) / "v1.37.2" / "bin"
    assert_published(done, bin_dir, bin_dir / ".kelastic-complete", "kubernetes v1.37.2 etcd v3.7.3")
    assert sorted(p.name for p in bin_dir.iterdir() if not p.name.startswith(".")) == [
        "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
    ]  # fmt: skip
    (apiserver,) = calls(building, "build", "cmd/kube-apiserver")
    assert "-mod=mod" in apiserver and "CGO_ENABLED=0|" in apiserver
    assert "-X k8s.io/component-base/version.buildDate=2026-01-01T00:00:00Z" in apiserver

    done = build(KUEUE, building)
    dest = Path(building["KELASTIC_KUEUE_CACHE"]) / "v0.17.0"
    assert_published(done, dest, dest / ".kelastic-complete", "kueue v0.17.0")
    assert (dest / "crds" / "workloads.yaml").is_file() and os.access(dest / "bin" / "kueue", os.X_OK)
    again = build(KUEUE, {**building, "GO": "/nonexistent/go"})
    assert again.returncode == 0 and again.stdout.strip() == str(dest) and again.stderr == ""


def node_apt_packages() -> set[str]:
    match = re.search(r"^APT_PACKAGES=\(([^)]*)\)$", NODE.read_text(), re.M)
    assert match, "node/build.sh names its Debian packages in APT_PACKAGES=(...)"
    return set(match.group(1).split())


def test_the_node_build_installs_what_the_lane_checks_for() -> None:
    """What ``KELASTIC_NODE_APT=1 make node`` installs covers the tools the lane looks for
    (tar and mount are Essential in Debian: always there)."""
    from kelastic.localcluster.node.checks import TOOLS

    assert set(TOOLS.values()) - {"tar", "mount"} <= node_apt_packages()


def test_kelastic_node_apt_installs_the_missing_packages_also_before_a_reuse(
    env: dict[str, str], tmp_path: Path
) -> None:
    """CI's machine may hold the build in its cache but lack the packages; without the knob a
    reuse asks dpkg nothing."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, body in {
        # every package but nftables is installed
        "dpkg-query": 'if [[ ${!#} == nftables ]]; then exit 1; fi; echo "install ok installed"',
        "apt-get": 'echo "apt-get $*" >>"$APT_CALLS"',
    }.items():
        (tools / name).write_text(f'#!/usr/bin/env bash\necho {name} >>"$APT_CALLS"\n{body}\n')
        (tools / name).chmod(0o755)
    node = complete_node(Path(env["KELASTIC_NODE_CACHE"]))
    env.update(PATH=f"{tools}:{env['PATH']}", APT_CALLS=str(tmp_path / "apt-calls"), GO="/nonexistent/go")

    done = build(NODE, env)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, str(node), "")
    assert not (tmp_path / "apt-calls").exists()

    done = build(NODE, {**env, "KELASTIC_NODE_APT": "1"})
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == str(node), done.stderr
    assert "node build: installing Debian packages nftables" in done.stderr
    apt = [line for line in (tmp_path / "apt-calls").read_text().splitlines() if line.startswith("apt-get ")]
    assert apt == ["apt-get update -q", "apt-get install -y -q nftables"]


def test_the_buildkit_build_compiles_its_module_source_static_and_publishes_whole(
    building: dict[str, str],
) -> None:
    done = build(BUILDKIT, building)
    bin_dir = Path(building["KELASTIC_NODE_CACHE"]) / "buildkit-v0.34.2" / "bin"
    assert_published(done, bin_dir, bin_dir / ".kelastic-complete", "buildkit v0.34.2")
    for binary in ("buildkitd", "buildctl"):
        assert os.access(bin_dir / binary, os.X_OK), binary
    # go.mod's exclude directives rule out `go install`: the module's own source is built.
    (compile_line,) = calls(building, "build", "./cmd/buildkitd")
    assert (
        compile_line.startswith("GOFLAGS=|CGO_ENABLED=0|")
        and "-X github.com/moby/buildkit/version.Version=v0.34.2" in compile_line
    )
    assert not calls(building, "install")
    # A second run reuses it without Go.
    building["GO"] = "/nonexistent/go"
    again = build(BUILDKIT, building)
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == str(bin_dir) and again.stderr == ""


def test_a_refused_buildkit_is_named(env: dict[str, str]) -> None:
    env["REFUSED"] = "github.com/moby/buildkit@v0.34.2"
    done = build(BUILDKIT, env)
    assert done.returncode == 1 and done.stdout == ""
    assert "refused module github.com/moby/buildkit version v0.34.2 (404 Not Found)" in done.stderr
    assert not (Path(env["KELASTIC_NODE_CACHE"]) / "buildkit-v0.34.2" / "bin").exists()


def test_the_heartbeat_sleep_holds_none_of_the_callers_pipes() -> None:
    """A stop that lands between the heartbeat's ``sleep &`` and ``sleeper=$!`` orphans that
    sleep (a fast step under load does this); it must not hold the caller's stdout or stderr,
    or whoever reads the build's output to its end waits out the whole heartbeat."""
    script = f"""
source {REPO / "localcluster" / "gobuild.sh"}
gobuild_name test
START=$SECONDS GO=true HEARTBEAT=60
heartbeat step & beat=$!
for _ in $(seq 50); do sleeper=$(pgrep -P "$beat" -x sleep) && break; sleep 0.1; done
readlink "/proc/$sleeper/fd/1" "/proc/$sleeper/fd/2"
kill "$beat"; wait "$beat"
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["/dev/null", "/dev/null"], (done.stdout, done.stderr)
