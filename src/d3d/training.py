"""What d3d.train and d3d.prune's recovery share: the training step as a module, its optimizer, the
accelerate/DeepSpeed setup from `train.*`, and the data order that resumes exactly (docs/design.md, Training).

The step is an `nn.Module` (`D3DTrainingStep`) whose `forward(batch)` returns the loss and metrics:
`accelerator.prepare` wraps *it*, so DDP's gradient all-reduce, FSDP2's all-gathers, DeepSpeed's
engine and accelerate's bf16 autocast all run around the whole packed forward and loss. (Calling
`model.base_model(...)` on a prepared drafter bypasses every one of them; docs/design.md, Training.)

No Hydra or DeepSpeed import at module level: scripts/gpu_train_check.py runs this module on
machines that have neither.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import asdict

import torch
from torch import nn

from d3d.errors import ConfigError  # dependency-free (d3d.config needs OmegaConf)
from d3d.examples import batch_at
from d3d.models.drafter_settings import draft_map
from d3d.models.forward import logits_at, packed_attention_mask
from d3d.models.masks import Layout
from d3d.objective import Example, ObjectiveConfig, PackedBatch, loss_from_hidden, metrics_to_floats, pack
from d3d.specs import StepSettings, TrainConfig, TrainSettings

# ---------------------------------------------------------------------------- data
# The training set, its held-out split, its order and its packed batches live in d3d.examples (the
# Arrow cache, `held_out`, the length-grouped epoch order, the DataLoader's StepBatches).


def cut_responses(examples: list[Example], max_new_tokens: int | None) -> list[Example]:
    """Keep the first `max_new_tokens` response tokens of each example (all when None): τ on a
    prefix of each held-out response keeps validation and pruning's calibration cheap."""
    if not max_new_tokens:
        return examples
    return [Example(e.ids[: e.prompt_len + max_new_tokens], e.prompt_len) for e in examples]


# train.* keys a resumed run may change: budgets, cadence, where things go. Anything else changes the
# experiment, and a run resumed with it would be half one experiment and half another.
RESUMABLE_TRAIN_KEYS = {"max_steps", "max_minutes", "eval_every", "save_every", "log_every", "progress", "resume",
                        "stop_at_step", "out_dir", "responses_dir", "val_max_new_tokens",
                        "gradient_checkpointing", "loss_chunk_rows",  # memory knobs: same numbers either way
                        "num_workers",  # who packs the batches, not which
                        "save_dtype"}  # how final/ is written, not what is trained


# train resume-key entries that hold sets which may grow: adding a benchmark file adds its name to
# data.exclude_eval (`${d3d.benchmarks:}`), and a run resumed with more exclusions trains on no prompt
# its first part was kept from; a run that would now include an item it excluded is refused.
GROWING_TRAIN_KEYS = frozenset({"data.exclude_eval"})


def train_resume_key(cfg: TrainConfig, responses: str | None = None) -> dict:
    """What a training run's steps depend on. Optional sub-specs the YAML leaves out (a single-file
    GGUF's `parts`) are None here: keys only one side of a comparison has are skipped, so a key
    written from the raw config before the specs were typed still matches. `responses`: the
    fingerprint of the examples it trains on (ExampleSet.fingerprint), once they are read; without
    it the key holds the settings alone (checked first, before the data loads)."""
    target = {k: v for k, v in asdict(cfg.target).items() if k not in ("device", "dtype", "attn_implementation")}
    tc = cfg.train
    return {"target": target, "drafter": asdict(cfg.drafter), "data": asdict(cfg.data), "seed": cfg.seed,
            # what `auto` resolved to on this machine: an fp32 run resumed in bf16
            # on another CPU would be half one experiment and half another
            "precision": mixed_precision(tc.mixed_precision),
            # the batch an optimizer step takes, in sequences: the same on 8 processes x 4 micro-batches
            # as on 32 x 1 (the data order is the same, docs/design.md, Training); how it is split is not kept
            "train": {**{k: v for k, v in asdict(tc).items() if k not in RESUMABLE_TRAIN_KEYS | BATCH_SPLIT_KEYS},
                      "global_batch": tc.batch_size * tc.grad_accum * world_size()},
            # the data itself, not only its config: other responses in train.responses_dir, or more
            # of them (a generate run that appended rows), change the split and every epoch's order
            **({"responses": responses} if responses else {})}


