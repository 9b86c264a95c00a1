"""Per-GPU peak memory of d3d.train, d3d.prune and decoding, estimated analytically for any drafter
shape under each engine, and checked against peaks measured on the CPU at small size.

    python scripts/memory_plan.py                                   # the GPU overlays, every engine, 8 x H200
    python scripts/memory_plan.py +experiment=qwen3_8b_d8b --gpu H100   # any overlay (Hydra overrides)
    python scripts/memory_plan.py --shape 36,4096,12288,32,8,128,151936 --engine fsdp   # a shape by hand
    python scripts/memory_plan.py --markdown                        # docs/gpu.md's fit tables
    python scripts/memory_plan.py --validate                        # formula vs measured peak, toy model, CPU
    torchrun --nproc_per_node 2 scripts/memory_plan.py --validate   # the same with two ranks (sharding)

Training, per GPU (P parameters, n GPUs, bf16 mixed precision as d3d.train runs on CUDA):
- model states: bytes per parameter kept whole on every GPU or split over the n (ENGINES), plus, for
  the engines that gather, the root unit (embeddings, head: weights, gradient and, on several GPUs,
  its reduce-scatter buffer) and two decoder layers (the one running, the one prefetched; one
  layer's gradient) unsharded in the compute dtype;
  single/DDP keep fp32 weights, so autocast caches a bf16 copy of every weight in the forward (2P).
- activations of N = micro-batch x (max_len + anchors x B) packed tokens, a bytes per element: with
  gradient checkpointing each layer's input (L x N x d x a) + one layer's activations recomputed in
  backward (after the loss's backward has freed its buffers: the larger of the two counts); without,
  every layer's, alive with the loss. One layer: N x (6d + 2 q + 2 kv + 5 ffn) x a (the tensors autograd
  saves in a Qwen3 decoder layer: norms, q/k/v/o, gate/up/act/down), + the final norm's output in fp32.
- loss: chunk_rows x V x 4 bytes x 3 (fp32 logits, their softmax, the gradient; train.loss_chunk_rows)
  + the gathered hidden rows; mask: one dense bool (b, T, T) and SDPA's copy per live layer (flex: 0).
Pruning: recovery is the training step at prune's batch (train.batch_size, one micro-batch, a fresh
AdamW; + a frozen fp32 teacher under prune.recovery_loss=distill); the layer sweep
(d3d.layer_scores) is inference on one response: fp32 weights, every layer's input and every
candidate's final hidden state over [response | a block at every anchor].
Pruning's layer sweep decodes a copy in the deployed dtype (bf16 on a GPU: d3d.models.drafter.as_deployed,
cast one parameter at a time) beside the fp32 drafter that recovery trains: 4 + 2 bytes a parameter.
Evaluation inside training (d3d.train.evaluate, every train.eval_every steps): the engine's states
between steps (gradients freed), the drafter it decodes (gathering engines: a bf16 copy without
grad, d3d.training.plain_drafter; single/DDP: autocast's bf16 copy of the fp32 weights), and the
estimator on the longest held-out response (train.max_len; train.val_max_new_tokens cuts it): its KV
cache, its widest pass (the prefix, or 64 anchors' blocks at once, d3d.estimator) and their logits.
Decoding: d3d.decoding.cost's bound (both models' weights and widest passes on one device).
Not counted: allocator fragmentation and the CUDA context (~1-3 GiB): a fit keeps 25 % headroom.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from d3d.decoding.cost import ModelShape  # noqa: E402

GIB = 1 << 30
HBM = {"H100": 81559 * 2**20, "H200": 143771 * 2**20}  # what torch.cuda reports: 79.6 and 140.4 GiB
HEADROOM = 0.75  # a plan fits when its estimate is under this share of the GPU
OVERLAYS = ["qwen3_8b", "qwen3_32b", "qwen3_8b_d8b", "qwen3_32b_d8b"]


# ---------------------------------------------------------------------------- shapes


def shape_of_config(config: dict, attn: str | None = "sdpa") -> ModelShape:
    """A config.json's numbers (weights counted in bytes of 1: weight_bytes() is the parameter count)."""
    from types import SimpleNamespace

    return ModelShape.of_config(SimpleNamespace(**{"tie_word_embeddings": False, **config}), 1, attn)


