"""Stand-ins for a SLURM cluster on this one machine: `srun` and `scontrol` executables (put first on
PATH) and `sbatch`, which runs a batch script as sbatch would, with the variables it sets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def rendezvous_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up), where no outgoing connection of a
    process running beside the test can take it between this check and the rendezvous' bind."""
    import random
    import socket

    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def sbatch(script: Path, args: list[str], nodes: int, gpus_per_node: int, port: int, timeout: float = 600,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`sbatch --nodes N --gpus-per-node G script args...` on localhost: the batch shell runs on node 0
    (SLURM_NODEID=0, as there), the stand-in srun starts one task per node. A run past `timeout` is
    ended whole (the batch shell, srun, every task) and returns status 124 with what it printed."""
    env = {**os.environ, "PATH": os.pathsep.join([str(HERE), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "d3d", "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": ",".join(["localhost", *["127.0.0.1"] * (nodes - 1)]),
           "SLURM_GPUS_PER_NODE": str(gpus_per_node), "SLURM_GPUS_ON_NODE": str(gpus_per_node),
           "SLURM_NTASKS": str(nodes), "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_SUBMIT_DIR": str(ROOT), "D3D_MAIN_PORT": str(port), **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID"):
        env.pop(name, None)  # a batch shell is no task of a job step
    proc = subprocess.Popen(["bash", str(script), *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)  # the batch shell's session: srun, its tasks (own process groups) and theirs
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, 124, out, err)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (started with start_new_session: its leader's pid)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
