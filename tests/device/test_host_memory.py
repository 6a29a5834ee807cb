"""The memory a process may still take: the host's MemAvailable or, in a container, what its
cgroup's memory limit leaves (``ckptstore.device.host_available_bytes``), read from cgroup
files laid out as the kernel lays them out (v2, and v1's memory controller)."""

from __future__ import annotations

import os

import pytest

from ckptstore import device

GIB = 1 << 30


def _files(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """A cgroup tree under tmp_path that ``device`` reads instead of the machine's."""
    root = tmp_path / "sys"
    root.mkdir()
    monkeypatch.setattr(device, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(device, "SELF_CGROUP", str(tmp_path / "self_cgroup"))

    def lay(self_cgroup: str, files: dict[str, str]) -> None:
        (tmp_path / "self_cgroup").write_text(self_cgroup)
        _files(root, files)

    return lay


def test_a_v2_limit_leaves_what_is_not_charged_page_cache_it_can_drop_not_counted(cgroup):
    cgroup(
        "0::/job/trainer\n",
        {
            "cgroup.controllers": "cpu memory\n",
            "job/memory.max": f"{8 * GIB}\n",
            "job/memory.current": f"{3 * GIB}\n",
            "job/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\n",
            "job/trainer/memory.max": "max\n",
            "job/trainer/memory.current": f"{3 * GIB}\n",
            "job/trainer/memory.stat": f"inactive_file {GIB}\n",
        },
    )
    # The trainer's own cgroup has no limit; its parent's 8 GiB, 2 GiB of it held, binds.
    assert device.cgroup_available_bytes() == 6 * GIB
    assert device.host_available_bytes() == 6 * GIB


def test_the_tightest_of_a_v2_cgroup_and_its_ancestors_binds(cgroup):
    cgroup(
        "0::/job/trainer\n",
        {
            "cgroup.controllers": "memory\n",
            "job/memory.max": f"{8 * GIB}\n",
            "job/memory.current": f"{7 * GIB}\n",
            "job/trainer/memory.max": f"{4 * GIB}\n",
            "job/trainer/memory.current": f"{GIB}\n",
        },
    )
    assert device.cgroup_available_bytes() == GIB


def test_a_container_seeing_its_own_cgroup_as_the_root_reads_the_root(cgroup):
    # /proc/self/cgroup names the host's path, which the container's /sys/fs/cgroup lacks.
    cgroup(
        "0::/kubepods/pod1/abc\n",
        {
            "cgroup.controllers": "memory\n",
            "memory.max": f"{2 * GIB}\n",
            "memory.current": f"{GIB // 2}\n",
            "memory.stat": "inactive_file 0\n",
        },
    )
    assert device.cgroup_available_bytes() == 2 * GIB - GIB // 2


def test_no_limit_or_no_cgroup_leaves_the_hosts_figure(cgroup, tmp_path):
    cgroup("0::/\n", {"cgroup.controllers": "memory\n", "memory.max": "max\n"})
    assert device.cgroup_available_bytes() is None
    assert device.host_available_bytes() > 0
    (tmp_path / "self_cgroup").unlink()
    assert device.cgroup_available_bytes() is None


def test_a_v1_ancestors_limit_binds_with_what_its_other_children_hold(cgroup):
    """Stop 83's fix adversary: v1 took an ancestor's limit (hierarchical_memory_limit) less
    this cgroup's own usage; siblings holding nearly all of the parent's 4 GiB left ~1 MiB,
    not the 3.9 GiB it said."""
    cgroup(
        "4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "unified/cgroup.controllers": "",
            "memory/docker/memory.limit_in_bytes": f"{4 * GIB}\n",
            "memory/docker/memory.usage_in_bytes": f"{4 * GIB - (1 << 20)}\n",
            "memory/docker/memory.stat": "total_inactive_file 0\ntotal_active_file 0\n",
            "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GIB // 10}\n",
            "memory/docker/abc/memory.stat": (
                f"cache 1\nhierarchical_memory_limit {4 * GIB}\ntotal_inactive_file 0\n"
            ),
        },
    )
    assert device.cgroup_available_bytes() == 1 << 20


def test_page_cache_on_either_list_is_not_counted_as_held(cgroup):
    """Stop 83's fix adversary: 7 GiB charged under an 8 GiB limit, 6 GiB of it page cache the
    kernel counts active (files read twice), left 1 GiB, and a 2 GiB tensor was refused; the
    kernel drops clean cache before it kills, as MemAvailable counts it."""
    cgroup(
        "0::/job\n",
        {
            "cgroup.controllers": "memory\n",
            "job/memory.max": f"{8 * GIB}\n",
            "job/memory.current": f"{7 * GIB}\n",
            "job/memory.stat": f"anon {GIB}\nactive_file {5 * GIB}\ninactive_file {GIB}\n",
        },
    )
    assert device.cgroup_available_bytes() == 7 * GIB
    cgroup(
        "4:memory:/\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{8 * GIB}\n",
            "memory/memory.usage_in_bytes": f"{7 * GIB}\n",
            "memory/memory.stat": f"total_active_file {5 * GIB}\ntotal_inactive_file {GIB}\n",
        },
    )
    os.remove(os.path.join(device.CGROUP_ROOT, "cgroup.controllers"))  # now a v1 machine
    assert device.cgroup_available_bytes() == 7 * GIB


def test_a_v1_cgroup_without_a_limit_leaves_the_hosts_figure(cgroup):
    unlimited = "9223372036854771712"
    cgroup(
        "4:memory:/\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{unlimited}\n",
            "memory/memory.usage_in_bytes": f"{GIB}\n",
            "memory/memory.stat": f"hierarchical_memory_limit {unlimited}\n",
        },
    )
    assert device.cgroup_available_bytes() is None


def test_a_v1_container_reads_the_limit_above_it_it_cannot_see(cgroup):
    """Stop 83's second fix adversary: a container's v1 cgroup is its root, the limit of the
    slice above it (docker --cgroup-parent, a kubepods cgroup) shows only as
    hierarchical_memory_limit; the walk up the tree had dropped it."""
    unlimited = "9223372036854771712"
    cgroup(
        "4:memory:/kubepods/pod1/abc\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{unlimited}\n",
            "memory/memory.usage_in_bytes": f"{2 * GIB}\n",
            "memory/memory.stat": (
                f"hierarchical_memory_limit {5 * GIB}\ntotal_inactive_file {GIB}\n"
            ),
        },
    )
    assert device.cgroup_available_bytes() == 4 * GIB


def test_a_v1_cgroup_without_hierarchy_is_not_bound_by_its_parents_limit(cgroup):
    cgroup(
        "4:memory:/job\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{GIB}\n",
            "memory/memory.usage_in_bytes": f"{GIB}\n",
            "memory/memory.use_hierarchy": "0\n",  # the parent's setting governs
            "memory/job/memory.use_hierarchy": "1\n",
            "memory/job/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/job/memory.usage_in_bytes": f"{GIB // 4}\n",
        },
    )
    assert device.cgroup_available_bytes() is None
