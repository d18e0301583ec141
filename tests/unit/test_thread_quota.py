"""The default llama.cpp thread count respects a cgroup CPU quota (v2 cpu.max, v1 cfs quota/period)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cllm.backends.llama_cpp.threads import cgroup_cpu_limit, default_n_threads, quota_threads


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_cpu_max_of_the_process_cgroup(tmp_path):
    _write(tmp_path / "proc", "0::/kubepods/pod1\n")
    _write(tmp_path / "cg/kubepods/pod1/cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == pytest.approx(1.5)


def test_v2_the_tightest_level_of_the_hierarchy_wins(tmp_path):
    _write(tmp_path / "proc", "0::/a/b\n")
    _write(tmp_path / "cg/a/cpu.max", "100000 100000\n")  # the parent allows 1 CPU
    _write(tmp_path / "cg/a/b/cpu.max", "max 100000\n")  # the leaf none
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == pytest.approx(1.0)


def test_v2_no_quota_is_none(tmp_path):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None
    assert cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "missing") is None


def test_v2_in_a_container_whose_cgroup_path_is_the_hosts(tmp_path):
    # /proc/self/cgroup names a host path; the container's own cgroup is mounted at the root
    _write(tmp_path / "proc", "0::/system.slice/docker-abc.scope\n")
    _write(tmp_path / "cg/cpu.max", "50000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == pytest.approx(0.5)


def test_v1_cfs_quota_and_period(tmp_path):
    _write(tmp_path / "proc", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == pytest.approx(2.5)


def test_v1_unlimited_quota_is_none(tmp_path):
    _write(tmp_path / "proc", "1:cpu:/\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None


@pytest.mark.parametrize("text", ["", "garbage", "0 100000", "100000 0", "x y"])
def test_malformed_cpu_max_is_ignored(tmp_path, text):
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "cg/cpu.max", text)
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_quota_is_rounded_down_to_at_least_one_thread():
    assert quota_threads(None) is None
    assert quota_threads(0.5) == 1
    assert quota_threads(1.0) == 1
    assert quota_threads(1.99) == 1
    assert quota_threads(2.0) == 2
    assert quota_threads(3.5) == 3


def test_default_is_the_smaller_of_cores_and_quota():
    cpus = [0, 1, 2, 3]
    cores = default_n_threads(cpus=cpus, read_cgroup=False)
    assert cores >= 1
    assert default_n_threads(cpus=cpus, cpu_limit=1.5) == 1
    assert default_n_threads(cpus=cpus, cpu_limit=64.0) == cores  # a quota above the cores changes nothing
    assert default_n_threads(cpus=[0], cpu_limit=8.0) == 1


def test_default_reads_the_cgroup_of_this_process(monkeypatch):
    import cllm.backends.llama_cpp.threads as threads
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1.0)
    assert threads.default_n_threads(cpus=[0, 1]) == 1
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.default_n_threads(cpus=[0, 1]) == threads.physical_cores([0, 1])
