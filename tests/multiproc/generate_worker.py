"""One rank of a real data-parallel generation, started by `torchrun --nproc_per_node N` from
tests/integration/test_generate.py, with the stub engine (tests/stub_engine.py) standing in for vLLM.
Its rank, world size and local rank come from torchrun's environment, as on a GPU node.

    torchrun --nproc_per_node 2 tests/multiproc/generate_worker.py [--kill-rank-1-after K] ROOT_DIR [hydra overrides]

`--kill-rank-1-after K`: rank 1 SIGKILLs itself once K of its rows are on disk (a node lost mid-run).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` importable when run as a script

from d3d.generate import run_generate  # noqa: E402
from d3d.utils.io import JsonlWriter  # noqa: E402
from tests.conftest import compose  # noqa: E402
from tests.stub_engine import use_stub  # noqa: E402


def kill_after(rows: int) -> None:
    real, writes = JsonlWriter.write, []

    def write(self, batch):
        if sum(writes) >= rows:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, batch)
        writes.append(len(batch))

    JsonlWriter.write = write


def main() -> None:
    args = sys.argv[1:]
    if args[0] == "--kill-rank-1-after":
        if os.environ["RANK"] == "1":
            kill_after(int(args[1]))
        args = args[2:]
    use_stub()
    run_generate(compose("generate", args[1:], Path(args[0])))


if __name__ == "__main__":
    main()
