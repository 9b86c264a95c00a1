"""`python -m d3d.eval benchmark=gsm8k`: speculative decoding on benchmarks, AR baseline alongside.

For every item (and every MT-Bench turn, whose history carries the method's own earlier answer),
each method in `eval.methods` (conf/decode/<name>.yaml; the `decode` group's choice overrides its
own method) decodes the prompt in this process after a warm-up, with decode time measured apart from
prefill. Each reply is graded where a cheap check exists (d3d.grading), and compared with the AR
tokens. Rows are appended to rows.jsonl as they finish (a killed run resumes, skipping finished
rows); summary.json, summary.md and the plots are recomputed from the rows (d3d.report).

`eval.concurrency=[1,2,4,8,16]` adds the load test (first turns in batches of c requests);
`eval.async_budgets=[4x1,8x2]` the budget study; `accelerate launch -m d3d.eval ...` splits the
items across processes (rows.rank<r>.jsonl), and the main process writes the merged summary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from d3d.config import hydra_job, refuse_mixed_run, to_plain
from d3d.errors import UserError
from d3d.utils.io import JsonlWriter, job_folder, read_jsonl, resolve_path, unique, write_json
from d3d.data.benchmarks import BenchmarkUnavailable, Source, evaluation_subset, format_turn, iter_specs, load_records
from d3d.data.chat import chat_prompt_ids, eos_ids, require_thinking_switch
from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.cost import check_decode_cost
from d3d.decoding.divergence import RealDivergence, classify
from d3d.decoding.kv import batch_bucket
from d3d.decoding.methods import method_row
from d3d.decoding.reference import HFGenerate
from d3d.models import load_target
from d3d.models.target import (
    drafter_device, load_tokenizer, model_fingerprint, process_device, process_state, resolve_model_path,
)
from d3d.models.drafter import SavedDrafter, build_drafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.grading.sandbox import isolation, isolation_warning
from d3d.grading.verdict import grade
from d3d.settings import AUTO, bind_config, decode_keys, method_configs, resolve_auto_backend, shipped_benchmark
from d3d.specs import BenchmarkSpec, EvalConfig, EvalSettings
from d3d.report import BASELINE, REFERENCE, ROW_FIELDS, read_rows, row_key, summary_markdown, write_report
from d3d.utils.process_group import describe_group
from d3d.utils.runinfo import run_info

log = logging.getLogger("d3d.eval")


# Settings every method of one run shares, so that speedups and equality compare like with like:
# sampling for all methods (AR included), the block size for the speculative ones.
# Pairs whose greedy outputs must agree (`equal_to_sync`): an async loop is its synchronous loop plus
# trays, verifying the same shapes, so a method's reference is its row's (d3d.decoding.methods:
# (D, Async)'s is (D, Sync)). Tokens always; τ per round only in fp32, because the two loops'
# drafter passes lay the same keys out differently and bf16 SDPA moves by an ulp with the layout
# (docs/design.md#losslessness), which can flip a near-tie draft.


def remember_reference(refs: dict, name: str, cfg, row: dict) -> None:
    """Keep the first row of each method on this request, per drafter (the run's own, or an
    eval.also_drafters label: async@x compares with sync@x)."""
    refs.setdefault((drafter_label(name), cfg.method), (row, cfg))


def reference_row(refs: dict, name: str, cfg) -> dict | None:
    """The row of this method's synchronous counterpart (its row's reference, Method.reference) on
    the same request with the same drafter, when that counterpart ran with the same settings of its
    own (block size; a tree's node count), so the two drafted and verified the same shapes; else
    None (nothing to compare)."""
    ref = (drafter_label(name), method_row(cfg.method).reference)
    if ref not in refs:
        return None
    row, ref_cfg = refs[ref]
    return row if all(getattr(cfg, k) == getattr(ref_cfg, k) for k in method_row(ref[1]).keys) else None


def resolve_auto_budget(methods: dict[str, DecodeConfig], fitting: dict[str, list[dict]], out_dir: Path,
                        cfg: EvalConfig, ev: EvalSettings, target, tok, drafter, cache: Path, state) -> dict | None:
    """Give every method whose tray budget is left to the measured choice (its decode file's nulls, the
    shipped default, or an eval.async_budgets `auto` entry) the budget d3d.decoding.budget chooses on
    this device for its Drafts (C x F for a chain, tree_trays for a tree), among the settings whose
    passes fit (`fitting`, from check_decode_cost): exact hit rates from the target's greedy responses
    to the last `eval.auto_budget_prompts` prompts of `data` (its prompts are outside every eval
    subset), measured pass costs, projected speedup. Where no budget beats drafting without trays,
    the method runs as its reference (async as sync, async_tree as tree). Returns {name: choice}.
    The main process chooses (timings differ per process) and the others read its choice; a resumed
    run reuses the choices in its run.json, so its rows never mix two budgets."""
    names = [n for n, dc in methods.items() if method_row(dc.method).trays and dc.auto_budget]
    if not names:
        return None
    run_file, chosen_file = out_dir / "run.json", out_dir / "auto_budget.json"
    earlier = (json.loads(run_file.read_text()).get("auto_budget") if run_file.is_file() else None) or {}
    missing = [n for n in names if n not in earlier]  # a method added to a resumed run: chosen now, the rest kept
    if missing:
        if state.is_main_process:
            write_json(chosen_file, {**earlier, **choose_budgets(methods, missing, fitting, cfg, ev, target, tok,
                                                                 drafter, cache)})
        state.wait_for_everyone()
        earlier = json.loads(chosen_file.read_text())
    for name in names:
        row, choice = method_row(methods[name].method), earlier[name]
        if choice["trays"]:
            methods[name] = replace(methods[name], **{k: int(choice[k]) for k in row.drafts.tray_grid[0]})
        else:  # no budget beats drafting without trays here: the method runs as its reference (run.json says why)
            methods[name] = replace(methods[name], method=row.reference)
    return {name: earlier[name] for name in names}


def choose_budgets(methods: dict[str, DecodeConfig], names: list[str], fitting: dict[str, list[dict]], cfg: EvalConfig,
                   ev: EvalSettings, target, tok, drafter, cache: Path) -> dict:
    """The measured choice for each of `names` (resolve_auto_budget), with what it rests on."""
    from d3d.data.prompts import load_prompt_set
    from d3d.decoding.budget import calibrate, greedy_pairs

    prompts = load_prompt_set(cfg.data, cache, shipped_benchmark)[-ev.auto_budget_prompts:]
    pairs = greedy_pairs(target, tok, [chat_prompt_ids(tok, p.messages, ev.enable_thinking) for p in prompts],
                         min(ev.max_new_tokens, 128), eos_ids(tok, target))
    out = {}
    for name in names:
        dc, row = methods[name], method_row(methods[name].method)
        # packed pass beside verification (a side stream) or after it: as the loop will run it
        overlap = row.overlap_mode(dc, target.device) == "stream"
        some = replace(dc, temperature=0.0, **row.drafts.tray_grid[0])  # a greedy config; its knobs are the grid's
        drafts = row.drafts(some, row.block_size(dc), None)
        pick, basis = calibrate(target, drafter, pairs, drafts, overlap=overlap, progress=ev.progress,
                                grid=fitting.get(name))
        out[name] = {**pick.as_dict(), **basis}
        log.info("tray budget of %s, chosen by measurement: %s", name, pick.why)
    return out


def budget_records(bound: dict[str, DecodeConfig], ran: dict[str, DecodeConfig]) -> dict[str, dict]:
    """Which tray budget each method with trays ran (its rows' and run.json's `budget`): chosen by
    measurement (`auto`) or given, its setting ("4x1"; "none" where it ran as its reference, without
    trays) and its packed pass's tokens. `bound`: the methods as bound, `ran`: as they run."""
    out = {}
    for name, dc in bound.items():
        row = method_row(dc.method)
        if not row.trays:
            continue
        now = ran[name]
        trays = method_row(now.method).trays
        out[name] = {"by": AUTO if dc.auto_budget else "given",
                     "setting": "x".join(str(getattr(now, k)) for k in row.drafts.tray_grid[0]) if trays else "none",
                     "tokens": method_row(now.method).budget(now)}
    return out


def run_notes(methods: dict[str, DecodeConfig], budgets: dict[str, dict], trained_block: int | None) -> list[str]:
    """The choices a reader of summary.md must see beside the numbers (run.json's `notes`): a block
    other than the drafter's trained one (a stated choice: decode.block_size), and each given tray
    budget (a chosen one's reason is the auto_budget note)."""
    notes = []
    if trained_block is not None:
        other = [(name, dc.block_size) for name, dc in methods.items()
                 if method_row(dc.method).needs_drafter and int(dc.block_size) != trained_block]
        for block in sorted({b for _, b in other}):
            named = ", ".join(name for name, b in other if b == block)
            notes.append(f"{named}: blocks of {block}, a stated choice (decode.block_size={block}); the drafter was "
                         f"trained with {trained_block}, the default")
    notes += [f"{name}: tray budget given ({b['setting']}, {b['tokens']} tokens a packed pass), not chosen by "
              f"measurement (null tray knobs choose it)" for name, b in budgets.items() if b["by"] == "given"]
    return notes


def read_settings(dc: DecodeConfig) -> dict:
    """The settings of `dc` its method reads (d3d.settings.decode_keys): sync's record holds no tray budget."""
    return {k: getattr(dc, k) for k in decode_keys(dc.method)}


def method_record(dc: DecodeConfig, budget: dict | None = None) -> dict:
    """A method's entry in run.json: the settings it reads, its token cap and its tray budget
    (`budget_by`: auto or given, for a method with trays: budget_records)."""
    return {**read_settings(dc), "max_new_tokens": dc.max_new_tokens, "budget": method_row(dc.method).budget(dc),
            **({"budget_by": budget["by"]} if budget else {})}


def output_dir(cfg: EvalConfig, ev: EvalSettings) -> Path:
    if ev.out_dir:
        return resolve_path(ev.out_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # composed outside a Hydra app
        return resolve_path(cfg.paths.output_dir) / "eval" / cfg.run_name


def resume_key(cfg: EvalConfig, ev: EvalSettings, methods: dict[str, DecodeConfig], sources: dict[str, Source]) -> dict:
    """What a row depends on besides its benchmark, item, turn, method and concurrency (its own key).
    Sampled rows also depend on the seed, through their own random stream (`item_seed`). `sources`:
    where each benchmark read here came from (read_benchmarks)."""
    drafter = cfg.drafter.checkpoint
    # a missing path or a run folder said now, with the fix, and the rule it was trained with, before it loads
    saved = SavedDrafter.named(drafter, block_attention=cfg.drafter.block_attention) if drafter else None
    return {"target": cfg.target.name, "dtype": cfg.target.dtype,
            # which weights, not only which name: another target saved under the same name is refused
            "target_weights": model_fingerprint(resolve_model_path(cfg.target, resolve_path(cfg.paths.cache_dir))),
            **(saved.resume_record() if saved else {"drafter": f"untrained {cfg.drafter.name}"}),
            "max_new_tokens": ev.max_new_tokens, "enable_thinking": ev.enable_thinking,
            "seed": cfg.seed, "exec_timeout_s": ev.exec_timeout_s,
            # each benchmark's template, sources, subset (n, seed) and loader: they change the prompt,
            # the items or the verdict. eval.n is not here: it cuts a nested prefix, so growing it adds rows.
            # Optional fields the YAML leaves out are None here, keys a key written from the raw config
            # lacks: differing_keys skips keys only one side has, so such a folder still resumes.
            # and the source the items came from (kind, origin, revision, item count): MATH-500's hub set and
            # its 311-item offline file are two item sets under one spec
            "benchmarks": {spec.name: asdict(spec) | ({"source": sources[spec.name].key()} if spec.name in sources else {})
                           for spec in iter_specs(cfg.benchmark)},
            # each method's keys it reads (a key written when ar and sync held async's tray keys still matches:
            # keys only one side has are not compared); max_new_tokens is above
            "methods": {name: read_settings(dc) for name, dc in methods.items()},
            # more drafters' rows (<method>@<label>): their weights too (absent when none, so older folders resume)
            **({"also_drafters": {label: SavedDrafter.named(p, f"eval.also_drafters.{label}").resume_record()
                                  for label, p in ev.also_drafters.items()}}
               if ev.also_drafters else {})}


def check_resumable(out_dir: Path, key: dict, previous: list[dict]) -> None:
    """A run resumes only rows made with the same settings: mixing them would corrupt every mean.
    Adding methods (a budget to the grid), items or benchmarks is fine: their rows are new."""
    run_file = out_dir / "run.json"
    if not run_file.is_file() or not previous:
        return
    # methods only one side has are new rows, not a conflict (differing_keys compares shared keys)
    refuse_mixed_run(out_dir, json.loads(run_file.read_text()).get("resume_key"), key, "holds rows made",
                     "pass a new eval.out_dir, or delete that folder to start over.")


def load_trained_drafter(cfg: EvalConfig, path: str, target, tok, where: str):
    """A saved drafter on drafter.device (`same`: the target's) in the target's dtype, with its fit to the
    target said (`where` names its key)."""
    return SavedDrafter.named(path, where).load(cfg.drafter, cfg.target, target=target, target_tok=tok,
                                                decoding=True, warn=log.warning)[0]


def load_models(cfg: EvalConfig, methods: dict[str, DecodeConfig], cache: Path, state):
    _, tok, target = load_target(cfg.target, cache, process_device(state, cfg.target.device))
    drafter = None
    if any(method_row(dc.method).needs_drafter for dc in methods.values()):
        if cfg.drafter.checkpoint:
            drafter = load_trained_drafter(cfg, cfg.drafter.checkpoint, target, tok, "drafter.checkpoint")
        else:
            log.warning("no drafter.checkpoint given: evaluating an untrained drafter built from drafter.init")
            drafter, _ = build_drafter(cfg.drafter, cfg.target, cache, device=drafter_device(cfg.drafter.device, target),
                                       dtype=cfg.target.dtype)
    return tok, target, drafter


def also_drafter_generators(cfg: EvalConfig, methods: dict[str, DecodeConfig], target, tok, eos) -> dict:
    """`eval.also_drafters`: every speculative method again with each of these drafters, on the same
    items, as rows `<method>@<label>` (a pruned drafter beside the one it was pruned from)."""
    gens = {}
    for label, path in cfg.eval.also_drafters.items():
        drafter = load_trained_drafter(cfg, path, target, tok, f"eval.also_drafters.{label}")
        for name, dc in methods.items():
            if method_row(dc.method).needs_drafter:
                gens[f"{name}@{label}"] = SpecGenerator(target, tok, drafter, dc, eos, seed=cfg.seed)
    return gens


def drafter_label(name: str) -> str:
    """Which drafter a row's method ran with: '' for drafter.checkpoint, else its eval.also_drafters label."""
    return name.partition("@")[2]


def result_row(spec, name: str, key_id: str, turn: int, concurrency: int, prompts: list[list[int]], res,
               compiles: int = 0, budgets: dict | None = None) -> dict:
    """One row: a request at concurrency 1, or a batch of `concurrency` requests. `compiles`: graphs
    torch.compile made while it decoded (0 after a complete warm-up: its decode_s holds no compile).
    A method with trays says which budget ran (`budget`: budget_records; <method>@<label> its method's)."""
    single = concurrency == 1
    taus = res.taus()  # one entry per request per round
    budget = (budgets or {}).get(name.partition("@")[0])
    return {**({"budget": budget} if budget else {}), "benchmark": spec.name, "id": key_id, "turn": turn, "method": name, "concurrency": concurrency,
            "prompt_tokens": len(prompts[0]) if single else [len(p) for p in prompts],
            "new_tokens": res.new_tokens, "rounds": len(taus),  # request-rounds
            "prefill_s": res.prefill_s, "decode_s": res.decode_s, "compiles": compiles, "hit_rate": res.hit_rate,
            "host_issue_share": res.host_issue_share,  # CUDA: near 1, host-bound passes (d3d.report flags them)
            "taus": taus,
            "token_ids": res.token_ids[0] if single else res.token_ids,
            "text": res.texts[0] if single else res.texts,
            "finish_reason": res.finish_reasons[0] if single else res.finish_reasons}


def item_seed(seed, *key) -> int:
    """A random stream per row (seed, benchmark, id, turn, method): a sampled run resumed after a
    kill, or split over processes, draws exactly what an uninterrupted run draws for that row."""
    digest = hashlib.sha256(json.dumps([int(seed), *map(str, key)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are < 2**63


def compare_with_references(row: dict, gen: SpecGenerator, ar: dict | None, sync: dict | None,
                            prompts: list[list[int]]) -> None:
    """Two checks that stay meaningful in bf16, where AR and a B-token verify pass can round a
    near-tie differently (d3d.decoding.divergence):
    - `equal_to_sync` (async rows): tokens equal the synchronous loop's, and in fp32 per-round τ
      too (`sync_compared` says which). Both verify the same shapes, so this isolates the async
      logic from numerics; τ is left out in bf16, where the drafter passes' key layouts differ.
    - `divergence` (greedy rows that differ from AR): the first differing position, the target's
      logit margins there, and whether rounding explains it (numerical) or not (real)."""
    comparable = gen.cfg.sampling.greedy and sync is not None and int(sync.get("concurrency", 1)) == int(row["concurrency"])
    if comparable:  # sampled rows draw from per-method streams: no bitwise claim
        fp32 = all(next(m.parameters()).dtype == torch.float32 for m in (gen.target, gen.drafter) if m is not None)
        row["sync_compared"] = "tokens and tau" if fp32 else "tokens"
        row["equal_to_sync"] = row["token_ids"] == sync["token_ids"] and (not fp32 or row["taus"] == sync["taus"])
    if ar is None or row["equal_to_ar"] or not gen.cfg.sampling.greedy:
        return
    single = row["concurrency"] == 1
    outs = [row["token_ids"]] if single else row["token_ids"]
    refs = [ar["token_ids"]] if single else ar["token_ids"]
    found = [classify(gen.target, p, ref, out) for p, ref, out in zip(prompts, refs, outs)]
    row["divergence"] = found[0] if single else found


def fail_on_real_divergence(row: dict) -> None:
    """A greedy output that left AR's by more than rounding is a bug in the engine: stop loudly
    (the row is already written, so the evidence is kept and a rerun resumes after it)."""
    found = row.get("divergence")
    for i, d in enumerate(found if isinstance(found, list) else [found]):
        if d and d["kind"] == "real":
            raise RealDivergence(
                f"{row['method']} on {row['benchmark']} item {row['id']} (request {i}) left the target's greedy output "
                f"at token {d['index']}: tokens {d['tokens']}, the target's top-1/top-2 margin there is "
                f"{d['top1_top2_margin']:.4g} and the tokens' logits differ by {d['gap']} (rounding tolerance "
                f"{d['tolerance']:.3g} in {d['dtype']}). This is not numerics: the decoding loop is not lossless.")


# ---- warm-up: every shape a timed call will run, compiled (and on CUDA recorded) before the first one

def warm_up_calls(benchmarks, tok, ev: EvalSettings) -> list[tuple[int, int]]:
    """The (batch, reserve) warm-up calls that cover every shape the run's timed calls can take.
    A static backend's shapes are (pass width, batch bucket, capacity): the widths are the method's,
    the capacity follows the call's longest prompt + max_new_tokens (rounded up to a power of two,
    reused when smaller), and a batch of c requests runs in c's bucket and, as rows finish, in every
    smaller one (16 -> 8 -> 4 -> 2 -> 1) at the capacity it started with. `reserve` is that longest
    prompt + max_new_tokens: an item's turns at concurrency 1 (a later MT-Bench turn counted with
    max_new_tokens per earlier answer: a bound, the answers are the method's own), the first turns
    of the benchmarks at a concurrency above 1."""
    def ids(messages):
        return len(chat_prompt_ids(tok, messages, ev.enable_thinking))

    single, first = 0, 0
    for spec, records, _ in benchmarks:
        for rec in records:
            history = []
            for turn in range(len(rec.turns)):
                history.append({"role": "user", "content": format_turn(spec, rec, turn)})
                single = max(single, ids(history) + turn * ev.max_new_tokens)
                history.append({"role": "assistant", "content": ""})
            first = max(first, ids(history[:1]))
    calls = []
    for c in sorted(set(ev.concurrency)):
        reserve = (single if c == 1 else first) + ev.max_new_tokens
        bucket = batch_bucket(c)
        calls += [(b, reserve) for b in (bucket >> i for i in range(bucket.bit_length())) if (b, reserve) not in calls]
    return calls


@contextmanager
def counting_compiles():
    """`with counting_compiles() as n:` ... `n()`: graphs torch.compile made inside (dynamo's count)."""
    from torch._dynamo.utils import counters

    start = counters["stats"]["unique_graphs"]
    yield lambda: counters["stats"]["unique_graphs"] - start


def warm_up(gens: dict, calls: list[tuple[int, int]], tok, repeats: int) -> dict:
    """Run every method's warm-up calls (`repeats` times each: CUDA graph trees record a shape on its
    second run) before any timed call, and report per method the seconds they took (compiles
    included) and the graphs compiled, apart from decode time (run.json, summary.json)."""
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "Say hello."}])
    report = {}
    for name, gen in gens.items():
        t0 = time.perf_counter()
        with counting_compiles() as compiles:
            for _ in range(repeats):
                if isinstance(gen, SpecGenerator):
                    limit = getattr(gen.target.config, "max_position_embeddings", None) or float("inf")
                    for batch, reserve in calls:  # a reserve past the context: those requests are skipped
                        gen.warm_up(batch, min(reserve, limit - gen.B), prompt)
                else:  # transformers' generate (eval.reference_generate) compiles nothing
                    gen.generate([prompt], max_new_tokens=8)
        report[name] = {"seconds": round(time.perf_counter() - t0, 3), "graphs_compiled": compiles(),
                        "calls": [list(c) for c in calls] if isinstance(gen, SpecGenerator) else [[1, 0]]}
    return report


def run_single(cfg: EvalConfig, ev: EvalSettings, spec: BenchmarkSpec, records, gens, tok, done, writer, skipped,
               budgets: dict) -> None:
    """Concurrency 1: each item (and MT-Bench turn, with the method's own history) by every method;
    `budgets`: the tray budget each method with trays runs (budget_records), written into its rows.
    A prompt longer than the context is recorded in skipped.jsonl (with its reason) and that
    method's conversation ends there; the run goes on."""
    for rec in tqdm(records, desc=spec.name, unit="item", disable=not ev.progress):
        history = {name: [] for name in gens}
        ended: set[str] = set()
        for turn in range(len(rec.turns)):
            ar, refs = None, {}
            for name, gen in gens.items():
                if name in ended:
                    continue
                key = (spec.name, rec.id, turn, name, 1)
                history[name].append({"role": "user", "content": format_turn(spec, rec, turn)})
                row = done.get(key)
                if row is None:
                    ids = chat_prompt_ids(tok, history[name], ev.enable_thinking)
                    reason = gen.context_problem([ids], ev.max_new_tokens)
                    if reason:
                        skipped.write([{"benchmark": spec.name, "id": rec.id, "turn": turn, "method": name,
                                        "concurrency": 1, "reason": reason}])
                        ended.add(name)
                        continue
                    seed = item_seed(cfg.seed, spec.name, rec.id, turn, name)
                    with counting_compiles() as compiles:
                        res = gen.generate([ids], seed=seed)
                    row = result_row(spec, name, rec.id, turn, 1, [ids], res, compiles(), budgets)
                    row.update(grade(spec, rec, row["text"], turn, ev.exec_timeout_s, ev.sandbox))
                    row["equal_to_ar"] = True if ar is None else row["token_ids"] == ar["token_ids"]
                    row["task_equal_to_ar"] = None if row["correct"] is None or ar is None else row["correct"] == ar["correct"]
                    compare_with_references(row, gen, ar, reference_row(refs, name, gen.cfg), [ids])
                    writer.write([row])
                    fail_on_real_divergence(row)
                if name == BASELINE:
                    ar = row
                remember_reference(refs, name, gen.cfg, row)
                history[name].append({"role": "assistant", "content": row["text"]})


def run_batched(cfg: EvalConfig, ev: EvalSettings, spec: BenchmarkSpec, records, gens, tok, done, writer, skipped,
                budgets: dict, concurrency: int) -> None:
    """Load test: first turns in batches of `concurrency` requests, every method on the same batches."""
    for start in range(0, len(records) - concurrency + 1, concurrency):
        batch = records[start : start + concurrency]
        prompts = [chat_prompt_ids(tok, [{"role": "user", "content": format_turn(spec, r, 0)}],
                                   ev.enable_thinking) for r in batch]
        key_id = f"c{concurrency}/" + ",".join(r.id for r in batch)
        ar, refs = None, {}
        for name, gen in gens.items():
            if name == REFERENCE:  # generate's reference row times one request at a time
                continue
            row = done.get((spec.name, key_id, 0, name, concurrency))
            if row is None:
                reason = gen.context_problem(prompts, ev.max_new_tokens)
                if reason:
                    skipped.write([{"benchmark": spec.name, "id": key_id, "turn": 0, "method": name,
                                    "concurrency": concurrency, "reason": reason}])
                    continue
                seed = item_seed(cfg.seed, spec.name, key_id, 0, name)
                with counting_compiles() as compiles:
                    res = gen.generate(prompts, seed=seed)
                row = result_row(spec, name, key_id, 0, concurrency, prompts, res, compiles(), budgets)
                row["equal_to_ar"] = True if ar is None else row["token_ids"] == ar["token_ids"]
                compare_with_references(row, gen, ar, reference_row(refs, name, gen.cfg), prompts)
                writer.write([row])
                fail_on_real_divergence(row)
            if name == BASELINE:
                ar = row
            remember_reference(refs, name, gen.cfg, row)


def read_benchmarks(cfg: EvalConfig, ev: EvalSettings, cache: Path) -> list[tuple[BenchmarkSpec, list, Source]]:
    """Every benchmark's items and their source, read and checked before any model loads: a mistyped
    local_file or a malformed row fails in one line (d3d.data.benchmarks) instead of after the models
    load; one that cannot be read here (any failure of its shipped sources) is skipped, said in one
    line; one read from a later source than its first is said too; none left is an error."""
    out, skipped = [], []
    for spec in iter_specs(cfg.benchmark):
        try:
            records, source = load_records(spec, cache)
            out.append((spec, evaluation_subset(spec, records, ev.n), source))
            if source.fallback(spec.name):
                print(f"[d3d.eval] {source.fallback(spec.name)}", flush=True)
        except BenchmarkUnavailable as err:
            print(f"[d3d.eval] skipped {spec.name}: {err}", flush=True)
            skipped.append(spec.name)
    if not out:
        raise UserError(f"no benchmark of this run can be read here ({', '.join(skipped)}: each is said above), so "
                        f"nothing would run. Fix: set benchmark.specs.<name>.local_file, or choose a benchmark this "
                        f"machine has (python -m d3d.benchmarks lists them).")
    return out


def grading_isolation(specs, sandbox: str) -> dict | None:
    """What graded code gets here (d3d.grading.sandbox.isolation: eval.sandbox), for run.json, when the run
    grades code: a sandbox that cannot run here is refused in one line before any model loads, and
    eval.sandbox=unsafe_subprocess is said in one line."""
    if not any(spec.kind == "code" for spec in specs):
        return None
    facts = isolation(sandbox)
    warning = isolation_warning(facts)
    if warning:
        print(f"[d3d.eval] warning: {warning}", flush=True)
    return facts


def run_eval(cfg: DictConfig, check_only: bool = False) -> Path | None:
    """Evaluate into output_dir(cfg), one run at a time per folder (two would double every row).
    `check_only`: bind the settings, the decode files included, and return None (d3d.pipeline checks
    every stage before the first runs)."""
    auto = resolve_auto_backend(cfg)  # decode.backend=auto chosen before anything loads, said in one line
    if auto:
        print(f"[d3d.eval] decode.backend=auto: {auto['backend']}, {auto['why']}", flush=True)
    typed = bind_config(cfg, "eval")  # the typed boundary: unknown keys fail here
    if check_only:
        cache = resolve_path(typed.paths.cache_dir)
        check_decode_cost(method_configs(cfg, typed.eval), typed.target, typed.drafter, cache,
                          max(typed.eval.concurrency))
        if typed.eval.enable_thinking:  # else said only when the eval stage starts, after the others ran
            require_thinking_switch(load_tokenizer(resolve_model_path(typed.target, cache)), "eval.enable_thinking")
        grading_isolation(list(iter_specs(typed.benchmark)), typed.eval.sandbox)  # a sandbox that cannot run here
        return None
    with job_folder(output_dir(typed, typed.eval), "eval", "eval.out_dir",
                    process_state(typed.dist.timeout_s).process_index):
        return _evaluate(cfg, typed, auto)


def _evaluate(raw: DictConfig, cfg: EvalConfig, auto: dict | None = None) -> Path:
    """`raw` keeps the composed config for the decode sections (method_configs) and the record of
    the run (config.yaml, summary.json); everything else reads the typed `cfg`. `auto`: what
    decode.backend=auto chose and why (a note of run.json, so of summary.md)."""
    ev = cfg.eval
    state = process_state(cfg.dist.timeout_s)  # one process unless started by `accelerate launch` or torchrun
    if state.num_processes > 1 and state.is_main_process:
        print(f"[d3d.eval] {describe_group(state.num_processes)}", flush=True)
    torch.manual_seed(cfg.seed)
    out_dir = output_dir(cfg, ev)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not ev.out_dir and state.is_main_process:  # Hydra's folder is new each run: a rerun never finds these rows
        print(f"[d3d.eval] writing to {out_dir}, a new folder for each run: a killed run resumes only if rerun "
              f"with eval.out_dir={out_dir}", flush=True)
    cache = resolve_path(cfg.paths.cache_dir)
    methods = method_configs(raw, ev)
    bound = dict(methods)
    # a pass that cannot fit is refused; a budget left to the measured choice keeps the settings that fit
    fitting = check_decode_cost(methods, cfg.target, cfg.drafter, cache, max(ev.concurrency))
    benchmarks = read_benchmarks(cfg, ev, cache)  # a broken file is said before minutes of model loading
    sources = {spec.name: source for spec, _, source in benchmarks}
    key = resume_key(cfg, ev, methods, sources)
    previous = read_rows(out_dir)  # rows of an earlier run into this folder: checked, then skipped
    check_resumable(out_dir, key, previous)
    if ev.enable_thinking:  # a template without the switch would change nothing, silently (before loading)
        require_thinking_switch(load_tokenizer(resolve_model_path(cfg.target, cache)), "eval.enable_thinking")
    grading = grading_isolation([spec for spec, _, _ in benchmarks], ev.sandbox) if state.is_main_process else None
    tok, target, drafter = load_models(cfg, methods, cache, state)
    auto_budget = resolve_auto_budget(methods, fitting, out_dir, cfg, ev, target, tok, drafter, cache, state)
    budgets = budget_records(bound, methods)
    notes = run_notes(methods, budgets, DrafterSettings.of(drafter).block_size if drafter is not None else None)
    for note in notes:
        print(f"[d3d.eval] {note}", flush=True)
    if auto:  # said by run_eval before anything loaded; recorded here, first among the notes (run.json, summary.md)
        notes = [f"decode.backend=auto chose {auto['backend']}: {auto['why']}", *notes]
    eos = eos_ids(tok, target)
    gens = {name: SpecGenerator(target, tok, drafter if method_row(dc.method).needs_drafter else None, dc, eos,
                                seed=cfg.seed)
            for name, dc in methods.items()}
    if ev.reference_generate:  # transformers' generate on the same items, right after our AR baseline
        gens = {BASELINE: gens.pop(BASELINE), REFERENCE: HFGenerate(target, tok, methods[BASELINE], eos), **gens}
    also = also_drafter_generators(cfg, methods, target, tok, eos)
    gens |= also
    warmup = warm_up(gens, warm_up_calls(benchmarks, tok, ev), tok, ev.warmup)
    if state.is_main_process:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(raw, resolve=True))
        write_json(out_dir / "run.json", {
            "run": run_info(target.device), "dtype": str(target.dtype), "processes": state.num_processes,
            "attn_implementation": target.config._attn_implementation,
            # where each model's weights are (target.device_map, drafter.device)
            "placement": {"target": sorted({str(p.device) for p in target.parameters()}),
                          "drafter": str(next(drafter.parameters()).device) if drafter is not None else None},
            "methods": {name: method_record(dc, budgets.get(name)) for name, dc in methods.items()}
            | ({REFERENCE: {"method": "transformers generate", "max_new_tokens": ev.max_new_tokens}}
               if ev.reference_generate else {})
            | {name: {**method_record(gen.cfg, budgets.get(name.partition("@")[0])), "drafter": str(resolve_path(ev.also_drafters[drafter_label(name)]))}
               for name, gen in also.items()},
            "benchmark_sources": {name: asdict(source) | {"fallback": source.fallback(name)}
                                  for name, source in sources.items()},
            "resume_key": key, "grading": grading, **({"auto_budget": auto_budget} if auto_budget else {}),
            "notes": notes,
            "warmup": warmup})

    done = {row_key(r): r for r in previous}
    rows_file = out_dir / ("rows.jsonl" if state.num_processes == 1 else f"rows.rank{state.process_index}.jsonl")
    skipped_file = out_dir / ("skipped.jsonl" if state.num_processes == 1 else f"skipped.rank{state.process_index}.jsonl")
    with JsonlWriter(rows_file) as writer, JsonlWriter(skipped_file) as skipped:
        for spec, records, _ in benchmarks:
            for c in ev.concurrency:
                # Round-robin shards of whole units (items, or batches of c items) across processes.
                units = [records[i : i + c] for i in range(0, len(records) - c + 1, c)]
                mine = [r for u in units[state.process_index :: state.num_processes] for r in u]
                if c == 1:
                    run_single(cfg, ev, spec, mine, gens, tok, done, writer, skipped, budgets)
                else:
                    run_batched(cfg, ev, spec, mine, gens, tok, done, writer, skipped, budgets, c)
            print(f"[d3d.eval] {spec.name}: {len(records)} items done (process {state.process_index})", flush=True)
    state.wait_for_everyone()
    if not state.is_main_process:
        return out_dir
    summary = write_report(out_dir, {"config": to_plain(raw), "warmup": warmup})
    print(summary_markdown(summary))
    skips = unique((r for f in sorted(out_dir.glob("skipped*.jsonl")) for r in read_jsonl(f, ROW_FIELDS)), row_key)
    if skips:
        print(f"[d3d.eval] {len(skips)} requests skipped, their prompts too long for the context "
              f"(listed with the reason in {out_dir}/skipped*.jsonl)", flush=True)
    print(f"[d3d.eval] results: {out_dir} (summary.md, summary.json, {', '.join(summary['plots'])})", flush=True)
    return out_dir


@hydra_job("eval")
def main(cfg: DictConfig) -> None:
    run_eval(cfg)


if __name__ == "__main__":
    main()
