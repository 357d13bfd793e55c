"""disagg-preflight against fake device trees (DISAGG_PREFLIGHT_ROOT) and the real nixl."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from disagg_connector import preflight
from disagg_connector.contract.preflight import REASONS, format_termination_message, parse_termination_message
from disagg_connector.preflight import main

# NIXL is a test dependency (hack/setup.sh installs it): without it these tests must fail, not vanish.
import nixl._api  # noqa: E402,F401

GI = 1 << 30


def make_root(tmp_path, efa=4, gpus=8, neurons=0, free_hugepages=1024, cgroup_limit="max"):
    root = tmp_path / "root"
    (root / "dev" / "infiniband").mkdir(parents=True)
    (root / "dev" / "shm").mkdir()
    for i in range(efa):
        (root / "dev" / "infiniband" / f"uverbs{i}").touch()
        dev = root / "sys" / "class" / "infiniband" / f"rdmap{i}s0"
        (dev / "device").mkdir(parents=True)
        drv = root / "sys" / "bus" / "pci" / "drivers" / "efa"
        drv.mkdir(parents=True, exist_ok=True)
        os.symlink(drv, dev / "device" / "driver")
    (root / "dev" / "infiniband" / "rdma_cm").touch()
    for i in range(gpus):
        (root / "dev" / f"nvidia{i}").touch()
    for extra in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (root / "dev" / extra).touch()
    for i in range(neurons):
        (root / "dev" / f"neuron{i}").touch()
    hp = root / "sys" / "kernel" / "mm" / "hugepages" / "hugepages-2048kB"
    hp.mkdir(parents=True)
    (hp / "free_hugepages").write_text(f"{free_hugepages}\n")
    cg = root / "sys" / "fs" / "cgroup"
    cg.mkdir(parents=True)
    (cg / "hugetlb.2MB.max").write_text(f"{cgroup_limit}\n")
    return root


def run(monkeypatch, tmp_path, root, *args):
    monkeypatch.setenv("DISAGG_PREFLIGHT_ROOT", str(root))
    monkeypatch.setenv("NIXL_LOG_LEVEL", "FATAL")  # main() only sets a default; keep the env restored
    log = tmp_path / "termination-log"
    rc = main([*args, "--termination-log", str(log)])
    text = log.read_text() if log.exists() else ""
    return rc, text


GPU_ARGS = ["--backend", "UCX", "--efa-devices", "4", "--accelerator", "nvidia", "--accelerator-count", "8", "--hugepages-2mi-bytes", str(GI), "--shm-min-bytes", "1024"]


def test_all_present_is_ok(monkeypatch, tmp_path, capsys):
    rc, text = run(monkeypatch, tmp_path, make_root(tmp_path), *GPU_ARGS)
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and text == ""
    assert out[-1].startswith("preflight ok: ") and "efa=4/4" in out[-1] and "nvidia=8/8" in out[-1]


@pytest.mark.parametrize(
    "root_kw, args, reason, words",
    [
        ({"efa": 2}, GPU_ARGS, "EfaDevicesMissing", ["4 EFA devices requested", "2 /dev/infiniband", "rdmap0s0(efa)"]),
        ({"gpus": 4}, GPU_ARGS, "AcceleratorsMissing", ["8 nvidia devices requested but 4", "nvidia.com/gpu"]),
        ({"free_hugepages": 10}, GPU_ARGS, "HugepagesMissing", ["10 free 2Mi hugepages", "512 needed"]),
        ({"cgroup_limit": str(GI // 2)}, GPU_ARGS, "HugepagesMissing", ["cgroup limit is 512Mi"]),
        ({}, GPU_ARGS[:-1] + [str(1 << 60)], "SharedMemoryTooSmall", ["/dev/shm is", "sizeLimit"]),
        (
            {"gpus": 0, "neurons": 8},
            ["--backend", "UCX", "--accelerator", "neuron", "--accelerator-count", "16"],
            "AcceleratorsMissing",
            ["16 neuron devices requested but 8", "aws.amazon.com/neuron"],
        ),
    ],
)
def test_each_missing_resource_has_its_reason(monkeypatch, tmp_path, capsys, root_kw, args, reason, words):
    rc, text = run(monkeypatch, tmp_path, make_root(tmp_path, **root_kw), *args)
    assert rc == 1
    assert text.count("\n") == 1, "exactly one line"
    parsed = parse_termination_message(text)
    assert parsed is not None and parsed[0] == reason
    for w in words:
        assert w in parsed[1], parsed[1]
    assert capsys.readouterr().err.strip() == text.strip()


def test_libfabric_without_efa_is_reported_by_real_nixl(monkeypatch, tmp_path):
    # this machine has no EFA: nixl's LIBFABRIC plugin is present but cannot be instantiated
    rc, text = run(monkeypatch, tmp_path, make_root(tmp_path, efa=0), "--backend", "LIBFABRIC")
    assert rc == 1
    reason, message = parse_termination_message(text)
    assert reason == "NixlBackendUnavailable"
    assert "LIBFABRIC" in message and "set kvTransfer.backend to UCX" in message
    # with EFA devices requested, the missing devices are the reason reported
    rc, text = run(monkeypatch, tmp_path, make_root(tmp_path / "b", efa=0), "--backend", "LIBFABRIC", "--efa-devices", "1")
    assert parse_termination_message(text)[0] == "EfaDevicesMissing"


def test_broken_nixl_install_is_nixl_import_failed(tmp_path):
    fake = tmp_path / "site"
    (fake / "nixl").mkdir(parents=True)
    (fake / "nixl" / "__init__.py").write_text("raise ImportError('libnixl.so: cannot open shared object file')\n")
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "disagg_connector.preflight", "--backend", "UCX", "--termination-log", str(log)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    reason, message = parse_termination_message(log.read_text())
    assert reason == "NixlImportFailed" and "libnixl.so" in message
    assert proc.stderr.strip().splitlines()[-1] == log.read_text().strip()


def test_termination_message_round_trip():
    for reason in REASONS:
        line = format_termination_message(reason, "a\nmulti-line  message: with colons")
        assert "\n" not in line
        assert parse_termination_message(line + "\n") == (reason, "a multi-line message: with colons")
    assert parse_termination_message("") is None
    assert parse_termination_message(None) is None
    assert parse_termination_message("Error: something else") is None
    assert parse_termination_message("Traceback (most recent call last):\n  ...") is None
    assert parse_termination_message("\nEfaDevicesMissing: x\nmore") == ("EfaDevicesMissing", "x")
    with pytest.raises(ValueError):
        format_termination_message("NotAReason", "x")
    assert len(set(REASONS)) == 6 and preflight.DEFAULT_TERMINATION_LOG == "/dev/termination-log"
