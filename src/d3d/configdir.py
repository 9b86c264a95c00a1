"""Where the Hydra config tree lives (no OmegaConf import: scripts/gpu_train_check.py reads the
training defaults from it on machines without Hydra).

The tree is the top-level `conf/` of the repository. An installed wheel carries a copy as
`d3d/conf` (pyproject maps it there); an editable install or a source checkout reads `conf/`
two levels above this package. One function, `config_dir()`, decides, so the jobs and the tests
always compose the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def config_dir() -> Path:
    """The conf/ folder: $D3D_CONFIG_DIR, else the wheel's copy, else the checkout's."""
    candidates = []
    if os.environ.get("D3D_CONFIG_DIR"):
        candidates.append(Path(os.environ["D3D_CONFIG_DIR"]))
    candidates += [PACKAGE_DIR / "conf", PACKAGE_DIR.parents[1] / "conf"]
    for path in candidates:
        if (path / "generate.yaml").is_file():
            return path
    raise FileNotFoundError(
        "d3d cannot find its Hydra configs (conf/). Looked in: "
        + ", ".join(str(p) for p in candidates)
        + ". Reinstall the package (pip install -e . from the repository) or set D3D_CONFIG_DIR."
    )