def spec_shape(spec) -> ModelShape:
    """A model spec's shape (conf/target/*.yaml, a drafter's `model`): a published config known by
    name (d3d.models.random_models.SHAPES holds their config.json), a tiny spec's own numbers, or the
    config.json of a local folder. Never the Hub: a plan runs anywhere."""
    from d3d.errors import ConfigError
    from d3d.models.random_models import SHAPES

    if spec.name in SHAPES:
        return shape_of_config(SHAPES[spec.name], spec.attn_implementation)
    if spec.tiny:
        return shape_of_config(dict(spec.tiny), spec.attn_implementation)
    if spec.path and (Path(spec.path).expanduser() / "config.json").is_file():
        config = json.loads((Path(spec.path).expanduser() / "config.json").read_text())
        return shape_of_config(config, spec.attn_implementation)
    raise ConfigError(f"model {spec.name!r}: no shape known without the Hub. Fix: point its path at a folder with "
                      f"config.json, or give the shape by hand (--shape layers,hidden,ffn,heads,kv_heads,head_dim,vocab).")


def drafter_shape(drafter, target) -> ModelShape:
    """What the drafter's init builds (as d3d.decoding.cost._drafter_shape decides it for decoding)."""
    if drafter.init == "pretrained" and drafter.model is not None:
        return spec_shape(drafter.model)
    if drafter.init == "target_layers" and drafter.layers:
        return spec_shape(target).with_layers(len(drafter.layers))
    return spec_shape(target)


def params(s: ModelShape) -> int:
    return replace(s, dtype_bytes=1).weight_bytes()


def layer_params(s: ModelShape) -> int:
    return params(s.with_layers(1)) - params(s.with_layers(0))


# ---------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    """Model-state bytes per parameter on each GPU under bf16 mixed precision."""

    replicated: float  # kept whole on every GPU
    sharded: float  # split over the GPUs
    gathers: bool  # unshards the root unit and a decoder layer at a time (+ the next one, prefetched)
    fp32_weights: bool  # full fp32 weights under autocast: a bf16 copy of each is cached in the forward
    states: str  # what the bytes are
    grads_freed: float = 0  # bytes per parameter of gradients that zero_grad frees between steps (in `sharded`
    #                         when the engine shards, else in `replicated`); DeepSpeed keeps its buffers


ENGINES = {
    "single": Engine(16, 0, False, True, "fp32 weights 4 + grads 4 + AdamW m, v 8, all whole", 4),
    "ddp": Engine(20, 0, False, True, "as single + DDP's fp32 gradient buckets 4, all whole", 4),
    "fsdp": Engine(0, 16, True, False, "FSDP2 full shard: fp32 weights 4, grads 4, AdamW 8, all sharded; "
                                       "layers gathered in bf16, gradients reduced in fp32", 4),
    "deepspeed_zero2": Engine(4, 14, False, False, "bf16 weights 2 + bf16 grad buckets 2 whole; fp32 master 4 + "
                                                   "AdamW 8 + bf16 grad partition 2 sharded"),
    "deepspeed_zero3": Engine(0, 16, True, False, "bf16 weights 2, grads 2, fp32 master 4, AdamW 8, all sharded; "
                                                  "layers gathered in bf16"),
}


@dataclass(frozen=True)
class Step:
    """One micro-batch of the training step, as train.* sizes it."""

    batch: int  # sequences per micro-batch (train.batch_size)
    seq: int  # packed length: max_len + anchors_per_seq x B
    rows: int  # loss rows at most: denoising + AR
    chunk_rows: int  # train.loss_chunk_rows
    checkpointing: bool  # train.gradient_checkpointing
    flex: bool  # flex_attention: a BlockMask, no dense mask
    act_bytes: int = 2  # 2 under bf16 autocast, 4 in fp32


def step_of(tc, block_size: int, flex: bool, checkpointing: bool | None = None, act_bytes: int = 2) -> Step:
    seq = tc.max_len + tc.anchors_per_seq * block_size
    rows = tc.batch_size * (tc.anchors_per_seq * block_size + tc.max_len)
    ckpt = tc.gradient_checkpointing if checkpointing is None else checkpointing
    return Step(tc.batch_size, seq, rows, tc.loss_chunk_rows, ckpt, flex, act_bytes)


