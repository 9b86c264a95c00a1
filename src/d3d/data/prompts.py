"""Training prompt sets (conf/data/*.yaml): what the target answers to make the drafter's data.

Three sources: `benchmarks` (the shipped benchmark items that are in no evaluation subset: the
offline CPU default), `hub` (a chat dataset on a networked GPU node), `local` (a jsonl file).
Every set drops any prompt that appears in an evaluation subset, by id and by normalised text, so
no benchmark number is measured on a prompt the drafter was trained on.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from d3d.data.benchmarks import (
    BenchmarkUnavailable, Located, MalformedFile, first_turn_messages, load_benchmark, load_records, normalise_text,
    read_located,
)
from d3d.errors import ConfigError
from d3d.fetch import hub_offline, hub_reachable, libraries_offline
from d3d.specs import BenchmarkSpec, PromptSetSpec


@dataclass
class Prompt:
    id: str
    messages: list[dict]
    raw: str | None = None  # the untemplated question, for overlap checks

    @property
    def text(self) -> str:
        return self.raw if self.raw is not None else self.messages[0]["content"]


class EmptyPromptSetError(ConfigError):
    """A prompt set with no prompt left: said in one line by the jobs, before any model loads."""


# A benchmark's name -> its spec: d3d.settings.shipped_benchmark, passed in by the caller (binding a
# conf/benchmark/ file needs OmegaConf, which is the boundary's, above this package).
SpecOf = Callable[[str], BenchmarkSpec]


def eval_exclusions(names: list[str], cache_dir: Path, spec_of: SpecOf) -> tuple[set[str], set[str]]:
    """Ids and normalised texts of every evaluation subset that can be loaded here. One that cannot
    (any failure of its sources: no network, a loading script `datasets` refuses) is said in one
    line and skipped: generation goes on, and the line says which items were not removed."""
    ids, texts = set(), set()
    for name in names:
        try:
            subset = load_benchmark(spec_of(name), cache_dir)
        except BenchmarkUnavailable as err:
            print(f"[d3d.data] exclude_eval: skipped {name}, its items are not removed from the prompts: {err}",
                  flush=True)
            continue
        for rec in subset:
            ids.add(rec.id)
            texts.update(normalise_text(t) for t in rec.turns)
    return ids, texts


def _from_benchmarks(cfg: PromptSetSpec, cache_dir: Path, spec_of: SpecOf) -> list[Prompt]:
    out = []
    for name in cfg.benchmarks:
        spec = spec_of(name)
        records, _ = load_records(spec, cache_dir)
        out += [Prompt(f"train/{rec.id}", first_turn_messages(spec, rec), rec.turns[0]) for rec in records]
    return out


def _rows_to_prompts(rows: Located, prefix: str, messages_field="messages", prompt_field="prompt") -> list[Prompt]:
    """One prompt per row (its first user turn). A row that has neither field, or no user turn with
    text, fails naming its file and line: a KeyError after the set was half read used to say neither."""
    out, first = [], {}
    for i, (at, row) in enumerate(rows):
        try:
            if row.get(messages_field):
                content = next(m for m in row[messages_field] if m["role"] == "user")["content"]
            else:
                content = row[prompt_field]
            ok = isinstance(content, str) and content.strip()
        except (KeyError, TypeError, StopIteration):
            ok = False
        if not ok:
            raise MalformedFile(f"{at}: a prompt row needs {prompt_field!r}: \"<text>\" or {messages_field!r}: [{{\"role\": "
                                f"\"user\", \"content\": \"<text>\"}}]; its fields are {sorted(row)}. Fix: rename the "
                                f"field in that file.")
        prompt = Prompt(str(row.get("id", row.get("prompt_id", f"{prefix}/{i}"))), [{"role": "user", "content": content}])
        out.append(prompt)
        if prompt.id not in first:
            first[prompt.id] = (at, prompt)
        elif prompt.messages != first[prompt.id][1].messages:  # responses are keyed by id: one would get the other's
            raise MalformedFile(f"{at}: id {prompt.id!r} again, for another prompt (first at {first[prompt.id][0]}); "
                                f"responses are keyed by id, so one prompt would get the other's response. Fix: give "
                                f"each prompt its own id in that file (or drop the ids).")
    return out  # a prompt repeated whole is kept as it was (the same text, the same response)


def _from_local(cfg: PromptSetSpec) -> list[Prompt]:
    """data.local_file, checked: a missing or empty file is said with the key, before any model loads."""
    path = Path(os.path.expanduser(str(cfg.local_file or "")))
    try:
        path = path.resolve()
    except RuntimeError:  # a symlink loop (Python 3.11; later ones resolve it and is_file() says no)
        pass
    if not cfg.local_file or not path.is_file():
        raise ConfigError(f"data.local_file={cfg.local_file}: {path} is not a file. Fix: pass a jsonl of "
                          f"prompts, one {{\"prompt\": \"...\"}} (or {{\"messages\": [...]}}) a line.")
    rows = read_located(path)
    if not rows:
        raise EmptyPromptSetError(f"data.local_file={cfg.local_file}: {path} is empty (no rows). Fix: pass a jsonl of "
                                  f"prompts, one {{\"prompt\": \"...\"}} a line.")
    return _rows_to_prompts(rows, cfg.name)


def _from_hub(cfg: PromptSetSpec) -> list[Prompt]:
    import datasets

    hub = cfg.hub
    if hub_offline():  # the datasets cache only, whenever datasets was imported
        try:
            with libraries_offline():
                ds = datasets.load_dataset(hub.path, hub.name, split=hub.split)
        except (ConnectionError, FileNotFoundError):
            raise BenchmarkUnavailable(
                f"HF_HUB_OFFLINE is on and prompt set {cfg.name!r} ({hub.path}) is not in the datasets cache. Fix: "
                "load it once on a networked node with the same HF_HOME, or use data=cpu_math (offline)") from None
    else:
        ds = datasets.load_dataset(hub.path, hub.name, split=hub.split)
    if cfg.limit:  # avoid materialising 200k rows to keep 10k
        ds = ds.shuffle(seed=cfg.seed).select(range(min(len(ds), 2 * cfg.limit)))
    return _rows_to_prompts([(f"{hub.path} row {i}", dict(r)) for i, r in enumerate(ds)], cfg.name,
                            hub.messages_field, hub.prompt_field)


def load_prompt_set(cfg: PromptSetSpec, cache_dir: str | Path, spec_of: SpecOf) -> list[Prompt]:
    """The prompts of a prompt-set config, minus every evaluation item, seeded, capped at `limit`.
    `spec_of` gives the spec of each benchmark it names (d3d.settings.shipped_benchmark)."""
    cache_dir = Path(cache_dir)
    source = cfg.source
    if source == "benchmarks":
        prompts = _from_benchmarks(cfg, cache_dir, spec_of)
    elif source == "hub":
        if cfg.hub is None:
            raise ConfigError(f"prompt set {cfg.name!r}: source hub needs data.hub. Fix: set data.hub.path and split")
        if not hub_offline() and not hub_reachable():  # offline, datasets reads its cache (or says it cannot)
            raise BenchmarkUnavailable(
                f"prompt set {cfg.name!r} comes from the Hugging Face Hub ({cfg.hub.path}), which this "
                "machine cannot reach. Fix: data=cpu_math (offline), data=local data.local_file=prompts.jsonl, "
                "or HF_HUB_OFFLINE=1 with the set in the datasets cache"
            )
        prompts = _from_hub(cfg)
    elif source == "local":
        prompts = _from_local(cfg)
    else:
        raise ValueError(f"data.source={source!r}: use benchmarks, hub or local")

    ids, texts = eval_exclusions(cfg.exclude_eval, cache_dir, spec_of)
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
