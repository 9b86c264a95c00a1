"""Per-GPU peak memory of d3d.train, estimated analytically for the GPU overlays under each accelerate
config, and the estimate checked against a measured peak at small size on the CPU.

    python scripts/memory_plan.py                      # qwen3_8b and qwen3_32b overlays, every config
    python scripts/memory_plan.py --validate           # + formula vs measured tensor peak, tiny model, CPU

The estimate (bytes) = model states + activations + loss + mask, per GPU:
- model states, P parameters, n GPUs, AdamW: DDP 4P weights + 4P grads + 8P Adam + 4P DDP buckets;
  FSDP2 (bf16 compute) (16P)/n + 2 gathered layers in bf16; ZeRO-2 2P bf16 weights + 2P bf16 grad
  buckets + (4P master + 8P Adam + 2P grads)/n; ZeRO-3 (2P + 4P + 8P + 2P)/n + 2 gathered layers.
- activations for N = batch_size x (max_len + anchors x B) packed tokens, a = bytes per element
  (2 in bf16): with gradient checkpointing L x N x d x a (each layer's input) + one layer's
  activations; without, L x that. One layer: N x (6d + 4 q/kv widths + 5 ffn) x a (the tensors
  autograd saves in a Qwen3 decoder layer: norms, q/k/v/o, gate/up/act/down; fitted by --validate).
- loss: chunk_rows x V x 4 bytes x 3 (fp32 logits, their softmax, the gradient), and the gathered
  hidden rows; the mask: one dense bool (b, T, T) and SDPA's additive copy per live layer (flex: ~0).
Not counted: allocator fragmentation and the CUDA context (~1-3 GB): the plan keeps 25 % headroom.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

GB = 1e9
HBM = {"H200": 141e9, "H100": 80e9}


@dataclass
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: float


# Qwen3-1.7B: the drafter of both overlays (the target is not loaded while training).
QWEN3_1P7B = Shape(layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128, vocab=151936, params=1.72e9)
SHAPES = {"qwen3_1p7b": QWEN3_1P7B}
CONFIGS = ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]


def layer_params(s: Shape) -> float:
    return 2 * s.hidden * (s.heads + s.kv_heads) * s.head_dim + 3 * s.hidden * s.ffn


def layer_activation_elems(s: Shape, tokens: int) -> float:
    """Elements autograd keeps for one decoder layer's backward."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return tokens * (6 * s.hidden + 2 * q + 2 * kv + 5 * s.ffn)


def estimate(s: Shape, config: str, gpus: int, batch: int, seq: int, rows: int, chunk_rows: int,
             checkpointing: bool, act_bytes: int = 2, flex: bool = True) -> dict:
    P, n = s.params, gpus
    states = {"ddp": 20 * P, "fsdp": 16 * P / n + 2 * 2 * layer_params(s),
              "deepspeed_zero2": 4 * P + 14 * P / n, "deepspeed_zero3": 16 * P / n + 2 * 2 * layer_params(s)}[config]
    tokens = batch * seq
    one_layer = layer_activation_elems(s, tokens) * act_bytes
    inputs = s.layers * tokens * s.hidden * act_bytes
    acts = inputs + one_layer if checkpointing else s.layers * one_layer + inputs
    acts += 2 * tokens * s.hidden * 4  # final norm output and its fp32 copy
    loss = 3 * min(chunk_rows, rows) * s.vocab * 4 + rows * s.hidden * (act_bytes + 4)
    live_layers = 1 if checkpointing else s.layers
    mask = 0 if flex else batch * seq * seq * (1 + live_layers * act_bytes)
    total = states + acts + loss + mask
    return {"states_gb": states / GB, "activations_gb": acts / GB, "loss_gb": loss / GB, "mask_gb": mask / GB,
            "total_gb": total / GB}


def overlay_plan(name: str, gpus: int) -> list[dict]:
    from d3d.config import compose
    from d3d.settings import bind_config

    cfg = bind_config(compose("train", [f"+experiment={name}"]), "train")
    tc = cfg.train
    B = cfg.drafter.block_size
    seq = tc.max_len + tc.anchors_per_seq * B
    rows = tc.batch_size * (tc.anchors_per_seq * B + tc.max_len)  # denoise + AR rows, at most
    s = SHAPES[cfg.drafter.name]
    flex = (cfg.drafter.model or cfg.target).attn_implementation == "flex_attention"  # d3d.models.drafter.drafter_attention
    out = []
    for config in CONFIGS:
        est = estimate(s, config, gpus, tc.batch_size, seq, rows, tc.loss_chunk_rows, tc.gradient_checkpointing,
                       flex=flex)
        out.append({"overlay": name, "config": config, "micro_batch": tc.batch_size, "packed_len": seq, **est})
    return out


