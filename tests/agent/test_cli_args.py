"""kelastic-agent's flags: torchrun's set, underscore spellings, PET_* fallbacks, clear usage errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent import contract, devices, warm
from kelastic.agent.checkpoint.keeper import CheckpointKeeper
from kelastic.agent.checkpoint.settings import CheckpointSettings
from kelastic.agent.cli import (
    build_parser,
    config_from_args,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
)
from kelastic.agent.multiprocessing import Std

OPERATOR_ARGS = [
    "--nnodes", "2:4", "--nproc-per-node", "2", "--rdzv-backend", "kelastic",
    "--rdzv-endpoint", "127.2.0.5:29400", "--rdzv-id", "uid-1", "--max-restarts", "3",
    "--local-addr", "127.1.0.7", "--health-port", "8081", "train.py", "--lr", "0.1",
]  # fmt: skip


def _config(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv))


def test_operator_command_line() -> None:
    c = _config(OPERATOR_ARGS)
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 4, 2)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id) == ("kelastic", "127.2.0.5:29400", "uid-1")
    assert (c.max_restarts, c.local_addr, c.health_port) == (3, "127.1.0.7", 8081)
    assert c.entrypoint == sys.executable
    assert c.args == ("-u", "train.py", "--lr", "0.1")
    assert not c.standalone


def test_every_contract_flag_is_a_flag_of_the_agent() -> None:
    """The operator writes the contract's FLAG_* names into worker commands: each is defined here."""
    flags = {name: value for name, value in vars(contract).items() if name.startswith("FLAG_")}
    assert len(flags) >= 12, flags
    known = build_parser()._option_string_actions
    assert {name: flag for name, flag in flags.items() if flag not in known} == {}


def test_warm_imports_name_the_scripts_installed_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport json\nimport helper\nimport torch.nn\n")
    (tmp_path / "helper.py").write_text("")
    # torch is PRELOAD's; the script's own helper is never imported early.
    assert _config(["--warm-start", str(script)]).warm_imports == ("json", "torch.nn")
    assert _config(["--warm-start", "--warm-imports", "torch", str(script)]).warm_imports == ()
    assert _config(["--warm_imports", "script", str(script)]).warm_imports == ()  # no warm start
    monkeypatch.setenv("PET_WARM_IMPORTS", "torch")
    assert _config(["--warm-start", str(script)]).warm_imports == ()
    monkeypatch.setenv("PET_WARM_IMPORTS", "everything")
    with pytest.raises(SystemExit):  # a usage error: test_a_pet_variable_out_of_its_choices_...
        _config(["--warm-start", str(script)])


def test_workers_start_early_only_for_a_script_under_kelastic_inprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = tmp_path / "kept.py"
    kept.write_text("import kelastic.inprocess\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    standby = ["--rdzv-backend", "kelastic", "--rdzv-endpoint", "127.0.0.1:29400", "--standby"]
    assert _config([*standby, str(kept)]).start_early
    assert not _config([*standby, str(plain)]).start_early
    assert _config(["--rdzv-backend", "kelastic", "--rdzv-endpoint", "h:1", str(kept)]).start_early
    (tmp_path / "mytrain.py").write_text("from kelastic.inprocess import run\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _config([*standby, "-m", "mytrain"]).start_early  # -m: the module's file
    assert not _config([*standby, "-m", "no_such_module_kelastic"]).start_early


def test_underscore_spellings_and_short_flags() -> None:
    c = _config(
        ["--nproc_per_node", "3", "--max_restarts", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1",
         "--monitor_interval", "0.5", "-r", "3", "-t", "0:1,1:2", "--local_ranks_filter", "0,2", "x.py"]
    )  # fmt: skip
    assert (c.nproc_per_node, c.max_restarts, c.rdzv_backend, c.monitor_interval) == (3, 1, "c10d", 0.5)
    assert c.redirects == Std.ALL
    assert c.tee == {0: Std.OUT, 1: Std.ERR}
    assert c.local_ranks_filter == {0, 2}


def test_pet_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "store:29400")
    monkeypatch.setenv("PET_RDZV_ID", "job-7")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    c = _config(["t.py"])
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.run_id, c.max_restarts) == (1, 3, 4, "job-7", 5)
    assert c.rdzv_endpoint == "store:29400"
    # a flag on the command line beats the environment
    assert _config(["--nproc-per-node", "2", "t.py"]).nproc_per_node == 2


def test_entrypoint_kinds() -> None:
    assert _config(["-m", "pkg.train", "a"]).args == ("-u", "-m", "pkg.train", "a")
    c = _config(["--no-python", "/bin/echo", "hi"])
    assert (c.entrypoint, c.args) == ("/bin/echo", ("hi",))
    c = _config(["--run-path", "t.py", "a"])
    assert callable(c.entrypoint) and c.args == ("t.py", "a")
    c = _config(["--warm-start", "t.py", "a"])
    assert (c.entrypoint, c.args, c.start_method) == (warm.run_script, ("t.py", "a"), "forkserver")
    c = _config(["--warm-start", "-m", "pkg.train"])
    assert (c.entrypoint, c.args) == (warm.run_module, ("pkg.train",))


def test_single_node_without_endpoint_is_standalone() -> None:
    assert _config(["t.py"]).standalone
    c = _config(["--standalone", "--rdzv-id", "x", "t.py"])
    assert c.standalone and c.rdzv_backend == "kelastic" and c.run_id != "x"


def test_static_backend_uses_master_address() -> None:
    c = _config(["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--master-port", "1234", "t.py"])  # fmt: skip
    assert c.rdzv_endpoint == "10.0.0.1:1234"
    assert c.rdzv_configs["rank"] == 1


