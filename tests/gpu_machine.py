"""Run a script or module as on the lent GPU machines, whose image has torch, transformers,
accelerate and pytest but no Hydra, OmegaConf, datasets or DeepSpeed: importing any of those fails.

    python tests/gpu_machine.py scripts/gpu_check.py --device cpu --toy
    python tests/gpu_machine.py -m pytest --collect-only tests/integration/test_gpu.py
"""

import importlib.abc
import importlib.util
import runpy
import sys

ABSENT = {"hydra", "omegaconf", "datasets", "deepspeed"}


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machines)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
_find_spec = importlib.util.find_spec  # transformers asks find_spec whether deepspeed is installed
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in ABSENT else _find_spec(name, package)

if __name__ == "__main__":
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
