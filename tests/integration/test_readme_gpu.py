"""Each recipe line of the README's GPU section, run on this CPU as one process with the Hub off,
gets to the point where it needs a GPU, the Hub or the previous stage's output and stops there with
one `error:` line and exit status 2: no traceback, no half-written output. `accelerate launch` and
torchrun lines run as plain `python -m` here (one process is what a CPU offers; the multi-process
paths have their own torchrun tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.unit.test_readme_gpu import commands, hydra_call

pytestmark = pytest.mark.heavy  # a fresh interpreter per line, ~10 s each


@pytest.mark.parametrize("line", [line for line in commands() if hydra_call(line)])
def test_recipe_line_stops_with_one_error_line(line, tmp_path):
    job, overrides = hydra_call(line)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "HYDRA_FULL_ERROR": "0"}
    env.pop("D3D_VERBOSE", None)
    argv = [sys.executable, "-m", f"d3d.{job}", *overrides, f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/hydra", f"hydra.sweep.dir={tmp_path}/hydra"]
    run = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    err = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr, f"{line!r} on a CPU without the Hub:\n{run.stderr[-3000:]}"
    assert run.returncode == 2 and err and err[-1].startswith("error: "), (
        f"{line!r}: exit {run.returncode}, stderr ends {err[-3:]}")
