"""`--device` on `kvscope run` and `kvscope demo`: a bad name or a twin without root is one
line and exit 2, before anything is made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvscope.capture.workload import device
from kvscope.contract import jsonfiles, rundir


def _kvscope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["run", "demo"])
def test_an_unknown_device_is_one_line_naming_the_choices(tmp_path, command):
    proc = _kvscope(command, "--device", "twin:nope", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"kvscope {command}: error: --device 'twin:nope': expected one of disk, "
        "twin:nvme-gen4, twin:nvmeof-tcp, twin:nvmeof-tcp-x4"]
    assert list(tmp_path.iterdir()) == []


def test_the_help_lists_every_twin_profile_with_what_it_imitates():
    proc = _kvscope("run", "--help")
    words = " ".join(proc.stdout.split())
    assert "--device DEVICE" in proc.stdout
    assert "twin:nvmeof-tcp-x4 (nvmeof-tcp with every time x4" in words


@pytest.mark.root
@pytest.mark.parametrize("command", ["run", "demo"])
def test_a_twin_without_root_is_refused_in_one_line_and_nothing_is_made(tmp_path, command):
    """The CLI really runs unprivileged: imports happen as root (the venv lives under /root),
    then the process drops to nobody before parsing and running."""
    code = (
        "import os, sys; from kvscope import cli; "
        "import kvscope.capture.workload.runner, kvscope.study, kvscope.estimate; "
        "from kvscope.analysis import (study_peers, study_report, study_tables, "
        "study_targets, study_verdict); "
        "parser = cli.build_parser(); os.setgid(65534); os.setuid(65534); "
        f"args = parser.parse_args(['{command}', '--model', 'tiny', '--device', "
        f"'twin:nvmeof-tcp-x4', '--out', '{tmp_path}/r']); sys.exit(args.func(args))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"kvscope {command}: error: a device twin needs root (it attaches a loop device and "
        "mounts file systems); run as root, or read a real disk instead"]
    assert list(tmp_path.iterdir()) == []


def test_a_twin_and_a_kv_dir_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--kv-dir and --device twin:nvmeof-tcp both say"):
        device.refuse_place("twin:nvmeof-tcp", tmp_path, "--kv-dir")
    device.refuse_place("disk", tmp_path, "--kv-dir")


def test_a_manifest_device_of_the_wrong_shape_makes_the_run_unreadable():
    manifest = {"device": {"kind": "tape", "name": "loop3"}}
    problems = jsonfiles.shape_problems(manifest, rundir.MANIFEST_SCHEMA)
    assert len(problems) == 1 and problems[0].startswith("field device.kind:")
    good = {"device": {"kind": "twin", "name": "loop3", "profile": {}, "stack_latency_us": 210.5}}
    assert jsonfiles.shape_problems(good, rundir.MANIFEST_SCHEMA) == []
    assert jsonfiles.shape_problems({}, rundir.MANIFEST_SCHEMA) == []  # older runs have none


def test_the_demo_names_the_real_disk_or_the_twin_it_reads(tmp_path):
    from kvscope.capture.device_twin import PROFILES, Twin
    from kvscope.contract.host import whole_disk

    where = tmp_path / "not-made-yet" / "kv"
    disk = device.section_for(None, where)
    assert disk == {"kind": "disk", "name": whole_disk(tmp_path)}
    assert device.describe(disk, where) == f"{disk['name'] or '?'} (the real disk under {where})"
    twin = Twin("/dev/loop3", str(tmp_path), PROFILES["nvmeof-tcp-x4"], 210.0)
    assert device.describe(device.manifest_section(twin, "loop3"), tmp_path) == (
        f"loop3, twin nvmeof-tcp-x4 ({PROFILES['nvmeof-tcp-x4'].about})")
