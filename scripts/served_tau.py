"""τ of exported drafters under vLLM's parallel drafting, against d3d's offline estimator (docs/serving.md).

    python scripts/served_tau.py --served <export folder> [<export folder> ...] --out docs/results/<name>.json \
        [--new-tokens 96] [--prompts 12] [the export's overrides, e.g. +experiment=pipeline_qwen train.val_size=12]

For each folder written by d3d.export: the held-out prompts of its training (d3d.examples.held_out, the
split d3d.train and d3d.export make from the train.* overrides and seed), run greedy by vLLM (its own environment: .venv-vllm, or D3D_VLLM_PYTHON)
without the draft and with the folder's speculative_config. Records per folder: whether the outputs are
equal, vLLM's mean acceptance length (1 + accepted / drafts) and per-position acceptance counts, d3d's
prediction of it from the folder (d3d.serving.engine_tau) and export.json's offline τ (d3d's loop and the
causal pass, on the same held-out responses). Written to --out as one JSON record with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def vllm_run(job: dict, python: Path, work: Path, name: str) -> dict:
    (work / f"{name}.in.json").write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(python), str(ROOT / "tests" / "vllm_spec_run.py"), str(work / f"{name}.in.json"),
                    str(work / f"{name}.out.json")], env=env, check=True, capture_output=True)
    return json.loads((work / f"{name}.out.json").read_text())


def cpu() -> dict:
    info = {"machine": platform.machine()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        info["model"] = fields.get("Model name", "").strip()
        flags = fields.get("Flags", "").split()
        info["flags"] = [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")]
    except OSError:
        pass
    info["cores_visible"] = os.cpu_count()
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("overrides", nargs="*", help="the export's overrides: what decides the held-out split")
    args = ap.parse_args()

    from d3d.config import compose
    from d3d.examples import held_out
    from d3d.models.drafter import SavedDrafter
    from d3d.serving import engine_tau
    from d3d.settings import bind_config

    python = Path(os.environ.get("D3D_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        sys.exit(f"error: no vLLM environment at {python}: run `make vllm-env` (or set D3D_VLLM_PYTHON)")
    cfg = bind_config(compose("export", args.overrides), "export")
    held = held_out(cfg.train, cfg.seed).val
    prompts = [list(ex.ids[: ex.prompt_len]) for ex in list(held)[: args.prompts]]
    record = {"cpu": cpu(), "responses": cfg.train.responses_dir, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "dtype": args.dtype, "drafters": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for folder in map(Path, args.served):
            exported = json.loads((folder / "export.json").read_text())
            spec = json.loads((folder / "speculative_config.json").read_text())
            k = spec["num_speculative_tokens"]
            job = {"target": exported["target_path"], "prompts": prompts, "dtype": args.dtype, "ignore_eos": True}
            plain = vllm_run({**job, "max_tokens": args.new_tokens + k + 1, "speculative_config": None}, python,
                             work, "plain")
            drafted = vllm_run({**job, "max_tokens": args.new_tokens, "speculative_config": spec}, python, work,
                               "drafted")
            metrics = drafted["metrics"]
            model, _ = SavedDrafter.named(folder, "--served").load(dtype="float32")
            record["drafters"].append({
                "served": str(folder), "source": exported["source"],
                "trained_block_attention": exported["trained_block_attention"], "k": k,
                "outputs_equal": drafted["outputs"] == [o[: args.new_tokens] for o in plain["outputs"]],
                "vllm_tau": 1 + metrics["num_accepted_tokens"] / metrics["num_drafts"],
                "d3d_predicted_vllm_tau": engine_tau(model, prompts, plain["outputs"], args.new_tokens, k),
                "vllm_metrics": metrics, "offline": exported.get("measured")})
            print(json.dumps(record["drafters"][-1]), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
