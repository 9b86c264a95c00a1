"""Typed settings at the boundary (lingua's dataclass args): a recipe turns its own section of the
Hydra config into one of these in `run_*`, with a strict merge, so a misspelt or unread key fails
there with its name instead of being ignored, and nothing below reads the raw config or keeps a
second default in `.get(key, default)`. The YAML files keep the documented defaults; the fields
here say which keys exist and their types (tests/unit/test_configs.py binds every root x experiment).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from d3d.config import ConfigError
from d3d.objective import ObjectiveKnobs

T = TypeVar("T")


@dataclass
class GenerateSettings:
    """`generate.*` (conf/generate.yaml): how the target answers the prompt set."""

    out_dir: str = MISSING  # the responses folder (one target and one set of settings per folder)
    batch_size: int = 16  # prompts per batched generate call (left padding)
    max_new_tokens: int = 256
    do_sample: bool = False  # greedy: the offline acceptance estimator needs greedy responses
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    enable_thinking: bool = False  # passed to chat templates that know it (Qwen3)
    system_prompt: Optional[str] = None  # None = the template's own default
    limit: Optional[int] = None  # answer only the first N prompts of the set
    sort_by_length: bool = True  # less padding, same outputs
    progress: bool = True
    backend: str = "hf"  # hf | vllm | sglang (d3d.models.engines)
    vllm: dict[str, Any] = field(default_factory=dict)  # LLM(**vllm) when backend=vllm
    sglang: dict[str, Any] = field(default_factory=dict)  # Engine(**sglang) when backend=sglang


@dataclass
class EvalSettings:
    """`eval.*` (conf/eval.yaml): which methods run, on how much, and how it is measured."""

    methods: list[str] = field(default_factory=lambda: ["ar", "sync", "async"])  # names under `methods`
    n: Optional[int] = None  # cap items per benchmark (a nested prefix of the seeded subset)
    max_new_tokens: int = 256
    warmup: int = 1
    async_budgets: Optional[list[str]] = None  # budget study: [CxF, ...]; `auto` = chosen on this device
    auto_budget_prompts: int = 4  # `auto`: target greedy responses to the data set's last prompts, for hit rates
    concurrency: list[int] = field(default_factory=lambda: [1])  # load test: batches of c requests
    reference_generate: bool = False  # also time transformers' generate on each item (row method `generate`)
    exec_timeout_s: float = 10.0  # HumanEval/MBPP checks, per program
    progress: bool = True
    enable_thinking: bool = False
    out_dir: Optional[str] = None  # None = this run's folder under outputs/eval/


@dataclass
class StepSettings(ObjectiveKnobs):
    """`train.*` keys of the training step and its data (conf/training/default.yaml): d3d.train reads
    them, and d3d.prune reads them for calibration and recovery. The objective's own keys come from
    d3d.objective.ObjectiveKnobs."""

    responses_dir: str = MISSING  # written by d3d.generate
    val_size: int = 12  # held-out responses for the offline τ estimator (and prune's calibration)
    val_max_new_tokens: Optional[int] = 96  # score τ on the first N response tokens only
    max_len: int = 384  # prompt + response tokens per sequence
    lr: float = 3e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    batch_size: int = 2  # sequences per micro-batch
    clip: Optional[float] = 1.0
    freeze_embeddings: bool = True
    loss_chunk_rows: int = 4096
    allow_mixed_backends: bool = False  # train on a folder whose rows come from several generate.backend


@dataclass
class TrainSettings(StepSettings):
    """`train.*` of d3d.train (conf/train.yaml): the step's keys plus the run's own schedule,
    budget, cadence and distribution, which d3d.prune does not compose."""

    out_dir: str = MISSING
    warmup_steps: int = 10
    max_steps: int = 200
    max_minutes: Optional[float] = 35.0  # None = no wall-time budget
    grad_accum: int = 1
    trainable_from_layer: Optional[int] = None
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    eval_every: int = 50  # 0 = never
    save_every: int = 10
    log_every: int = 1
    resume: bool = True
    progress: bool = True
    stop_at_step: Optional[int] = None  # debugging: stop (after saving) at this step, as if killed


# d3d.train's own train.* keys. An experiment overlays every job alike, so the ones it sets (max_steps,
# eval_every, ...) land in prune's `train` section too: they are d3d.train's, and prune skips them by
# name (bind_step_section); any other key prune does not know still fails.
TRAIN_ONLY_KEYS = frozenset(f.name for f in fields(TrainSettings)) - frozenset(f.name for f in fields(StepSettings))


@dataclass
class PruneSettings:
    """`prune.*` (conf/prune.yaml): acceptance-guided layer pruning."""

    method: str = "acceptance"  # a key of d3d.prune.SCORERS
    num_layers: int = 6
    min_retention: float = 0.99
    calib_size: int = 12
    holdout_size: int = 0
    recovery_steps: int = 20
    out_dir: str = MISSING
    device: str = "auto"
    packed_blocks: int = 24
    stop_at_step: Optional[int] = None
    progress: bool = True


def bind(schema: type[T], node: Any, where: str) -> T:
    """`node` (a section of the composed config) as a `schema` object: unknown keys and values of
    the wrong type fail here, named by their dotted key (`where.key`)."""
    try:
        if OmegaConf.is_config(node):  # interpolations reach outside the section: resolve them first
            node = OmegaConf.to_container(node, resolve=True)
        typed = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(getattr(err, "msg", None) or err).splitlines()[0]
        raise ConfigError(f"{where}.{key}: {msg}" if key else f"{where}: {msg}") from None


def bind_section(cfg: DictConfig, name: str, schema: type[T]) -> T:
    return bind(schema, cfg[name], name)


def bind_step_section(cfg: DictConfig) -> StepSettings:
    """d3d.prune's view of `train.*`: the step's keys, without d3d.train's own that an experiment
    overlay put there (TRAIN_ONLY_KEYS)."""
    node = OmegaConf.to_container(cfg["train"], resolve=True)
    return bind(StepSettings, {k: v for k, v in node.items() if k not in TRAIN_ONLY_KEYS}, "train")


# `decode.*` and `methods.<name>.*` (conf/decode/<name>.yaml) bind to d3d.decoding.DecodeConfig; which
# of its fields a file holds depends on its method, since DecodeConfig serves every method:
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # every method samples (0 = greedy)
EVERY_METHOD_KEYS = (*SAMPLING_KEYS, "backend")  # ... and runs its passes on a backend (eager | static | compiled | frozen)
TRAY_KEYS = ("C", "F", "coverage", "overlap", "cpu_threads_drafter")  # drafter work beside verification
# `name` names the run (run_name: ${decode.name}); `max_new_tokens` comes from eval.max_new_tokens and
# `stop_strings` is for callers of the engine, so neither is a decode file's key.


def decode_keys(method: str) -> tuple[str, ...]:
    """The DecodeConfig fields `method` reads: the sampling keys and the backend; the block size if it drafts; the
    tray budget, coverage and overlap if it works beside verification (async). Asked of the method's
    class in d3d.decoding.methods, never of its name, so a new method needs no line here. A decode
    file holds exactly these and `name` (tests/unit/test_configs.py); eval's resume key and run.json
    record only these."""
    from d3d.decoding import DecodeConfig
    from d3d.decoding.methods import method_class

    cls = method_class(method)
    return ("method", *EVERY_METHOD_KEYS, *(("block_size",) if cls.needs_drafter else ()),
            *(TRAY_KEYS if cls.budget(DecodeConfig(method=method)) else ()))