# How the global batch is split over micro-batches: the resume key keeps the global batch instead.
BATCH_SPLIT_KEYS = {"grad_accum", "global_batch_size"}


# ---------------------------------------------------------------------------- the global batch


def world_size() -> int:
    """The number of processes of this job, as its launcher (torchrun, accelerate launch, the
    deepspeed launcher, a scheduler's srun) says, before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", 1))


def with_global_batch(tc: StepSettings, world: int) -> StepSettings:
    """`tc` with grad_accum derived from train.global_batch_size (sequences per optimizer step):
    global_batch_size / (batch_size x world), so a run keeps its batch, and with it its lr, warm-up
    and epochs per step, on 1 GPU, 8 or 4 nodes of 8. Unchanged when global_batch_size is null."""
    if tc.global_batch_size is None:
        return tc
    per_pass = tc.batch_size * world
    if tc.global_batch_size % per_pass:
        fits = ", ".join(str(n) for n in range(per_pass, 4 * per_pass + 1, per_pass))
        raise ConfigError(f"train.global_batch_size={tc.global_batch_size} is not a multiple of train.batch_size="
                          f"{tc.batch_size} x {world} processes = {per_pass}. Fix: set train.global_batch_size to a "
                          f"multiple of {per_pass} ({fits}, ...), or change train.batch_size.")
    return dataclasses.replace(tc, grad_accum=tc.global_batch_size // per_pass)


# ---------------------------------------------------------------------------- the step


class D3DTrainingStep(nn.Module):
    """One packed D3D forward and its loss, as the module a distributed wrapper prepares.

    `forward(batch)` moves the batch to the drafter's device, builds the d3d mask there (a BlockMask
    under flex_attention), runs the drafter's backbone and takes the loss on the loss rows only, in
    chunks of `loss_chunk_rows`. Returns (loss, metrics as 0-dim tensors)."""

    def __init__(self, drafter: nn.Module, vocab_size: int, ar_weight: float, loss_chunk_rows: int = 4096):
        super().__init__()
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.ar_weight = ar_weight
        self.loss_chunk_rows = loss_chunk_rows
        # FSDP's transformer-based auto-wrap reads the wrapped module's _no_split_modules: without the
        # drafter's, no decoder layer becomes its own unit and the whole model is gathered at once.
        self._no_split_modules = list(getattr(drafter, "_no_split_modules", None) or [])

    # accelerate's FSDP2 path carves out the embeddings / head and re-ties them through these
    def get_input_embeddings(self):
        return self.drafter.get_input_embeddings()

    def get_output_embeddings(self):
        return self.drafter.get_output_embeddings()

    def tie_weights(self, *args, **kwargs):
        return self.drafter.tie_weights(*args, **kwargs)

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        """Final (normed) hidden states (b, T, d) of the packed input under the d3d mask."""
        dev = self.drafter.get_input_embeddings().weight.device
        layout = Layout(*(t.to(dev, non_blocking=True) for t in (batch.layout.pos, batch.layout.block, batch.layout.limit)))
        out = self.drafter.base_model(input_ids=batch.input_ids.to(dev, non_blocking=True),
                                      attention_mask=packed_attention_mask(self.drafter, layout),
                                      position_ids=layout.pos, use_cache=False)
        return out.last_hidden_state

    def forward(self, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_from_hidden(self.hidden(batch), self.drafter.get_output_embeddings(), batch, self.ar_weight,
                                self.vocab_size, self.loss_chunk_rows)


def optimizer_step(step_module, optimizer, batches, clip: float | None, accelerator) -> dict[str, float]:
    """One optimizer step over the micro-batches (gradient accumulation) of a prepared step module;
    returns the metrics averaged over them, read from the device once. The backward, clipping and
    accumulation go through the accelerator (DDP no_sync between micro-batches, FSDP2's
    reduce-scatter, DeepSpeed's engine)."""
    batches = list(batches)
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        with accelerator.accumulate(step_module):
            loss, m = step_module(batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip:
                norm = accelerator.clip_grad_norm_(step_module.parameters(), clip)
                if norm is not None:  # DeepSpeed clips inside its engine and may not report it
                    # accelerate 1.15 under FSDP2 returns the total norm as a replicated DTensor (1.16 a
                    # tensor): every rank holds the whole norm, so its local value is the norm
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                    m["grad_norm"] = torch.as_tensor(norm).detach()
            optimizer.step()
            optimizer.zero_grad()
        for k, v in m.items():
            # grad_norm is taken once per step; everything else is a mean over the micro-batches
            sums[k] = sums.get(k, 0) + (v if k == "grad_norm" else v / len(batches))
    return metrics_to_floats(sums)


# ---------------------------------------------------------------------------- model and optimizer


def freeze_embeddings_except_mask(model, mask_id: int) -> None:
    """Tied input/output embeddings stay the target's; only the mask token's row learns."""
    emb = model.get_input_embeddings().weight
    # Built from the gradient itself: the model moves to the GPU after this hook is registered
    # (accelerator.prepare), so a mask made now would sit on the CPU.
    emb.register_hook(lambda grad: grad * (torch.arange(grad.shape[0], device=grad.device) == mask_id)[:, None].to(grad.dtype))
    out = model.get_output_embeddings()
    if out is not None and out.weight is not emb:
        out.weight.requires_grad_(False)


def freeze_lower_layers(model, first_trainable: int, positions: list[int] | None = None) -> None:
    """Train only layers >= first_trainable (and the final norm): a cheaper backward on CPU.
    `positions`: the index each layer is compared by, where it is not the layer's own (d3d.prune
    freezes by the drafter pruning started from, prune.freeze_below)."""
    layers = model.base_model.layers
    for layer, i in zip(layers, range(len(layers)) if positions is None else positions):
        if i < first_trainable:
            layer.requires_grad_(False)


def enable_activation_checkpointing(model) -> None:
    """Each decoder layer keeps only its input and recomputes the rest in backward. transformers
    5.24 renamed the switch (activation_checkpointing_enable); earlier 5.x have only the old name."""
    kwargs = {"use_reentrant": False}  # the non-reentrant form works with frozen inputs and autocast
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_optimizer(model, lr: float, weight_decay: float, betas: list[float], fused: bool = False):
    """AdamW with weight decay on the matrices only (not norms, biases or embeddings). `fused`:
    torch's fused kernel (`fused_adamw`), for a single CPU process (`fuses_adamw`): there torch's
    default is its per-tensor loop, whose update makes two temporaries the size of each tensor
    (1.0 GB beside the Qwen drafter's tied embedding) and ran ~10x slower on an AVX2 EPYC. The
    two give the same weights to fp32 rounding, not bit for bit (docs/reliability.md, Round 8)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **({"fused": True} if fused else {}))


def fuses_adamw(accelerator) -> bool:
    """AdamW fused on one CPU process only: on CUDA torch's default (foreach) is kept, and the
    sharded and multi-process wrappers (DDP, FSDP2's DTensors, DeepSpeed) keep the optimizer they
    were tested with."""
    from accelerate.utils import DistributedType

    return accelerator.device.type == "cpu" and accelerator.distributed_type == DistributedType.NO


def make_scheduler(optimizer, warmup: int, total: int, shape: str = "cosine"):
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at step `total` (or, `constant`,
    the peak lr to the end: pruning's short recoveries)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        if shape == "constant":
            return 1.0
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------- accelerate


def mixed_precision(setting: str) -> str:
    """auto = bf16 autocast (fp32 weights and optimizer state) where bf16 matmuls are native: CUDA,
    and CPUs with AVX512-BF16 or AMX (d3d.utils.hardware; there a bf16 training step is faster,
    scripts/bench_train.py --precisions no bf16). fp32 on AVX2-only CPUs, where bf16 matmuls of many
    rows run 1.6x (16 rows) to 3x (64 rows) slower than fp32 (docs/design.md, dtype)."""
    if setting == "auto":
        from d3d.utils.hardware import cpu_prefers_bf16

        return "bf16" if torch.cuda.is_available() or cpu_prefers_bf16() else "no"
    return setting


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a precision computes in (and a drafter trained in it decodes in): bf16, fp16, else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def autocast(precision: str, device: torch.device | str):
    """The autocast context of a precision on a device (what accelerate wraps a prepared module's
    forward in), for the work outside that module: pruning's recovery steps and the estimator."""
    device = torch.device(device)
    if precision in ("bf16", "fp16"):
        return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def deepspeed_config(tc: TrainSettings, precision: str, zero_stage: int) -> dict:
    """The DeepSpeed config, every value from train.* (one source of truth): the accelerate yaml's
    deepspeed_config only chooses the ZeRO stage and offloading. Explicit values, never "auto":
    accelerate fills "auto" only from a prepared DataLoader, and d3d reads its own batches."""
    return {
        "train_micro_batch_size_per_gpu": tc.batch_size,
        "gradient_accumulation_steps": tc.grad_accum,
        "gradient_clipping": tc.clip or 0.0,
        # bf16 weights and activations, fp32 master weights in the optimizer (DeepSpeed's bf16 mode)
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 2**31 - 1,
    }


def deepspeed_plugin(tc: TrainSettings, precision: str):
    """A DeepSpeedPlugin from train.* when `accelerate launch` asked for DeepSpeed, else None. The
    plugin's own fields are set too: accelerate would otherwise fill them from the yaml's env vars
    (ACCELERATE_GRADIENT_ACCUMULATION_STEPS=1 used to override train.grad_accum)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    from accelerate.utils import DeepSpeedPlugin

    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
    config = deepspeed_config(tc, precision, stage)
    for kind in ("optimizer", "param"):
        device = os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
        if device != "none":
            config["zero_optimization"][f"offload_{kind}"] = {"device": device}
    # accelerate launch lists the yaml's deepspeed fields (zero_stage, offload) in this variable, and a
    # plugin built from a config dict then refuses to start ("... variables will be ignored"): those
    # fields are carried into `config` above, so the check has nothing left to protect
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    return DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=tc.grad_accum,
                           gradient_clipping=tc.clip or 0.0, zero_stage=stage)


def make_accelerator(tc: StepSettings, *, timeout_s: float, cpu: bool | None = None, precision: str | None = None):
    """The Accelerator of a training run (d3d.train) or of pruning's recoveries, configured from
    train.* (micro-batch, accumulation, clipping; the precision is train.mixed_precision unless
    `precision` is given); a multi-process launch's process group waits `timeout_s` (dist.timeout_s)
    for its slowest process. The scheduler is stepped by hand once per optimizer step: accelerate would
    otherwise step it once per process (it assumes a sharded dataloader shortened the epoch)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from d3d.utils.process_group import describe_group, group_kwargs

    precision = mixed_precision(precision or tc.mixed_precision)
    if torch.cuda.is_available():
        # TF32 for the fp32 matmuls that remain (loss, fp32 master copies): ~8x faster on H100/H200.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    fsdp = fsdp_plugin(precision)
    accelerator = Accelerator(mixed_precision=precision, step_scheduler_with_optimizer=False,
                              gradient_accumulation_steps=tc.grad_accum,
                              deepspeed_plugin=deepspeed_plugin(tc, precision), fsdp_plugin=fsdp,
                              kwargs_handlers=[InitProcessGroupKwargs(**group_kwargs(timeout_s))],
                              cpu=(not torch.cuda.is_available()) if cpu is None else cpu)
    _fsdp_on_cpu(accelerator, fsdp)
    check_sharding(accelerator, tc)
    if accelerator.num_processes > 1 and accelerator.is_main_process:
        print(f"[d3d] {describe_group(accelerator.num_processes)}", flush=True)
    return accelerator


def fsdp_plugin(precision: str):
    """The FSDP plugin of a launch that asks for FSDP (read from its FSDP_* variables; None otherwise),
    with d3d's mixed precision under FSDP2: weights gathered in the compute dtype, gradients
    reduce-scattered in fp32. accelerate's own policy reduces in the compute dtype (bf16) while DDP
    all-reduces fp32 gradients: a 1.7B drafter under DDP and an 8B one under FSDP2 would not train
    alike (speculators pins reduce_dtype=float32 too). In fp32 (`no`) FSDP2 keeps the weights' dtype."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    compute = compute_dtype(precision)
    if compute != torch.float32 and plugin.fsdp_version == 2:  # FSDP1 is refused by check_sharding
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    return plugin


def _fsdp_on_cpu(accelerator, plugin) -> None:
    """accelerate turns an FSDP launch into plain DDP on CPU processes (MULTI_CPU), silently. FSDP2
    runs on CPU with gloo (docs/design.md, Training), so the launch's FSDP is honoured there too:
    the multi-process tests then shard as a GPU node does. Both shared states are set, as an
    AcceleratorState made later copies the PartialState's type."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU or \
            os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    accelerator.state.fsdp_plugin = plugin  # fsdp_plugin(): read from the launch's FSDP_* variables
    for state in (PartialState(), accelerator.state):
        state.distributed_type = DistributedType.FSDP


def check_sharding(accelerator, tc: StepSettings) -> None:
    """What the sharded backends cannot do, refused in one line before the drafter loads."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    if not accelerator.is_fsdp2:
        raise ConfigError("the accelerate config asks for FSDP version 1; d3d shards with FSDP2 (DTensor parameters). "
                          "Fix: set fsdp_config.fsdp_version: 2 (conf/accelerate/fsdp.yaml).")
    if tc.freeze_embeddings:
        # the mask-row gradient hook sits on the unsharded parameter; FSDP2 writes the sharded
        # gradient by reduce-scatter, past any hook, so the embeddings would train in full
        raise ConfigError("train.freeze_embeddings=true cannot be honoured under FSDP2 (its gradient hook never sees "
                          "the sharded gradient). Fix: train.freeze_embeddings=false (the Qwen overlays' setting), or "
                          "launch with conf/accelerate/ddp.yaml or deepspeed_zero2.yaml.")


def is_zero3(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return (accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.state.deepspeed_plugin.zero_stage == 3)


def plain_drafter(accelerator, step_module, inference: torch.dtype | None = None) -> nn.Module:
    """The drafter with whole, ordinary tensors on every process, for the work outside the training
    forward (held-out τ, pruning's scores, latencies and its next removal). Under one process, DDP
    and ZeRO-1/2 that is the trained module itself. Under FSDP2 and ZeRO-3 a process holds shards
    (FSDP2's root-owned embeddings are DTensors: calling the drafter outside the root's forward fails
    with "mixed torch.Tensor and DTensor"), so every process gathers the weights, in the same order,
    into a copy of its own: no collective runs inside it afterwards, so processes may then work on
    different responses. Every process must call this.

    `inference`: the copy is for decoding only (the in-training evaluation), gathered in that dtype
    (bf16 under bf16 mixed precision: the dtype the drafter decodes in) with no parameter taking a
    gradient. An fp32 copy whose parameters required grad made autocast cache a bf16 copy of every
    weight beside it: 6 bytes a parameter instead of 2 (at 8B, 60 GiB a GPU against 38 planned).
    Without it, the trainable drafter in its own dtype (pruning's recovery returns it)."""
    from torch.distributed.tensor import DTensor

    drafter = accelerator.unwrap_model(step_module).drafter
    cast = (lambda t: t.detach().to(inference)) if inference is not None else (lambda t: t)
    if is_zero3(accelerator):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None):
            return _twin(drafter, {k: cast(v.detach().clone()) for k, v in drafter.state_dict().items()},
                         trainable=inference is None)
    state = drafter.state_dict()
    if not any(isinstance(v, DTensor) for v in state.values()):
        return drafter
    # each shard cast before its all-gather: the whole tensor is never made in fp32 for a bf16 copy
    return _twin(drafter, {k: cast(v).full_tensor() if isinstance(v, DTensor) else cast(v) for k, v in state.items()},
                 trainable=inference is None)


def _twin(drafter: nn.Module, state: dict, trainable: bool = True) -> nn.Module:
    """A new module of the drafter's class and config holding `state` (allocated by the gather, not
    twice), with the drafter's buffers (rotary tables are not in a state dict) and ties; its
    parameters take gradients only when `trainable`."""
    with torch.device("meta"):
        twin = type(drafter)._from_config(copy.deepcopy(drafter.config),
                                          attn_implementation=drafter.config._attn_implementation)
    twin.load_state_dict(state, assign=True)
    for name, buf in drafter.named_buffers():
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._buffers[leaf] = buf.detach()
    if getattr(twin.config, "tie_word_embeddings", False):
        twin.tie_weights()
    if not trainable:
        twin.requires_grad_(False)
    return twin.eval()


def my_share(items: list, accelerator) -> list:
    """This process's share of `items` (every world-th, from its rank): work each process does on
    its own responses, whose counts `sum_over_processes` then adds up."""
    return items[accelerator.process_index :: accelerator.num_processes]


def sum_over_processes(accelerator, counts: list[float]) -> list[float]:
    """Counts summed over every process (all_reduce), in float64: a τ made of summed token and round
    counts is the one a single process computes on all the responses, exactly."""
    if accelerator.num_processes == 1:
        return list(counts)
    total = accelerator.reduce(torch.tensor(counts, dtype=torch.float64, device=accelerator.device), "sum")
    return total.tolist()


def drafter_state_dict(accelerator, step_module) -> dict:
    """The drafter's full weights (gathered from FSDP/ZeRO-3 shards: every process must call this),
    with the step module's `drafter.` prefix removed so they load into the bare drafter."""
    state = accelerator.get_state_dict(step_module)
    if state is None:  # processes other than the main one get nothing under some backends
        return None
    return {k.removeprefix("drafter."): v for k, v in state.items()}


# ---------------------------------------------------------------------------- recovery (d3d.prune)


def recover(accelerator, model, train, tc: StepSettings, s, steps: int, seed: int, pad_id: int, teacher=None,
            lr: float = 1e-5, warmup: int = 0, schedule: str = "constant") -> nn.Module:
    """d3d.prune's recovery of a drafter `s` (its DrafterSettings) after a removal: `steps` optimizer
    steps of the training objective through the same prepared step as d3d.train (`accelerator`:
    DDP, FSDP2 or ZeRO shard it as they shard training; batch, accumulation and gradient checkpointing
    from train.*), with its own fresh AdamW and schedule (`lr`, `warmup`, constant or cosine); with a
    `teacher` (prune.recovery_loss=distill) the block slots learn the teacher's laws instead of the
    tokens. Every process calls it; each reads its own slice of each step's global batch, seeded by
    (seed, step, slice), so N processes train on what one process with N x the micro-batches does.
    Returns the recovered drafter, plain (`plain_drafter`), in eval mode."""
    if steps <= 0:
        return model
    objective = ObjectiveConfig.from_cfg(tc, s.block_size)
    if tc.gradient_checkpointing:
        enable_activation_checkpointing(model)
    # The same training step as d3d.train (the module, its chunked loss and device-built mask).
    step_module = (D3DTrainingStep(model, s.vocab_size, objective.ar_weight, tc.loss_chunk_rows) if teacher is None
                   else DistillStep(model, teacher, s.vocab_size, objective.ar_weight, tc.loss_chunk_rows))
    optimizer = make_optimizer(step_module, lr, tc.weight_decay, tc.betas, fused=fuses_adamw(accelerator))
    scheduler = make_scheduler(optimizer, warmup, steps, schedule)
    step_module, optimizer, scheduler = accelerator.prepare(step_module, optimizer, scheduler)
    step_module.train()
    rank, ranks = accelerator.process_index, accelerator.num_processes
    per_step = tc.batch_size * tc.grad_accum * ranks  # the global batch of one optimizer step
    for step in range(steps):
        batches = []
        for micro in range(tc.grad_accum):
            piece = micro * ranks + rank
            gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4_099 + piece)
            batches.append(pack(batch_at(train, step, micro, per_step, tc.batch_size, seed, rank, ranks), objective,
                                s.mask_token_id, pad_id, gen))
        optimizer_step(step_module, optimizer, batches, tc.clip, accelerator)
        scheduler.step()
    recovered = plain_drafter(accelerator, step_module)
    accelerator.free_memory()  # the prepared module, optimizer and engine of this recovery go
    if next(recovered.parameters()).dtype != torch.float32:  # DeepSpeed's bf16 mode cast the module itself
        recovered.float()
    return recovered.eval()


class DistillStep(D3DTrainingStep):
    """The training step with the denoising CE replaced by KL(teacher || student) on the same block
    rows, weighted by the same slot weights: a pruned drafter learns the unpruned one's whole law
    at each slot, not only its argmax. The AR term stays the objective's."""

    def __init__(self, drafter, teacher, vocab_size: int, ar_weight: float, loss_chunk_rows: int = 4096):
        super().__init__(drafter, vocab_size, ar_weight, loss_chunk_rows)
        self.teacher = [teacher]  # a list: not a submodule (no gradients, not in parameters())

    def forward(self, batch):
        hidden = self.hidden(batch)
        with torch.no_grad():
            teacher = self.teacher[0]
            dev = next(teacher.parameters()).device
            t_hidden = teacher.base_model(input_ids=batch.input_ids.to(dev),
                                          attention_mask=packed_attention_mask(teacher, batch.layout),
                                          position_ids=batch.layout.pos.to(dev), use_cache=False).last_hidden_state
        loss, metrics = loss_from_hidden(hidden, self.drafter.get_output_embeddings(), batch, self.ar_weight,
                                         self.vocab_size, self.loss_chunk_rows)
        rows = batch.dn_rows.to(hidden.device)
        h = hidden.reshape(-1, hidden.shape[-1])[rows]
        th = t_hidden.reshape(-1, t_hidden.shape[-1])[rows]
        w = batch.dn_weights.to(hidden.device)
        kl = hidden.new_zeros((), dtype=torch.float32)
        # a draft vocabulary: the student's law over its N tokens against the teacher's restricted to them
        d2t = draft_map(self.drafter)
        for c in range(0, len(rows), self.loss_chunk_rows):
            student = logits_at(self.drafter, h[c : c + self.loss_chunk_rows], self.vocab_size, draft_ids=True).float()
            target = logits_at(teacher, th[c : c + self.loss_chunk_rows], self.vocab_size).float()
            target = target if d2t is None else target[..., d2t]
            per_row = torch.nn.functional.kl_div(student.log_softmax(-1), target.log_softmax(-1), log_target=True,
                                                 reduction="none").sum(-1)
            kl = kl + (per_row * w[c : c + self.loss_chunk_rows]).sum()
        kl = kl / w.sum().clamp(min=1e-9)
        metrics["loss_distill"] = kl.detach()
        # the denoising CE is reported, not trained on: L = KL + λ·L_AR
        return loss - metrics["loss_denoise"] + kl, metrics
