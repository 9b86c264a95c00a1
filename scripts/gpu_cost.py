"""What a GPU run of the Qwen3 overlays costs: wall time and GPU-hours per stage on 8 x H100, an
estimate from stated inputs (each printed beside the table with its source), never a measurement.

    python scripts/gpu_cost.py                        # the Qwen3 overlays, markdown (docs/gpu.md)
    python scripts/gpu_cost.py +experiment=qwen3_8b_d8b --mfu 0.3 --reply-tokens 800

Per stage (N parameters of the model that runs, counted from its config.json numbers):
- generate: data.limit prompts x reply tokens at a published vLLM throughput per GPU (Llama 3.1 8B,
  bf16, one H100), scaled by 8B / N for a larger target (bandwidth- and compute-bound alike), on
  every GPU of the node (one engine per GPU).
- train: max_steps x the global batch (train.batch_size x grad_accum x GPUs) x packed tokens per
  sequence (prompt + reply + anchors x B, padding added) x FLOPs per token (6N, 8N with gradient
  checkpointing: the forward runs twice; N without an untied input embedding, a lookup; + attention
  4·L·heads·head_dim·(mean keys) per forward)
  over the node's bf16 dense peak at an assumed MFU.
- prune: per removed layer (prune.num_layers: the layers to remove, all of them: min_retention may stop
  it earlier), the layer sweep over prune.calib_size responses (one forward of the whole drafter and
  L/2 of its upper layers per response over [response | a block at every anchor]) + prune.recovery_steps
  training steps of the global batch (train.batch_size x grad_accum per GPU, as d3d.prune recovers),
  on the node (`accelerate launch -m d3d.prune`: responses split over the ranks, recovery sharded) at
  the same MFU.
- eval: every item of benchmark=all x eval.methods at one request. A round's device time reads the
  models' bf16 weights at a share of the HBM bandwidth: one target pass + one drafter pass (sync, tree)
  or the slower of the two when its row overlaps them (async, async_tree: d3d.decoding.methods), for
  an assumed τ tokens. Eager passes (decode.backend=eager, the overlays' default) are host-bound: the
  host issues each round's aten ops one after another (counted at Qwen3-8B structure, scaled by the
  layers that run), so an eager round takes the longer of its device time and its ops x µs per op;
  the host issues the drafter's ops too, overlap or not. On the GPUs the memory plan gives a request
  (two where the target needs its own, target.device_map).
Left out: model downloads, compile warm-up (~90 s per 8B graph and shape, docs/design.md), evaluation
and checkpoints inside training, prefill.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_plan as plan  # noqa: E402  (scripts/ is not a package)
from d3d.decoding.methods import method_row  # noqa: E402

OVERLAYS = ["qwen3_8b", "qwen3_32b", "qwen3_8b_d8b", "qwen3_32b_d8b"]


@dataclass
class Inputs:
    """Every number the estimate rests on; the metadata says where it comes from."""

    gpus: int = 8  # one node
    peak_flops: float = 989e12  # H100 SXM bf16 dense peak, FLOP/s (NVIDIA's datasheet: 1,979 with sparsity)
    mfu: float = 0.35  # assumed model-FLOPs utilisation of FSDP2 + gradient checkpointing at 2-8B
    hbm_bandwidth: float = 3.35e12  # H100 SXM HBM3, bytes/s (datasheet)
    bandwidth_share: float = 0.7  # assumed share of it a bf16 decode pass at batch 1 reaches
    vllm_tokens_per_s: float = 12_500  # output tok/s, Llama 3.1 8B bf16, 1 x H100 (published vLLM figures)
    prompt_tokens: int = 150  # assumed mean UltraChat first-turn prompt (chat template included)
    reply_tokens: int = 600  # assumed mean Qwen3 non-thinking reply (capped at generate.max_new_tokens)
    padding: float = 0.15  # padding share of a packed batch (issue 44's goal for the input pipeline)
    tau: float = 4.0  # assumed accepted tokens per target pass (the run measures it)
    host_us_per_op: float = 7.5  # host time to issue one eager aten op (docs/design.md: 5-10 µs)
    eager_ops_ar: int = 2_600  # aten ops of an eager AR round, Qwen3-8B structure (36 layers)
    eager_ops_sync: int = 5_200  # ... of a sync round (target pass + drafter pass, 36 + 36 layers)
    eager_ops_async: int = 7_600  # ... of an async round (target pass + the drafter's packed tray pass)
    # benchmark=all: gsm8k 128 + math500 128 + aime25 30 + humaneval 164 + mbpp 128 + livecodebench 128 + mt_bench 80
    eval_items: int = 786


SOURCES = {
    "peak_flops": "NVIDIA H100 SXM datasheet (bf16 dense)",
    "mfu": "assumption",
    "hbm_bandwidth": "NVIDIA H100 SXM datasheet",
    "bandwidth_share": "assumption",
    "vllm_tokens_per_s": "published vLLM benchmarks (~12.5k tok/s, Llama 3.1 8B, 1 x H100 80 GB)",
    "prompt_tokens": "assumption",
    "reply_tokens": "assumption",
    "padding": "issue 44's goal (≤ 15 %)",
    "tau": "assumption",
    "host_us_per_op": "docs/design.md (5-10 µs an op: the middle)",
    "eager_ops_ar": "docs/design.md (counted at Qwen3-8B structure)",
    "eager_ops_sync": "docs/design.md (counted at Qwen3-8B structure)",
    "eager_ops_async": "docs/design.md (counted at Qwen3-8B structure)",
    "eval_items": "conf/benchmark/*.yaml (n of each in benchmark=all)",
    "gpus": "one node",
}


def stage_rows(overrides: list[str], x: Inputs) -> list[dict]:
    """Wall seconds and GPUs held per stage of one overlay."""
    _, tcfg = plan.compose_overlay("train", overrides)
    raw_gen, gcfg = plan.compose_overlay("generate", overrides)
    _, pcfg = plan.compose_overlay("prune", overrides)
    ecfg_raw, ecfg = plan.compose_overlay("eval", overrides)
    d, t, _ = plan.overlay_shapes(tcfg)
    Nd, Nt = plan.params(d), plan.params(t)
    tc, B = tcfg.train, tcfg.drafter.block_size
    reply = min(x.reply_tokens, gcfg.generate.max_new_tokens)
    seq_clean = min(x.prompt_tokens + reply, tc.max_len)
    rows = []

    # generate: one engine per GPU, each with its share of the prompts
    per_gpu = x.vllm_tokens_per_s * 8e9 / Nt
    prompts = gcfg.data.limit
    rows.append({"stage": "generate", "gpus": x.gpus, "seconds": prompts * reply / (per_gpu * x.gpus),
                 "how": f"{prompts:,} prompts x {reply} tokens at {per_gpu:,.0f} tok/s per GPU"})

    def step_flops(s, seqs: int, ckpt: bool) -> float:
        tokens = seqs * (seq_clean + tc.anchors_per_seq * B) / (1 - x.padding)
        attn = 4 * s.layers * s.heads * s.head_dim * seq_clean / 2  # per token per forward: mean keys ~ half the clean part
        matmul = plan.params(s) - (0 if s.tied else s.vocab * s.hidden)  # an untied input embedding is a lookup
        return tokens * ((8 if ckpt else 6) * matmul + (4 if ckpt else 3) * attn)

    node = x.peak_flops * x.mfu
    global_batch = tc.batch_size * tc.grad_accum * x.gpus
    train_s = tc.max_steps * step_flops(d, global_batch, tc.gradient_checkpointing) / (node * x.gpus)
    rows.append({"stage": "train", "gpus": x.gpus, "seconds": train_s,
                 "how": f"{tc.max_steps:,} steps x {global_batch} sequences, {plan.params(d) / 1e9:.1f}B drafter, "
                        f"MFU {x.mfu:.0%}"})

    # prune under `accelerate launch`: the sweep's responses split over the ranks, recovery at
    # train.batch_size per rank through the sharded step
    pc = pcfg.prune
    T = seq_clean - 1 + reply * B
    sweep = pc.calib_size * 2 * Nd * T * (1 + d.layers / 2)
    recovery = pc.recovery_steps * step_flops(d, global_batch, tc.gradient_checkpointing)
    prune_s = pc.num_layers * (sweep + recovery) / (node * x.gpus)
    rows.append({"stage": "prune", "gpus": x.gpus, "seconds": prune_s,
                 "how": f"{pc.num_layers} layers removed x (sweep of {pc.calib_size} responses + {pc.recovery_steps} "
                        f"recovery steps of {global_batch} sequences)"})

    # eval: one request at a time, each pass memory-bound
    def pass_s(n: int) -> float:
        return 2 * n / (x.hbm_bandwidth * x.bandwidth_share)

    def host_s(row, eager: bool) -> float:
        """Host seconds to issue one round's aten ops (0 for a compiled backend: CUDA graphs replay)."""
        if not eager:
            return 0.0
        if not row.needs_drafter:
            return x.eager_ops_ar * t.layers / 36 * x.host_us_per_op * 1e-6
        ops = x.eager_ops_async if row.overlaps else x.eager_ops_sync
        return ops * (t.layers + d.layers) / 72 * x.host_us_per_op * 1e-6

    def per_token_s(name: str) -> float:
        """Seconds per token of eval method `name`, by its row of the table: one target pass a token
        without a drafter; else a target and a drafter pass per τ tokens, the slower of the two when
        the row overlaps them (the drafter's tray pass beside verification), their sum when not; an
        eager round no shorter than the host's time to issue its ops."""
        row = method_row(ecfg_raw.methods[name].method)
        eager = decode[name].backend == "eager"
        if not row.needs_drafter:
            return max(pass_s(Nt), host_s(row, eager))
        return max((max if row.overlaps else sum)((pass_s(Nt), pass_s(Nd))), host_s(row, eager)) / x.tau

    from d3d.settings import method_configs

    decode = method_configs(ecfg_raw, ecfg.eval)

    methods = list(ecfg.eval.methods)
    eval_reply = min(x.reply_tokens, ecfg.eval.max_new_tokens)
    eval_s = sum(x.eval_items * eval_reply * per_token_s(m) for m in methods)
    decode_gpus = max(plan.decode_gpus(r, "H100") for r in plan.decode_plan(overrides, 1))  # target.device_map when > 1
    backends = sorted({decode[m].backend for m in methods})
    rows.append({"stage": "eval", "gpus": decode_gpus, "seconds": eval_s,
                 "how": f"{x.eval_items} items x {eval_reply} tokens x {'/'.join(methods)}, τ {x.tau}, "
                        f"{'/'.join(backends)}"})
    return rows