def layer_activation_elems(s: ModelShape, tokens: int) -> int:
    """Elements autograd keeps for one decoder layer's backward."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return tokens * (6 * s.hidden + 2 * q + 2 * kv + 5 * s.intermediate)


def train_peak(s: ModelShape, engine: str, gpus: int, step: Step, mixed: bool = True, teacher_bytes: int = 0) -> dict:
    """Bytes per GPU of one training step, by term (module docstring). `mixed`: bf16 mixed precision
    (gathered layers in bf16, autocast's weight copy); `teacher_bytes`: a frozen model beside it."""
    e, P, a = ENGINES[engine], params(s), step.act_bytes
    states = e.replicated * P + e.sharded * P / gpus
    compute = 2 if mixed else 4
    root = P - s.layers * layer_params(s)
    # gathered: the root's weights and its gradient (the head's comes first in backward and is reduced
    # last), two layers' weights (running, prefetched) and one layer's gradient before its reduce-scatter;
    # on more than one GPU the reduce-scatter copies a unit's gradients into one buffer first (the root's
    # is the largest; one rank reduces nothing)
    units = 2 * root + 3 * layer_params(s) + (root if gpus > 1 else 0)
    gathered = compute * units if e.gathers else 0
    cast = 2 * P if mixed and e.fp32_weights else 0
    tokens = step.batch * step.seq
    one_layer = layer_activation_elems(s, tokens) * a
    inputs = s.layers * tokens * s.hidden * a
    acts = inputs + (0 if step.checkpointing else s.layers * one_layer) + 2 * tokens * s.hidden * 4
    loss = 3 * min(step.chunk_rows, step.rows) * s.vocab * 4 + step.rows * s.hidden * (a + 4)
    if step.checkpointing:  # backward runs the loss first, then recomputes one layer at a time: never both
        acts += max(one_layer - loss, 0)
    live_layers = 1 if step.checkpointing else s.layers
    mask = 0 if step.flex else step.batch * step.seq ** 2 * (1 + live_layers * a)
    terms = {"states": states, "gathered": gathered + cast + teacher_bytes, "activations": acts, "loss": loss,
             "mask": mask}
    return {**terms, "total": sum(terms.values())}


def sweep_peak(s: ModelShape, prompt_len: int, response_len: int, block_size: int, flex: bool,
               weight_bytes: int = 4, act_bytes: int = 2) -> dict:
    """Bytes of d3d.layer_scores on one response: its packed forward is [response | a block at every
    anchor] (T = L - 1 + R x B tokens); it keeps every layer's input and every candidate's final
    hidden state, and runs one layer at a time without gradients. It runs on the deployed copy
    (act_bytes a weight) beside the drafter recovery trains (weight_bytes): both held ("states")."""
    T = prompt_len + response_len - 1 + response_len * block_size
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    deployed = params(s) * act_bytes if act_bytes != weight_bytes else 0
    terms = {"states": params(s) * weight_bytes, "gathered": deployed,
             "activations": (2 * s.layers + 1) * T * s.hidden * act_bytes
             + T * (2 * s.hidden + q + 2 * kv + 3 * s.intermediate) * act_bytes,
             "loss": response_len * s.vocab * (act_bytes + 4),  # one slot's head rows over every anchor
             "mask": 0 if flex else T * T * (1 + act_bytes)}
    return {**terms, "total": sum(terms.values())}


ESTIMATOR_CHUNK = 64  # anchors whose blocks d3d.estimator.match_lengths runs in one pass (its `chunk`)


def estimator_peak(s: ModelShape, length: int, block_size: int, flex: bool, act_bytes: int = 2,
                   chunk: int = ESTIMATOR_CHUNK) -> dict:
    """Bytes of d3d.estimator.match_lengths on one response of `length` tokens, without gradients:
    the KV cache of the prefix and a chunk of blocks, the wider of its two passes (the prefix, causal
    without a mask; `chunk` anchors' blocks under a mask over prefix + blocks) one layer at a time,
    and the chunk's logits at the B - 1 draft slots."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    blocks = min(chunk, length) * block_size
    keys = length - 1 + blocks
    widest = max(length - 1, blocks)
    return {"activations": 2 * s.layers * keys * kv * act_bytes
            + widest * (4 * s.hidden + q + 2 * kv + 3 * s.intermediate) * act_bytes,
            "loss": min(chunk, length) * (block_size - 1) * s.vocab * act_bytes,
            "mask": 0 if flex else blocks * keys * (1 + act_bytes)}


def evaluate_peak(s: ModelShape, engine: str, gpus: int, length: int, block_size: int, flex: bool,
                  mixed: bool = True) -> dict:
    """Bytes per GPU of d3d.train's in-training evaluation (module docstring): the engine's states
    with the gradients freed, the drafter it decodes, the estimator on one response of `length`."""
    e, P = ENGINES[engine], params(s)
    a = 2 if mixed else 4
    whole = e.replicated - (e.grads_freed if not e.sharded else 0)
    split = e.sharded - (e.grads_freed if e.sharded else 0)
    if e.gathers:
        # d3d.training.plain_drafter(..., inference=bf16): gathered in the decode dtype, a tensor at a
        # time; the largest (the embeddings) also in flight twice (the all-gather's output and its staging)
        weights = a * P + 2 * a * s.vocab * s.hidden
    else:
        weights = 2 * P if mixed and e.fp32_weights else 0  # autocast's cached bf16 copy of the fp32 weights
    terms = {"states": whole * P + split * P / gpus, "gathered": weights,
             **estimator_peak(s, length, block_size, flex, a)}
    return {**terms, "total": sum(terms.values())}


def decode_need(dc, row, shapes: dict[str, ModelShape], batch: int) -> dict[str, int]:
    """d3d.decoding.cost.check_fits's estimate, per model: weights + its widest pass (bytes)."""
    need = {}
    for model, q in row.widest(dc).items():
        if model in shapes:
            kv = q + dc.max_new_tokens
            need[model] = shapes[model].weight_bytes() + sum(shapes[model].pass_bytes(batch, q, kv).values())
    return need


# ---------------------------------------------------------------------------- overlays


def compose_overlay(root: str, overrides: list[str]):
    """(raw, bound) config of a root under overrides; composed once per (root, overrides) a process."""
    return _composed(root, tuple(overrides))


@functools.lru_cache(maxsize=None)
def _composed(root: str, overrides: tuple[str, ...]):
    from d3d.config import compose
    from d3d.settings import bind_config

    raw = compose(root, list(overrides))
    return raw, bind_config(raw, root)


def overlay_shapes(cfg) -> tuple[ModelShape, ModelShape, bool]:
    """(drafter, target, flex) of a bound config."""
    attn = (cfg.drafter.model or cfg.target).attn_implementation  # d3d.models.drafter.drafter_attention
    return drafter_shape(cfg.drafter, cfg.target), spec_shape(cfg.target), attn == "flex_attention"


def train_plan(overrides: list[str], gpus: int, engines=tuple(ENGINES)) -> list[dict]:
    """Training rows of an overlay (Hydra overrides of d3d.train's config), one per engine."""
    _, cfg = compose_overlay("train", overrides)
    s, _, flex = overlay_shapes(cfg)
    step = step_of(cfg.train, cfg.drafter.block_size, flex)
    return [{"stage": "train", "engine": e, "gpus": gpus, "params": params(s), "micro_batch": step.batch,
             "packed_len": step.seq, "checkpointing": step.checkpointing, "grad_accum": cfg.train.grad_accum,
             **train_peak(s, e, gpus if e != "single" else 1, step)} for e in engines]


def evaluate_plan(overrides: list[str], gpus: int, engines=tuple(ENGINES)) -> list[dict]:
    """The in-training evaluation's rows (train.eval_every), one per engine: the longest held-out
    response is train.max_len tokens, its response cut to train.val_max_new_tokens."""
    _, cfg = compose_overlay("train", overrides)
    s, _, flex = overlay_shapes(cfg)
    tc = cfg.train
    prompt = tc.max_len // 4
    length = prompt + min(tc.val_max_new_tokens or tc.max_len, tc.max_len - prompt)
    return [{"stage": "evaluate", "engine": e, "gpus": gpus, "params": params(s), "micro_batch": 1,
             "packed_len": length, "checkpointing": False,
             **evaluate_peak(s, e, gpus if e != "single" else 1, length, cfg.drafter.block_size, flex)}
            for e in engines]


def prune_plan(overrides: list[str], gpus: int, engines=tuple(ENGINES)) -> list[dict]:
    """Pruning rows: recovery through each engine (train.* of the overlay, as d3d.prune composes them,
    honouring train.gradient_checkpointing), and the layer sweep on one GPU (the longest response:
    max_len, of which the prompt is a quarter)."""
    raw, cfg = compose_overlay("prune", overrides)
    _, tcfg = compose_overlay("train", overrides)  # gradient_checkpointing is d3d.train's key
    s, _, flex = overlay_shapes(cfg)
    step = step_of(cfg.train, cfg.drafter.block_size, flex, tcfg.train.gradient_checkpointing)
    teacher = 4 * params(s) if cfg.prune.recovery_loss == "distill" else 0
    rows = [{"stage": "prune recovery", "engine": e, "gpus": gpus, "params": params(s), "micro_batch": step.batch,
             "packed_len": step.seq, "checkpointing": step.checkpointing,
             **train_peak(s, e, gpus if e != "single" else 1, step, teacher_bytes=teacher)} for e in engines]
    prompt = cfg.train.max_len // 4
    response = min(cfg.train.val_max_new_tokens or cfg.train.max_len, cfg.train.max_len - prompt)
    sweep = sweep_peak(s, prompt, response, cfg.drafter.block_size, flex)
    rows.append({"stage": "layer sweep", "engine": "single", "gpus": 1, "params": params(s),
                 "packed_len": prompt + response - 1 + response * cfg.drafter.block_size, **sweep})
    return rows


def decode_plan(overrides: list[str], batch: int) -> list[dict]:
    """Decoding rows of an overlay's eval methods (d3d.eval's config) at `batch` requests at once:
    the need on one device and split the way target.device_map would (the target over k GPUs, the
    drafter on its own)."""
    from d3d.settings import method_configs
    from d3d.decoding.cost import candidates
    from d3d.decoding.methods import method_row

    raw, cfg = compose_overlay("eval", overrides)
    d, t, _ = overlay_shapes(cfg)
    shapes = {"target": replace(t, dtype_bytes=2), "drafter": replace(d, dtype_bytes=2)}  # bf16 on CUDA
    rows = []
    for name, dc in method_configs(raw, cfg.eval).items():
        # a budget eval measures on the device: the widest setting it may choose
        need = max((decode_need(c, method_row(c.method), shapes, batch) for c in candidates(dc)),
                   key=lambda n: sum(n.values()))
        rows.append({"stage": f"decode {name}", "batch": batch, "target_bytes": need.get("target", 0),
                     "drafter_bytes": need.get("drafter", 0), "total": sum(need.values())})
    return rows


def fits(total: float, gpu: str) -> bool:
    return total <= HEADROOM * HBM[gpu]


DECODE_RESERVE = 3 * GIB  # the CUDA context and the allocator's reserve, beside what the bound counts


def decode_gpus(row: dict, gpu: str) -> int:
    """GPUs a decoding row needs: one when both models fit together (the bound as it stands), else
    the target over k GPUs beside a GPU of its own for the drafter (target.device_map)."""
    room = HBM[gpu] - DECODE_RESERVE
    if row["total"] <= room:
        return 1
    return -(-row["target_bytes"] // room) + (1 if row["drafter_bytes"] else 0)


# ---------------------------------------------------------------------------- measurement (CPU)


def measured_peak(fn) -> int:
    """Peak bytes of live CPU tensor memory while fn() runs, over what was live before: the profiler's
    allocator events (every alloc and free, a storage resized to 0 included, as FSDP2 frees the layers
    it gathered), summed in time order."""
    return measured_live(fn)[0]


def measured_live(fn) -> tuple[int, int]:
    """(peak, still live at the end) in bytes of CPU tensor memory fn() allocated (measured_peak)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live


TOY = dict(batch=2, length=512, anchors=16, block=16, chunk=512)  # the measured step


def toy_step(engine: str, checkpointing: bool, batch: int, bf16: bool = False) -> dict:
    """One training step (d3d.training.D3DTrainingStep + optimizer_step) of the "memory_plan" toy
    Qwen3 under `engine` in the running process group (gloo): measured peak per rank, from the wrap
    to the end of the second optimizer step (weights counted as live before it), against train_peak
    at that shape. d3d.prune's recovery is this step at its own batch. `bf16`: mixed precision as
    accelerate sets it up (bf16 autocast over fp32 weights; FSDP2 also gathers in bf16)."""
    import torch
    import torch.distributed as dist

    from d3d.models.random_models import SHAPES, random_model
    from d3d.objective import Example, ObjectiveConfig, pack
    from d3d.training import D3DTrainingStep, enable_activation_checkpointing

    s = shape_of_config(SHAPES["memory_plan"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = random_model("memory_plan", "cpu", torch.float32, seed=0, attn="sdpa").train()
    if checkpointing:
        enable_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(1, s.vocab - 1, (TOY["length"],), generator=g).tolist(), 64) for _ in range(batch)]
    packed = pack(examples, ObjectiveConfig.shipped(TOY["block"], anchors_per_seq=TOY["anchors"]), s.vocab - 1, 0, g)
    step = D3DTrainingStep(model, s.vocab, 1.0, loss_chunk_rows=TOY["chunk"])
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())

    if bf16:  # accelerate wraps the forward only: autocast's cached bf16 weights die with the forward
        step.forward = torch.autocast("cpu", torch.bfloat16)(step.forward)

    def run():
        module = step
        if engine == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(step)
        elif engine == "fsdp":  # what accelerate's TRANSFORMER_BASED_WRAP does: each decoder layer, then the root
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if bf16 else MixedPrecisionPolicy()
            for layer in model.base_model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(step, mp_policy=policy)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        for _ in range(2):  # the second step's forward runs beside AdamW's state: the steady peak
            # the ops of training.optimizer_step at one micro-batch, without its accelerator (the
            # wrappers are applied here, as accelerate would); no clip: FSDP2's norm is a DTensor here
            loss, _ = module(packed)
            loss.backward()
            opt.step()
            opt.zero_grad()

    measured = weights + measured_peak(run)
    rows = len(packed.dn_rows) + len(packed.ar_rows)
    est = train_peak(s, engine, world, Step(batch, packed.input_ids.shape[1], rows, TOY["chunk"], checkpointing,
                                             flex=False, act_bytes=2 if bf16 else 4), mixed=bf16)
    # on the CPU SDPA takes the bool mask as-is: no float copy per layer
    est_total = est["total"] - est["mask"] + batch * packed.input_ids.shape[1] ** 2
    return {"stage": "train" if batch == TOY["batch"] else "prune recovery", "engine": engine, "world": world,
            "checkpointing": checkpointing, "batch": batch, "precision": "bf16" if bf16 else "fp32",
            "measured_mb": measured / 2**20,
            "estimated_mb": est_total / 2**20, "ratio": est_total / measured}


@contextlib.contextmanager
def decoding_in_bf16(bf16: bool):
    """d3d's `auto` dtype is bf16 on a GPU; on this CPU it is what D3D_CPU_BF16 says (d3d.utils.hardware)."""
    old = os.environ.get("D3D_CPU_BF16")
    os.environ["D3D_CPU_BF16"] = "1" if bf16 else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["D3D_CPU_BF16"]
        else:
            os.environ["D3D_CPU_BF16"] = old


def toy_response():
    """One toy response (64 prompt + 192 response tokens) of the "memory_plan" toy Qwen3's vocabulary."""
    import torch

    from d3d.models.random_models import SHAPES
    from d3d.objective import Example

    s = shape_of_config(SHAPES["memory_plan"])
    g = torch.Generator().manual_seed(0)
    return Example(torch.randint(1, s.vocab - 1, (64 + 192,), generator=g).tolist(), 64)


def toy_sweep(bf16: bool = False) -> dict:
    """d3d.prune's layer sweep on one toy response (one process): d3d.layer_scores.score_layers on
    the deployed copy (as_deployed: bf16 where the drafter decodes in bf16, beside the fp32 drafter),
    measured against sweep_peak."""
    import torch

    from d3d.layer_scores import score_layers
    from d3d.models.drafter import as_deployed
    from d3d.models.random_models import SHAPES, random_model

    s = shape_of_config(SHAPES["memory_plan"])
    model = random_model("memory_plan", "cpu", torch.float32, seed=0, attn="sdpa")
    ex, B = toy_response(), TOY["block"]
    prompt, response = ex.prompt_len, len(ex.ids) - ex.prompt_len
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    with decoding_in_bf16(bf16):
        measured = weights + measured_peak(lambda: score_layers(as_deployed(model), [ex], B, s.vocab - 1, s.vocab))
    est = sweep_peak(s, prompt, response, B, flex=False, weight_bytes=4, act_bytes=2 if bf16 else 4)
    T = prompt + response - 1 + response * B
    est_total = est["total"] - est["mask"] + T * T  # the bool mask only on the CPU (as above)
    return {"stage": "layer sweep", "engine": "single", "world": 1, "checkpointing": False, "batch": 1,
            "precision": "bf16" if bf16 else "fp32",
            "measured_mb": measured / 2**20, "estimated_mb": est_total / 2**20, "ratio": est_total / measured}


def toy_evaluate(engine: str, bf16: bool) -> dict:
    """d3d.train's in-training evaluation of the toy Qwen3 under `engine` in the running process group:
    the step wrapped as toy_step wraps it (FSDP2 with d3d.training.fsdp_plugin's policy under bf16),
    one optimizer step and zero_grad (the states between steps), then d3d.training.plain_drafter and
    the estimator on one toy response under autocast, as d3d.train.evaluate runs them. Measured: what
    the model, its wrap and its step left live, and the evaluation's peak over it; against evaluate_peak."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from d3d.estimator import estimate_acceptance
    from d3d.models.random_models import SHAPES, random_model
    from d3d.objective import Example, ObjectiveConfig, pack
    from d3d.training import D3DTrainingStep, autocast, plain_drafter

    s = shape_of_config(SHAPES["memory_plan"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator().manual_seed(0)
    packed = pack([Example(torch.randint(1, s.vocab - 1, (128,), generator=g).tolist(), 32)],
                  ObjectiveConfig.shipped(TOY["block"], anchors_per_seq=4), s.vocab - 1, 0, g)
    precision = "bf16" if bf16 else "no"
    held = {}

    def train_one_step():  # the model is made in here: FSDP2 frees its whole weights once sharded
        model = random_model("memory_plan", "cpu", torch.float32, seed=0, attn="sdpa").train()
        step = D3DTrainingStep(model, s.vocab, 1.0, loss_chunk_rows=TOY["chunk"])
        if bf16:
            step.forward = torch.autocast("cpu", torch.bfloat16)(step.forward)
        module = step
        if engine == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(step)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
            for layer in model.base_model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(step, mp_policy=policy)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        loss, _ = module(packed)
        loss.backward()
        opt.step()
        opt.zero_grad()
        held.update(step=step, module=module, opt=opt)

    def evaluate():
        kind = DistributedType.FSDP if engine == "fsdp" else DistributedType.MULTI_CPU
        step = held["step"]
        acc = SimpleNamespace(unwrap_model=lambda m: step, distributed_type=kind)
        drafter = plain_drafter(acc, step, inference=torch.bfloat16 if bf16 else torch.float32)
        drafter.eval()
        with autocast(precision, "cpu"):
            estimate_acceptance(drafter, [toy_response()], TOY["block"], s.vocab - 1, s.vocab)

    _, left = measured_live(train_one_step)
    measured = left + measured_peak(evaluate)
    length = len(toy_response().ids)
    est = evaluate_peak(s, engine, world, length, TOY["block"], flex=False, mixed=bf16)
    blocks = min(ESTIMATOR_CHUNK, length) * TOY["block"]
    est_total = est["total"] - est["mask"] + blocks * (length - 1 + blocks)  # the bool mask only (as above)
    return {"stage": "evaluate", "engine": engine, "world": world, "checkpointing": False, "batch": 1,
            "precision": precision if bf16 else "fp32",
            "measured_mb": measured / 2**20, "estimated_mb": est_total / 2**20, "ratio": est_total / measured}


CASES = ["ddp:train", "ddp:train_ckpt", "ddp:prune", "ddp:train_ckpt_bf16", "fsdp:train", "fsdp:train_ckpt",
         "fsdp:prune", "fsdp:train_ckpt_bf16", "single:sweep", "single:sweep_bf16", "fsdp:evaluate_bf16"]
# ddp:evaluate_bf16 measures within 8 % (126.2 MB against 116.2) alone, but fell outside 15 % after the
# other cases in one two-rank process: not in the checked set until that is understood
EXTRA_CASES = ["ddp:evaluate_bf16"]


def validate(cases=tuple(CASES)) -> list[dict]:
    """The measured cases (engine:what; prune = the recovery step at its batch of one sequence,
    _bf16 = under bf16 mixed precision (the sweep and the evaluation decode in bf16), sweep = the layer
    sweep, one process; evaluate = the in-training evaluation after a step) in this process group
    (world size 1 unless under torchrun)."""
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    out = []
    for case in cases:
        engine, what = case.split(":")
        if what.startswith("sweep"):
            if dist.get_world_size() == 1:
                out.append(toy_sweep(bf16=what.endswith("bf16")))
            continue
        if what.startswith("evaluate"):  # one rank: at two the gloo gather's buffers move the peak (docs/gpu.md)
            if dist.get_world_size() == 1:
                out.append(toy_evaluate(engine, bf16=what.endswith("bf16")))
            continue
        out.append(toy_step(engine, what.startswith("train_ckpt"), 1 if what == "prune" else TOY["batch"],
                            bf16=what.endswith("bf16")))
    # each rank measured itself: the plan is per GPU, so the highest rank is the one that counts
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if own_group:
        dist.destroy_process_group()
    return [max(rows, key=lambda r: r["measured_mb"]) for rows in zip(*gathered)]


# ---------------------------------------------------------------------------- output


def gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def markdown(gpus: int) -> str:
    """docs/gpu.md's fit tables: every GPU overlay's training, pruning and decoding rows."""
    lines = ["| engine (conf/accelerate/) | bytes per parameter whole on each GPU | split over the GPUs | what |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {e.replicated:g} | {e.sharded:g} | {e.states} |" for name, e in ENGINES.items()]
    lines += ["", f"Per-GPU estimate (GiB) on {gpus} GPUs; a stage fits when it is under {HEADROOM:.0%} of "
             f"H100 ({gib(HBM['H100'])}) / H200 ({gib(HBM['H200'])}).", "",
             "| overlay | stage | engine | micro-batch | ckpt | states | gathered | activ. | loss | mask | total | H100 | H200 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in OVERLAYS:
        for r in (train_plan([f"+experiment={name}"], gpus) + evaluate_plan([f"+experiment={name}"], gpus)
                  + prune_plan([f"+experiment={name}"], gpus)):
            lines.append(f"| {name} | {r['stage']} | {r['engine']} | {r.get('micro_batch', 1)} | "
                         f"{'yes' if r.get('checkpointing') else 'no'} | {gib(r['states'])} | {gib(r.get('gathered', 0))} | "
                         f"{gib(r['activations'])} | {gib(r['loss'])} | {gib(r['mask'])} | **{gib(r['total'])}** | "
                         f"{'yes' if fits(r['total'], 'H100') else 'no'} | {'yes' if fits(r['total'], 'H200') else 'no'} |")
    lines += ["", "Decoding (bf16; d3d.decoding.cost's bound: weights + each model's widest pass, the prompt left "
              f"out). GPUs: 1 when both fit one GPU less {gib(DECODE_RESERVE)} GiB (CUDA context, allocator), else the target "
              "over k GPUs (target.device_map) + 1 for the drafter.",
              "", "| overlay | method | requests | target | drafter | total | GPUs (H100) | GPUs (H200) |",
              "|---|---|---|---|---|---|---|---|"]
    for name in OVERLAYS:
        for batch in (1, 16):
            for r in decode_plan([f"+experiment={name}"], batch):
                lines.append(f"| {name} | {r['stage'].removeprefix('decode ')} | {batch} | {gib(r['target_bytes'])} | "
                             f"{gib(r['drafter_bytes'])} | **{gib(r['total'])}** | {decode_gpus(r, 'H100')} | "
                             f"{decode_gpus(r, 'H200')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen3_8b_d8b (default: the GPU overlays)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu", default="H200", choices=sorted(HBM))
    ap.add_argument("--engine", choices=sorted(ENGINES), action="append", help="(repeatable) default: every engine")
    ap.add_argument("--shape", help="layers,hidden,ffn,heads,kv_heads,head_dim,vocab: a drafter given by hand, at "
                                    "the overlay's train.* (or the defaults')")
    ap.add_argument("--markdown", action="store_true", help="docs/gpu.md's fit tables")
    ap.add_argument("--validate", action="store_true", help="measure the toy step on the CPU (torchrun for ranks)")
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES + EXTRA_CASES,
                    help="--validate: which (default: all the checked ones)")
    ap.add_argument("--json", type=Path, help="--validate: also write the rows here")
    args = ap.parse_args()
    if args.validate:
        rows = validate(args.cases)
        if int(os.environ.get("RANK", 0)) == 0:
            for r in rows:
                print(f"{r['stage']:15} {r['engine']:7} {r.get('precision', 'fp32'):5} world {r['world']} "
                      f"ckpt={r['checkpointing']!s:5} "
                      f"measured {r['measured_mb']:7.1f} MB  formula {r['estimated_mb']:7.1f} MB  ratio {r['ratio']:.3f}")
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
        return
    if args.markdown:
        print(markdown(args.gpus))
        return
    engines = tuple(args.engine or ENGINES)
    budget = HEADROOM * HBM[args.gpu]
    print(f"per-GPU peak estimate (GiB), {args.gpus} x {args.gpu} (fits = under {gib(budget)} GiB, "
          f"{HEADROOM:.0%} of {gib(HBM[args.gpu])})")
    print(f"{'overlay':14} {'stage':15} {'engine':16} {'states':>7} {'gather':>7} {'activ.':>7} {'loss':>6} "
          f"{'mask':>6} {'total':>7}  fits")
    for name in ([" ".join(args.overrides)] if args.overrides else OVERLAYS):
        overrides = args.overrides or [f"+experiment={name}"]
        if args.shape:
            layers, hidden, ffn, heads, kv, hd, vocab = (int(x) for x in args.shape.split(","))
            s = shape_of_config(dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
                                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=vocab))
            _, cfg = compose_overlay("train", overrides)
            step = step_of(cfg.train, cfg.drafter.block_size, flex=False)
            rows = [{"stage": "train", "engine": e, **train_peak(s, e, args.gpus if e != "single" else 1, step)}
                    for e in engines]
        else:
            rows = (train_plan(overrides, args.gpus, engines) + evaluate_plan(overrides, args.gpus, engines)
                    + prune_plan(overrides, args.gpus, engines))
        for r in rows:
            print(f"{name:14} {r['stage']:15} {r['engine']:16} {gib(r['states']):>7} {gib(r.get('gathered', 0)):>7} "
                  f"{gib(r['activations']):>7} {gib(r['loss']):>6} {gib(r['mask']):>6} {gib(r['total']):>7}  "
                  f"{'yes' if r['total'] < budget else 'NO'}")


if __name__ == "__main__":
    main()
