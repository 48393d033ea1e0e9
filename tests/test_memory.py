"""The KV pool's default cap (issue 24, item 9): a replica that is not told a cap takes a share
of the memory it has, within its container's limit, instead of none."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specdec.engine.memory import (
    AUTO,
    cgroup_headroom,
    kv_cap,
    meminfo_available,
    parse_kv_bytes,
    resolve_kv_cap,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("auto", AUTO),
        ("AUTO", AUTO),
        ("0", 0),
        ("123", 123),
        ("2G", 2 * 10**9),
        ("2GiB", 2 << 30),
        ("512Mi", 512 << 20),
    ],
)
def test_max_kv_bytes_takes_auto_or_a_byte_count(text, expected):
    assert parse_kv_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "2X", "lots", "1.5G"])
def test_a_malformed_cap_is_refused(text):
    with pytest.raises(ValueError, match="auto"):
        parse_kv_bytes(text)


def test_the_cap_is_a_share_of_the_free_memory_split_between_ranks_on_one_host():
    assert kv_cap(8 << 30, 0.5) == 4 << 30
    assert kv_cap(8 << 30, 0.5, sharers=2) == 2 << 30
    with pytest.raises(ValueError, match="fraction"):
        kv_cap(8 << 30, 1.5)


def test_meminfo_and_cgroup_files_are_read(tmp_path):
    assert meminfo_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    assert meminfo_available("MemTotal: 100 kB\n") is None
    assert cgroup_headroom(tmp_path) is None  # no cgroup files: no container limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert cgroup_headroom(tmp_path) is None  # v2 without a limit
    (tmp_path / "memory.max").write_text(str(4 << 30))
    assert cgroup_headroom(tmp_path) == (4 << 30) - 1000  # a Kubernetes memory limit of 4Gi
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "unlimited"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5")
    assert cgroup_headroom(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text("105")
    assert cgroup_headroom(v1) == 100


def test_a_replica_started_without_a_cap_gets_one_below_the_memory_it_has():
    """Before: --max-kv-bytes defaulted to 0, no cap at all."""
    from replica.servicer import add_replica_arguments, cache_limits

    parser = argparse.ArgumentParser()
    add_replica_arguments(parser)
    args = parser.parse_args([])
    limits = cache_limits(args, "cpu")
    meminfo = meminfo_available(Path("/proc/meminfo").read_text())
    assert meminfo is not None
    assert 0 < limits.max_total_kv_bytes <= meminfo * args.kv_memory_fraction * 1.05
    assert cache_limits(parser.parse_args(["--max-kv-bytes", "0"]), "cpu").max_total_kv_bytes == 0
    assert resolve_kv_cap(1 << 20, "cpu") == 1 << 20


@pytest.mark.parametrize("flag", ["--prefix-cache-bytes", "--max-kv-bytes"])
def test_a_bad_byte_count_flag_is_a_usage_error_that_says_what_it_takes(flag, capsys):
    import argparse

    from replica.servicer import add_replica_arguments

    parser = argparse.ArgumentParser(prog="specdec target")
    add_replica_arguments(parser)
    assert parser.parse_args([flag, "256MiB"]) is not None
    with pytest.raises(SystemExit) as info:
        parser.parse_args([flag, "lots"])
    assert info.value.code == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err