def test_standby_is_a_rendezvous_setting_of_the_kelastic_backend() -> None:
    assert _config([*OPERATOR_ARGS[:-3], "--standby", "train.py"]).rdzv_configs == {"standby": "1"}
    assert "standby" not in _config(OPERATOR_ARGS).rdzv_configs
    for argv in (["--standby", "t.py"], ["--standby", "--standalone", "t.py"]):
        with pytest.raises(ValueError, match=r"--standby .* --rdzv-backend kelastic"):
            _config(argv)
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--nnodes", "2", "--standby", "t.py"]
    with pytest.raises(ValueError, match="got --rdzv-backend c10d"):
        _config(c10d)


def test_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsing rules (the count of GPUs is given here: test_agent_devices.py counts the
    real ones, in a subprocess that imports torch)."""
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("2:4") == (2, 4)
    for bad in ("0", "4:2", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)
    assert parse_nproc_per_node("2") == 2
    assert parse_nproc_per_node("cpu") >= 1
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    assert parse_nproc_per_node("auto") == parse_nproc_per_node("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        parse_nproc_per_node("gpu")
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    assert parse_nproc_per_node("auto") == parse_nproc_per_node("gpu") == 4
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="--nproc-per-node"):
            parse_nproc_per_node(bad)
    assert parse_rdzv_conf("join_timeout=5, last_call_timeout=1") == {
        "join_timeout": "5",
        "last_call_timeout": "1",
    }
    with pytest.raises(ValueError, match="'oops'"):
        parse_rdzv_conf("a=1,oops")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nnodes", "3:2", "t.py"], "--nnodes"),
        (["--nproc-per-node", "lots", "t.py"], "--nproc-per-node"),
        (["--max-restarts", "x", "t.py"], "--max-restarts"),
        (["--start-method", "teleport", "t.py"], "--start-method"),
        (["--nnodes", "2:4", "t.py"], "--rdzv-endpoint"),
        (["-m", "--no-python", "t.py"], "mutually exclusive"),
        (["--warm-start", "--no-python", "/bin/echo"], "--warm-start"),
        (["--warm-start", "--warm-imports", "all", "t.py"], "--warm-imports"),
        (["--no-python", "/nonexistent/prog"], "was not found"),
        (["-r", "7", "t.py"], "std stream mask"),
        (["--rdzv-conf", "novalue", "t.py"], "--rdzv-conf"),
        ([], "training_script"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kelastic.agent", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "usage: kelastic-agent" in proc.stderr
    assert needle in proc.stderr


@pytest.mark.parametrize(
    ("env", "value"), [("PET_START_METHOD", "bogus"), ("PET_WARM_IMPORTS", "everything")]
)
def test_a_pet_variable_out_of_its_choices_is_a_usage_error(env: str, value: str) -> None:
    """Before the rendezvous: found wrong after it, the agent used to fail late and exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "kelastic.agent", "--standalone", "t.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, env: value},
    )
    assert proc.returncode == 2, proc.stderr
    assert "usage: kelastic-agent" in proc.stderr
    assert f"{env}={value!r}: invalid choice" in proc.stderr


def test_a_flag_on_the_command_line_overrides_a_bad_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_START_METHOD", "bogus")
    assert build_parser().parse_args(["--start-method", "fork", "t.py"]).start_method == "fork"


def test_the_checkpoint_flags_are_the_settings_the_keeper_takes(tmp_path: Path) -> None:
    """One type from the command line to the keeper: the flags give every node's settings,
    ``for_node`` places them on one node, and a keeper takes only placed ones."""
    c = _config(
        [*OPERATOR_ARGS[:-3], "--checkpoint-dir", str(tmp_path), "--checkpoint-memory", "64Mi",
         "--checkpoint-replicas", "2", "--checkpoint-persist-dir", "/ckpt", "--checkpoint-persist-every", "3",
         "train.py"]
    )  # fmt: skip
    assert isinstance(c.checkpoint, CheckpointSettings)
    assert (c.checkpoint.root, c.checkpoint.limit, c.checkpoint.replicas) == (tmp_path, 64 * 2**20, 2)
    assert (c.checkpoint.persist_dir, c.checkpoint.persist_every) == ("/ckpt", 3)
    root = c.checkpoint.node_folder("uid/1", "pod a")
    assert root == tmp_path / "uid_1" / "pod_a"
    placed = c.checkpoint.for_node(root, "pod a", 2**20, "test")
    assert (placed.root, placed.node, placed.limit, placed.replicas) == (root, "pod a", 2**20, 2)
    assert CheckpointKeeper(placed, "127.0.0.1:1").limit == 2**20

    auto = _config([*OPERATOR_ARGS[:-3], "--checkpoint-memory", "auto", "train.py"]).checkpoint
    assert auto is not None and auto.limit is None and "auto" in auto.describe()
    with pytest.raises(ValueError, match="for_node"):
        CheckpointKeeper(auto, "127.0.0.1:1")
    assert _config([*OPERATOR_ARGS[:-3], "--checkpoint-memory", "0", "train.py"]).checkpoint is None


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        (contract.FLAG_CHECKPOINT_REPLICAS, "-1"),
        (contract.FLAG_CHECKPOINT_PERSIST_EVERY, "-1"),
        (contract.FLAG_CHECKPOINT_PERSIST_INTERVAL, "-5"),
    ],
)
def test_a_bad_checkpoint_flag_is_named(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _config([*OPERATOR_ARGS[:-3], flag, value, "train.py"])