def markdown(overlays: list[str], x: Inputs) -> str:
    lines = [f"Estimates on {x.gpus} x H100 80 GB (not measurements; inputs below).", "",
             "| overlay | stage | wall | GPUs | GPU-hours | from |", "|---|---|---|---|---|---|"]
    for name in overlays:
        total = 0.0
        for r in stage_rows([f"+experiment={name}"], x):
            hours = r["seconds"] / 3600
            total += hours * r["gpus"]
            wall = f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"
            lines.append(f"| {name} | {r['stage']} | {wall} | {r['gpus']} | {hours * r['gpus']:.1f} | {r['how']} |")
        lines.append(f"| {name} | **all** | | | **{total:.0f}** | |")
    lines += ["", "| input | value | source |", "|---|---|---|"]
    lines += [f"| {f.name} | {getattr(x, f.name):g} | {SOURCES[f.name]} |" for f in fields(Inputs)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overlays", nargs="*", default=OVERLAYS, help="experiment names")
    for f in fields(Inputs):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=SOURCES[f.name])
    args = ap.parse_args()
    x = Inputs(**{f.name: getattr(args, f.name) for f in fields(Inputs)})
    print(markdown([o.removeprefix("+experiment=") for o in args.overlays], x))


if __name__ == "__main__":
    main()
