"""Training prompt sets (conf/data/*.yaml): what the target answers to make the drafter's data.

Three sources: `benchmarks` (the shipped benchmark items that are in no evaluation subset: the
offline CPU default), `hub` (a chat dataset on a networked GPU node), `local` (a jsonl file).
Every set drops any prompt that appears in an evaluation subset, by id and by normalised text, so
no benchmark number is measured on a prompt the drafter was trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from d3d.data.benchmarks import (
    BenchmarkUnavailable, first_turn_messages, load_benchmark, load_records, normalise_text, read_rows,
)
from d3d.errors import ConfigError
from d3d.specs import BenchmarkSpec, PromptSetSpec


@dataclass
class Prompt:
    id: str
    messages: list[dict]
    raw: str | None = None  # the untemplated question, for overlap checks

    @property
    def text(self) -> str:
        return self.raw if self.raw is not None else self.messages[0]["content"]


class EmptyPromptSetError(ValueError):
    pass


def benchmark_spec(name: str) -> BenchmarkSpec:
    """The shipped spec of one benchmark (conf/benchmark/<name>.yaml), bound where configs are."""
    from d3d.settings import shipped_benchmark  # the binder needs OmegaConf; this module does not

    return shipped_benchmark(name)


def eval_exclusions(names: list[str], cache_dir: Path) -> tuple[set[str], set[str]]:
    """Ids and normalised texts of every evaluation subset that can be loaded here."""
    ids, texts = set(), set()
    for name in names:
        try:
            subset = load_benchmark(benchmark_spec(name), cache_dir)
        except BenchmarkUnavailable:
            continue  # not loadable here, so it cannot be a source of training prompts either
        for rec in subset:
            ids.add(rec.id)
            texts.update(normalise_text(t) for t in rec.turns)
    return ids, texts


def _from_benchmarks(cfg: PromptSetSpec, cache_dir: Path) -> list[Prompt]:
    out = []
    for name in cfg.benchmarks:
        spec = benchmark_spec(name)
        records, _ = load_records(spec, cache_dir)
        out += [Prompt(f"train/{rec.id}", first_turn_messages(spec, rec), rec.turns[0]) for rec in records]
    return out


def _rows_to_prompts(rows: list[dict], prefix: str, messages_field="messages", prompt_field="prompt") -> list[Prompt]:
    out = []
    for i, row in enumerate(rows):
        if row.get(messages_field):
            first_user = next(m for m in row[messages_field] if m["role"] == "user")
            messages = [{"role": "user", "content": first_user["content"]}]
        else:
            messages = [{"role": "user", "content": row[prompt_field]}]
        out.append(Prompt(str(row.get("id", row.get("prompt_id", f"{prefix}/{i}"))), messages))
    return out


def _from_hub(cfg: PromptSetSpec) -> list[Prompt]:
    import datasets

    hub = cfg.hub
    ds = datasets.load_dataset(hub.path, hub.name, split=hub.split)
    if cfg.limit:  # avoid materialising 200k rows to keep 10k
        ds = ds.shuffle(seed=cfg.seed).select(range(min(len(ds), 2 * cfg.limit)))
    return _rows_to_prompts([dict(r) for r in ds], cfg.name, hub.messages_field, hub.prompt_field)


def load_prompt_set(cfg: PromptSetSpec, cache_dir: str | Path) -> list[Prompt]:
    """The prompts of a prompt-set config, minus every evaluation item, seeded, capped at `limit`."""
    cache_dir = Path(cache_dir)
    source = cfg.source
    if source == "benchmarks":
        prompts = _from_benchmarks(cfg, cache_dir)
    elif source == "hub":
        from d3d.models.target import hub_reachable

        if cfg.hub is None:
            raise ConfigError(f"prompt set {cfg.name!r}: source hub needs data.hub. Fix: set data.hub.path and split")
        if not hub_reachable():
            raise BenchmarkUnavailable(
                f"prompt set {cfg.name!r} comes from the Hugging Face Hub ({cfg.hub.path}), which this "
                "machine cannot reach. Fix: data=cpu_math (offline) or data=local data.local_file=prompts.jsonl"
            )
        prompts = _from_hub(cfg)
    elif source == "local":
        if not cfg.local_file:
            raise ConfigError(f"prompt set {cfg.name!r}: source local reads a file. Fix: data.local_file=prompts.jsonl")
        prompts = _rows_to_prompts(read_rows(cfg.local_file), cfg.name)
    else:
        raise ValueError(f"data.source={source!r}: use benchmarks, hub or local")

    ids, texts = eval_exclusions(cfg.exclude_eval, cache_dir)
    kept = [p for p in prompts if p.id.removeprefix("train/") not in ids and normalise_text(p.text) not in texts]
    if cfg.limit and len(kept) > cfg.limit:
        keep = set(random.Random(cfg.seed).sample(range(len(kept)), cfg.limit))
        kept = [p for i, p in enumerate(kept) if i in keep]
    if not kept:
        raise EmptyPromptSetError(
            f"prompt set {cfg.name!r} is empty after removing evaluation items (source {source!r}, "
            f"{len(prompts)} prompts before). Fix: point it at a non-empty source or raise data.limit."
        )
    return kept
