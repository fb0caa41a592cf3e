"""The real-node lane's pure parts: the plan's names and addresses, the components' files, the
host commands, and the control plane's flags for real nodes. Nothing here needs root."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from kelastic.localcluster.controlplane.controlplane import ComponentHelp, component_flags
from kelastic.localcluster.node import configs, diskspace, network
from kelastic.localcluster.node.checks import missing
from kelastic.localcluster.node.images import write_layout
from kelastic.localcluster.node.plan import LanePlan

ROOT = Path("/var/tmp/kelastic-node")


def lane(slot: int = 3, nodes: int = 2) -> LanePlan:
    return LanePlan.make(slot, nodes, root_base=ROOT, cgroup_parent="/process_api/abc")


def test_plan_keeps_lanes_and_nodes_apart() -> None:
    a, b = lane(3), lane(4)
    assert a.bridge != b.bridge and not a.network.overlaps(b.network)
    assert a.nft_table != b.nft_table and a.cgroup != b.cgroup
    n1, n2 = a.nodes
    assert n1.netns != n2.netns and not n1.pod_cidr.overlaps(n2.pod_cidr)
    for net in (a.node_network, a.service_network, n1.pod_cidr, n2.pod_cidr):
        assert net.subnet_of(a.network) and net.is_private  # type: ignore[arg-type]
    assert not a.service_network.overlaps(n1.pod_cidr) and not a.node_network.overlaps(n2.pod_cidr)
    assert a.host_address in a.node_network and n1.address in a.node_network
    assert n1.cgroup.startswith("/process_api/abc/kelastic-3/")
    # Interface names the kernel takes (15 characters at most).
    assert all(len(name) <= 15 for name in (a.bridge, n1.host_veth, n1.node_veth))


def test_plan_refuses_slots_and_counts_out_of_range() -> None:
    with pytest.raises(ValueError, match="slot"):
        lane(10)
    with pytest.raises(ValueError, match="nodes"):
        lane(0, 0)


def test_pods_get_no_default_route_and_no_masquerade() -> None:
    plan = lane()
    bridge = configs.cni_conflist(plan, plan.nodes[0])["plugins"][0]
    assert bridge["ipMasq"] is False and bridge["isDefaultGateway"] is False
    routes = bridge["ipam"]["routes"]
    assert routes == [{"dst": str(plan.network)}], "the lane's /16 only, never 0.0.0.0/0"
    for netns, argv in network.setup_commands(plan):
        assert "default" not in argv and "0.0.0.0/0" not in argv, (netns, argv)


def test_host_guard_drops_what_crosses_the_bridge_boundary() -> None:
    plan = lane()
    rules = network.guard_rules(plan)
    assert f"table inet {plan.nft_table}" in rules and "hook forward" in rules
    assert f'iifname "{plan.bridge}" oifname != "{plan.bridge}" counter drop' in rules
    assert f'oifname "{plan.bridge}" iifname != "{plan.bridge}" counter drop' in rules


def test_host_routes_only_lane_ranges_to_its_nodes() -> None:
    plan = lane()
    host_routes = [
        argv for netns, argv in network.setup_commands(plan) if netns is None and argv[1] == "route"
    ]
    targets = {ipaddress.IPv4Network(argv[3]) for argv in host_routes}
    assert targets == {plan.service_network, *(n.pod_cidr for n in plan.nodes)}


def test_component_files_name_the_node_and_its_limits() -> None:
    plan = lane()
    node = plan.nodes[1]
    toml = configs.containerd_config(node, runc=Path("/b/runc"), cni_bin=Path("/b/cni"))
    assert "restrict_oom_score_adj = true" in toml and "SystemdCgroup = false" in toml
    assert f'address = "{node.containerd_socket}"' in toml and configs.PAUSE_IMAGE in toml
    kubelet = configs.kubelet_config(node, ca_file=Path("ca"), serving_cert=Path("c"), serving_key=Path("k"))
    assert kubelet["failCgroupV1"] is False and kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["cgroupRoot"] == node.cgroup and kubelet["address"] == str(node.address)
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert kubelet["authorization"]["mode"] == "Webhook"


def test_control_plane_keeps_endpoint_controllers_for_real_nodes() -> None:
    help_ = ComponentHelp(
        frozenset(), ("endpoints-controller", "endpointslice-controller", "garbage-collector")
    )
    off = component_flags("kube-controller-manager", help_, loopback_slices=False, gates={})
    on = component_flags("kube-controller-manager", help_, loopback_slices=False, gates={}, endpoints=True)
    assert "--controllers=*,-endpoints-controller,-endpointslice-controller" in off
    assert "--controllers=*" in on


def test_oci_layout_names_the_image_and_its_layers(tmp_path: Path) -> None:
    layer = tmp_path / "layer.tar"
    layer.write_bytes(b"\0" * 1024)
    out = write_layout(tmp_path / "oci", "docker.io/kelastic/x:1", [layer], entrypoint=["/x"])
    index = json.loads((out / "index.json").read_text())
    (manifest,) = index["manifests"]
    assert manifest["annotations"]["io.containerd.image.name"] == "docker.io/kelastic/x:1"
    body = json.loads((out / "blobs" / "sha256" / manifest["digest"][7:]).read_bytes())
    assert len(body["layers"]) == 1 and body["layers"][0]["size"] == 1024


def test_missing_names_what_to_build_and_run_as(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = missing(tmp_path)
    assert why is not None and "make node" in why and "kubelet" in why
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setattr("shutil.which", lambda name: None)
    why = missing(tmp_path)
    assert why is not None and "run it as root" in why
    assert "apt-get install -y conntrack iproute2 ipset iptables mount nftables tar" in why


GB = 10**9


def test_imports_run_side_by_side_when_the_disk_holds_their_peak() -> None:
    # Two nodes importing 5 GB at once: each holds blobs and unpacked layers, 20 GB.
    plan = diskspace.plan_imports(5 * GB, 2, 30 * GB, ROOT, headroom=2 * GB)
    assert (plan.side_by_side, plan.peak) == (2, 20 * GB)
    assert diskspace.plan_imports(5 * GB, 2, 30 * GB, ROOT, most=1, headroom=2 * GB).side_by_side == 1


def test_imports_go_one_node_at_a_time_when_only_that_fits() -> None:
    # One after the other: the first keeps its 5 GB unpacked while the second peaks at 10.
    plan = diskspace.plan_imports(5 * GB, 2, 18 * GB, ROOT, headroom=2 * GB)
    assert (plan.side_by_side, plan.peak) == (1, 15 * GB)
    assert diskspace.import_peak(5 * GB, 4, 2) == 30 * GB  # two waves of two


def test_imports_that_cannot_fit_say_what_they_need_and_what_to_delete() -> None:
    with pytest.raises(diskspace.NotEnoughSpace) as failed:
        diskspace.plan_imports(5 * GB, 2, 16 * GB, ROOT, headroom=2 * GB)
    message = str(failed.value)
    assert "needs 17.0 GB free" in message and "16.0 GB is free" in message and str(ROOT) in message
    assert "free 1.0 GB" in message and "buildkit" in message


def test_fixed_host_paths_absent_before_the_first_lane_are_removed_after_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kelastic.localcluster.node import hostops

    kubelet, plugins = tmp_path / "kubelet", tmp_path / "kubelet" / "device-plugins"
    cni, results = tmp_path / "cni", tmp_path / "cni" / "results"
    monkeypatch.setattr(hostops, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(hostops, "FIXED_PATHS", tuple(map(str, (kubelet, plugins, cni, results))))
    kubelet.mkdir()
    (kubelet / "host's own").write_text("kept")
    assert hostops.save_fixed_paths() == [str(plugins), str(cni), str(results)]
    plugins.mkdir()  # what the lane's components make
    results.mkdir(parents=True)
    (results / "kelastic-pod-eth0").write_text("{}")
    assert hostops.save_fixed_paths() == [str(plugins), str(cni), str(results)]  # a second lane: unchanged
    assert hostops.remove_fixed_paths() == []
    assert not plugins.exists() and not cni.exists()
    assert (kubelet / "host's own").read_text() == "kept"
    assert hostops.remove_fixed_paths() == []  # forgotten: nothing more is removed
    assert kubelet.exists()
