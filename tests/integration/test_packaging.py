"""The installed wheel carries the Hydra configs, and the jobs find them from there."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.heavy  # builds and installs the wheel with pip
def test_wheel_carries_configs_and_jobs_find_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True, text=True)
    wheel = next((tmp_path / "dist").glob("d3d-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "d3d/conf/generate.yaml" in names and "d3d/conf/benchmark/all.yaml" in names
    assert "d3d/generate.py" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    # Run from a folder outside the checkout, with only the installed copy importable.
    code = ("import d3d.config as c, d3d.configdir; print(d3d.configdir.config_dir()); "
            "cfg = c.compose('generate', ['+experiment=smoke']); print(cfg.target.name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    conf_dir, target = out.stdout.split()
    assert conf_dir == str(site / "d3d" / "conf") and target == "tiny_random"
    job = subprocess.run([sys.executable, "-m", "d3d.generate", "--cfg", "job", "generate.batch_size=3"],
                         cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert job.returncode == 0, job.stderr[-2000:]
    assert "batch_size: 3" in job.stdout