class TensorPeak:
    """Peak bytes of live tensor storage while active (CPU): every new storage an op creates is
    counted until it is freed. Parameters and inputs alive before entering count as `base`."""

    def __init__(self, base: int = 0):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live, self.peak, self.base, self.seen = 0, 0, base, set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch

                for t in (out if isinstance(out, (tuple, list)) else [out]):
                    if isinstance(t, torch.Tensor):
                        tracker._add(t)
                return out

        self.mode = Mode()

    def _add(self, t) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.seen or st.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)

        def free(key=key, n=st.nbytes()):
            self.seen.discard(key)
            self.live -= n

        weakref.finalize(st, free)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def validate(checkpointing: bool) -> dict:
    """One fp32 training step of a small Qwen3 on CPU (one process): measured tensor peak (activations,
    loss, gradients; weights and Adam counted from their sizes) against the formula at that shape."""
    import torch

    from d3d.models.random_models import SHAPES, random_model
    from d3d.objective import Example, ObjectiveConfig, pack
    from d3d.training import D3DTrainingStep, enable_activation_checkpointing

    f = SHAPES["memory_plan"]
    s = Shape(layers=f["num_hidden_layers"], hidden=f["hidden_size"], ffn=f["intermediate_size"],
              heads=f["num_attention_heads"], kv_heads=f["num_key_value_heads"], head_dim=f["head_dim"],
              vocab=f["vocab_size"], params=0)
    model = random_model("memory_plan", "cpu", torch.float32, seed=0, attn="sdpa").train()
    if checkpointing:
        enable_activation_checkpointing(model)
    s.params = sum(p.numel() for p in model.parameters())
    batch_size, length, anchors, B, chunk = 2, 768, 16, 16, 512
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(1, s.vocab - 1, (length,), generator=g).tolist(), 64) for _ in range(batch_size)]
    batch = pack(examples, ObjectiveConfig.shipped(B, anchors_per_seq=anchors), s.vocab - 1, 0, g)
    step = D3DTrainingStep(model, s.vocab, 1.0, loss_chunk_rows=chunk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with TensorPeak() as tp:  # forward + backward: activations, loss, gradients
        loss, _ = step(batch)
        loss.backward()
    opt.step()
    measured = tp.peak + 4 * s.params + 8 * s.params  # + weights + Adam (allocated at the first step)
    rows = len(batch.dn_rows) + len(batch.ar_rows)
    seq = batch.input_ids.shape[1]
    # one process, fp32: states = weights + grads + Adam (no DDP buckets); dense SDPA mask (bool only on CPU)
    est = estimate(s, "ddp", 1, batch_size, seq, rows, chunk, checkpointing, act_bytes=4, flex=True)
    est_total = est["total_gb"] * GB - 4 * s.params + batch_size * seq * seq  # no DDP bucket copy; + bool mask
    return {"checkpointing": checkpointing, "params": s.params, "packed_tokens": batch_size * seq,
            "measured_mb": round(measured / 2**20, 1), "estimated_mb": round(est_total / 2**20, 1),
            "ratio": round(est_total / measured, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu", default="H200", choices=sorted(HBM))
    ap.add_argument("--validate", action="store_true")
    args = ap.parse_args()
    budget = HBM[args.gpu] / GB
    print(f"per-GPU peak estimate (GB), {args.gpus} x {args.gpu} ({budget:.0f} GB; fits = under 75 % of it)")
    print(f"{'overlay':10} {'config':16} {'states':>7} {'activ.':>7} {'loss':>6} {'mask':>5} {'total':>7}  fits")
    for name in ("qwen3_8b", "qwen3_32b"):
        for r in overlay_plan(name, args.gpus):
            fits = r["total_gb"] < 0.75 * budget
            print(f"{r['overlay']:10} {r['config']:16} {r['states_gb']:7.1f} {r['activations_gb']:7.1f} "
                  f"{r['loss_gb']:6.1f} {r['mask_gb']:5.1f} {r['total_gb']:7.1f}  {'yes' if fits else 'NO'}")
    if args.validate:
        for ckpt in (False, True):
            v = validate(ckpt)
            print(f"validate (CPU, fp32, 1 process, checkpointing={ckpt}): measured {v['measured_mb']} MB, "
                  f"formula {v['estimated_mb']} MB, ratio {v['ratio']} ({v['params'] / 1e6:.1f}M params, "
                  f"{v['packed_tokens']} packed tokens)")


if __name__ == "__main__":
    main()
