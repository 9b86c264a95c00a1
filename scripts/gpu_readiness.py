"""GPU readiness: time the real shapes with random weights, then project speedup from measured τ.

Speed does not depend on weight values, so random-weight Qwen3-8B/32B-shaped targets and
Qwen3-1.7B-shaped drafters (tied embeddings, as the released 1.7B) time like the trained ones.
This script measures, on one device, at a 2k-token context by default:
1. pass latencies after a cached prefix, each as device time and host issue time apart
   (d3d.utils.timing.device_and_host_ms: on CUDA the device is given a `torch.cuda._sleep` first,
   so the host issues the pass while the device still sleeps and the CUDA events time the kernels
   back to back; a pass whose host issue time is above its device time is host-bound there):
   verify over B tokens for each block size B; the synchronous draft of one block; each preset
   row's tray pass (`packed_<row>`: its budget in B-token blocks); and the AR step twice, with and without an explicit mask (the
   fair-baseline gap, below);
2. the real loops (d3d.decoding.SpecGenerator) of the rows of a conf/bench preset (--preset; the
   default, conf/bench/gpu_readiness.yaml: AR, sync, async at three budgets, a tree, an async tree),
   on a random prompt of the prefix length, each on the backends of --backends its method runs on
   (eager, and compiled: static KV buffers + torch.compile, CUDA graphs on CUDA, where one replay
   is issued per pass and the host no longer paces the device; async's tray pass replays graphs of
   its own pool on its side stream; a method that runs on eager only is timed there; --compiled-rows
   limits the compiled loops, each a few cold compiles): per round, the host wall time next to the
   passes' CUDA-event times, and for a row with trays its measured `overlap`, the share of its tray
   passes that ran while verification ran (events on both streams). On CUDA at the Qwen3-8B /
   Qwen3-1.7B shapes an async row on the compiled backend must hide at least MIN_OVERLAP = 0.5 of
   it, and no compiled loop may compile inside its timed call (`problems`, naming the row);
3. projections over the preset's plain row (no drafter: AR) on the same backend, from those
   *measured round times* only, at τ = --tau (random weights give no τ; ROW=TAU for one row):
   a row without trays = τ · t_AR / t_round; a row with trays = τ · t_AR / (h · t_hit + (1 − h) ·
   t_miss) with its own hit rate h (--hit-rate ROW=RATE; default the paper's AIME25 budget study,
   PAPER_HIT_RATES, keyed by block size and tray tokens), t_miss its measured round (random
   weights: every round misses) and t_hit = t_miss − that round's draft pass; overlap = 1 − (t_miss
   − t_ref) / t_tray: the share of the tray pass (t_tray, its device time in the same rounds) that
   its round hides beside verification, against the round of the preset's row it equals without
   trays (t_ref: async's sync, an async tree's tree); clipped to [0, 1], unclipped kept; and for
   every row the τ it needs to match the preset's sync row (`tau_to_match`: a tree round costs
   more, the tree mask, build_tree's per-node ops, the path's cache gather, and its τ must pay);
4. the fair baseline: the eager AR step takes SDPA's unmasked causal path, while a verify pass
   with any mask makes HF's SDPA path copy K/V for every head. `ar_mask_cost_ms` is what the mask
   adds to one AR step (device time), and every eager row also carries the projection with the AR
   round made that much longer (`projected_speedup_masked_ar`): the bias, measured and stated. The
   compiled backend's AR step always takes the mask (a static pass does), so it has no such bias.
5. the draft vocabulary (drafter.draft_vocab; docs/design.md, Draft vocabulary): the drafter's
   synchronous draft and a tray pass of --tray-tokens tokens with its full LM head and with a head
   of --draft-vocab rows, interleaved, device-time medians and their ratios.
The JSON file is rewritten after every stage, so a crash or a timeout keeps what finished;
`problems` lists what makes the run unusable (exit status 1 when any).

    python scripts/gpu_readiness.py --target qwen3_8b --drafter qwen3_1p7b --tau 7.88
    python scripts/gpu_readiness.py --preset gpu_readiness_toy --target toy --drafter toy --device cpu
        --block-size 4 --hit-rate async_2x1=0.3 async_3x2=0.6 async_tree_3x2=0.5  # the tests' (one line)

Results: a printed table and a JSON file (default outputs/bench/gpu_readiness_<target>.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without `pip install -e .`

from d3d.models.random_models import SHAPES, NoText, as_drafter, random_model  # noqa: E402


def pass_split(model, prefix: int, device, repeats: int, width: int | None = None, blocks: int | None = None,
               masked: bool = False) -> dict:
    """One pass after a cached random prefix, logits included: `width` clean tokens through the
    target (1 = an AR step, B = a verify pass) or `blocks` mask blocks through the drafter (1 = a
    sync draft). Device time and host issue time apart (d3d.utils.timing.device_and_host_ms)."""
    from d3d.decoding.budget import block_pass_ms, clean_pass_ms
    from d3d.utils.timing import device_and_host_ms

    ids = torch.randint(0, model.config.vocab_size - 2, (1, prefix), device=device)
    if blocks is None:
        return clean_pass_ms(model, ids, width, repeats, masked=masked, timer=device_and_host_ms)
    return block_pass_ms(model, ids, blocks, repeats, timer=device_and_host_ms)


def draft_vocab_passes(drafter, n: int, prefix: int, device, repeats: int, tray_blocks: int, rounds: int = 3) -> dict:
    """The drafter's one-block draft and a `tray_blocks`-block tray pass, with its full LM head and with
    a draft vocabulary of n rows (the head over n of the vocabulary's ids, the mask's among them, as
    d3d.train builds it: d3d.models.drafter.attach_draft_head), alternated `rounds` times so that a
    drifting clock hits both alike; device-time medians and full/draft ratios."""
    from d3d.models.drafter import attach_draft_head
    from d3d.models.drafter_settings import DrafterSettings

    vocab, mask = drafter.config.vocab_size, DrafterSettings.of(drafter).mask_token_id
    n = min(n, vocab // 2)  # the toy shapes' vocabularies are a few hundred ids
    small = copy.deepcopy(drafter)
    attach_draft_head(small, torch.cat([torch.arange(n - 1), torch.tensor([mask])]).sort().values.to(device))
    ms = {k: [] for k in ("full_draft", "draft_vocab_draft", "full_tray", "draft_vocab_tray")}
    for _ in range(rounds):
        for tag, model in (("full", drafter), ("draft_vocab", small)):
            ms[f"{tag}_draft"].append(pass_split(model, prefix, device, repeats, blocks=1)["device_ms"])
            ms[f"{tag}_tray"].append(pass_split(model, prefix, device, repeats, blocks=tray_blocks)["device_ms"])
    med = {f"{k}_ms": statistics.median(v) for k, v in ms.items()}
    out = {"draft_vocab": n, "vocab": vocab, "head_rows": small.get_output_embeddings().weight.shape[0],
           "tray_blocks": tray_blocks, **med,
           "draft_speedup": med["full_draft_ms"] / med["draft_vocab_draft_ms"],
           "tray_speedup": med["full_tray_ms"] / med["draft_vocab_tray_ms"]}
    del small
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def loop_rounds(target, drafter, cfg, prefix: int, new_tokens: int, device) -> dict:
    """Run one of the real loops on a random prompt: medians per round of the host wall time and
    of each pass's device time (CUDA events; wall time on CPU), and their difference."""
    from d3d.decoding import SpecGenerator
    from d3d.decoding.methods import method_row

    gen = SpecGenerator(target, NoText(), drafter if method_row(cfg.method).needs_drafter else None, cfg, eos_token_ids=[])
    prompt = torch.randint(0, target.config.vocab_size - 2, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    from torch._dynamo.utils import counters

    # warm-up, as d3d.eval's: every pass of the timed call's shapes (its buffers sized for the timed
    # call), twice for a static backend (CUDA graph trees record a shape on its second run); its
    # seconds (the compiles) reported apart, and the graphs compiled inside the timed call counted
    t0 = time.perf_counter()
    for _ in range(2 if cfg.backend != "eager" else 1):
        gen.warm_up(1, prefix + new_tokens, prompt)
    warmup_s = time.perf_counter() - t0
    before = counters["stats"]["unique_graphs"]
    res = gen.generate([prompt], max_new_tokens=new_tokens)
    med = lambda k: 1000 * statistics.median([getattr(r, k) for r in res.rounds if getattr(r, k) is not None] or [0.0])  # noqa: E731
    out = {"rounds": len(res.rounds), "tau": res.mean_tau, "hit_rate": res.hit_rate, "round_wall_ms": med("wall_s"),
           "verify_ms": med("verify_s"), "draft_ms": med("draft_s"), "tray_ms": med("tray_s"),
           "warmup_s": round(warmup_s, 2), "compiles_in_timed": counters["stats"]["unique_graphs"] - before}
    # the device's critical path of a round: draft, then verify (the tray pass runs beside verify)
    out["overhead_ms"] = out["round_wall_ms"] - out["draft_ms"] - out["verify_ms"]
    out["overlap"] = measured_overlap(res.rounds)
    return out


def measured_overlap(rounds) -> float | None:
    """The share of a loop's tray passes that ran while its verify passes ran, from each round's
    events (RoundStats.tray_hidden_s of tray_s: 1 = every tray pass hidden behind verification,
    0 = run after it); None for a loop without timed trays (no trays, or a worker thread's)."""
    timed = [(r.tray_hidden_s, r.tray_s) for r in rounds if r.tray_hidden_s is not None and r.tray_s]
    return sum(h for h, _ in timed) / sum(t for _, t in timed) if timed else None


def project(tau: float, hit: float | None, t_ar: float, t_sync: float | None = None, t_miss: float | None = None,
            t_hit: float | None = None) -> float:
    """Speedup over AR from measured round times (ms): τ tokens per round against one per AR round."""
    if hit is None:
        return tau * t_ar / t_sync
    return tau * t_ar / expected_round(hit, t_miss, t_hit)


def expected_round(hit: float | None, t_miss: float, t_hit: float | None) -> float:
    """A round's expected time (ms): a miss round, or with hit rate `hit` a mix with hit rounds."""
    return t_miss if hit is None else hit * t_hit + (1 - hit) * t_miss


def hit_round(lp: dict) -> float:
    """An async loop's hit round (ms): its measured (miss) round less the synchronous draft a hit skips."""
    return max(lp["round_wall_ms"] - lp["draft_ms"], 1e-9)


# The paper's AIME25 hit rates (B = 16, async at C x F = 12x2, 16x2, 12x5), keyed by what a row's
# settings fix, its block size and its tray pass's tokens (the row's budget): a preset row with
# trays takes the rate of its budget, whatever its method (the 15-node async tree with 23 trays packs
# 12x2's 384 tokens and takes its rate); `--hit-rate ROW=RATE` gives a row its own.
PAPER_HIT_RATES = {(16, 384): 0.713, (16, 512): 0.783, (16, 912): 0.818}


def preset_rows(name: str, block_size: int) -> dict:
    """{row: DecodeConfig} of conf/bench/<name>.yaml, in its bench.methods order: each row its
    `methods.<row>` entry, a drafted row at the drafter's `block_size`. Read with PyYAML (a
    transformers dependency), as the GPU machines have no Hydra: a row must name its method there."""
    import yaml
    from d3d.configdir import config_dir
    from d3d.decoding import DecodeConfig
    from d3d.decoding.methods import method_row

    path = config_dir() / "bench" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"--preset {name}: no {path}")
    preset = yaml.safe_load(path.read_text())
    rows = {}
    for row in preset["bench"]["methods"]:
        settings = dict((preset.get("methods") or {}).get(row) or {})
        if "method" not in settings:
            raise ValueError(f"--preset {name}: bench.methods names {row!r}, which has no methods.{row}.method in "
                             f"{path} (this script reads no conf/decode/ defaults)")
        settings.pop("block_size", None)
        drafted = method_row(settings["method"]).needs_drafter
        rows[row] = DecodeConfig(**settings, **({"block_size": block_size} if drafted else {}))
    return rows


def roles(rows: dict) -> tuple[str, str]:
    """The preset's plain row (no drafter: every projection's baseline) and its first row of the
    table's drafted role (ROLES: the row the first row with trays equals without them): what a
    tree or a budget must beat."""
    from d3d.decoding.methods import ROLES, method_row

    plain = next((n for n, dc in rows.items() if not method_row(dc.method).needs_drafter), None)
    drafted = next((n for n, dc in rows.items() if dc.method == ROLES["drafted"]), None)
    if plain is None or drafted is None:
        raise ValueError(f"the preset's rows {list(rows)} need a row without a drafter and a {ROLES['drafted']} row: "
                         f"the projections are over the first and against the second")
    return plain, drafted


def without_trays(name: str, rows: dict) -> str | None:
    """The preset's row that `name` equals without its trays (its method's reference, on the same
    settings): the round an overlap is measured against; None when the preset times none."""
    from d3d.decoding.methods import method_row

    dc = rows[name]
    ref = method_row(dc.method).reference
    keys = method_row(ref).keys if ref else ()
    return next((n for n, o in rows.items() if o.method == ref and all(getattr(o, k) == getattr(dc, k) for k in keys)),
                None)


def per_row(values: list[str], rows: dict, flag: str, default: float | None = None) -> dict:
    """`--flag X ROW=X ...` as {row: value}: a bare X for every row, ROW=X for one row of the preset."""
    out = {row: default for row in rows}
    for v in values:
        row, eq, x = v.rpartition("=")
        if eq and row not in rows:
            raise ValueError(f"{flag} {v}: no row {row!r} in the preset ({', '.join(rows)})")
        for r in ([row] if eq else rows):
            out[r] = float(x)
    return out


def projection_row(row: str, method: str, backend: str, budget_tokens: int, tau: float, hit: float | None,
                   t_ar: float, t_round: float, t_hit: float | None, overlap: float | None,
                   mask_cost_ms: float | None) -> dict:
    """One projection row: the speedup over an AR round t_ar, and over one that pays the AR mask cost."""
    speed = project(tau, hit, t_ar, t_sync=t_round, t_miss=t_round, t_hit=t_hit)
    # a mask costs nothing or more: a negative difference of two timed passes is timer noise (toy
    # sizes on a busy CPU), and credited to AR it could make the round's time negative
    fair = None if mask_cost_ms is None else project(tau, hit, t_ar + max(mask_cost_ms, 0.0), t_sync=t_round,
                                                        t_miss=t_round, t_hit=t_hit)
    return {"row": row, "method": method, "backend": backend, "budget_tokens": budget_tokens, "tau_used": tau,
            "hit_rate": hit, "round_ms": t_round, "hit_round_ms": t_hit, "overlap": None if overlap is None else
            max(0.0, min(1.0, overlap)), "overlap_unclipped": overlap, "projected_speedup": speed,
            "projected_speedup_masked_ar": fair}


def overlap_from_rounds(t_sync: float, t_miss: float, t_tray: float) -> float | None:
    """Share of the tray pass an async round hides (1: all of it, 0: none): an async miss round is
    a sync round (draft + verify) with the tray pass beside verification, so what it costs over
    the sync round is the part of t_tray that did not overlap. Unclipped (noise can leave [0, 1]);
    None without a tray time."""
    if not t_tray > 0:
        return None
    return 1.0 - (t_miss - t_sync) / t_tray


def projections(loops: dict, rows: dict, suffix: str, taus: dict, hit_rates: dict,
                mask_cost_ms: float | None) -> list[dict]:
    """The projection rows of one backend (its loops' keys end in `suffix`), from its rounds: every
    row timed there but the plain one, over the plain row's round; a row with trays at its own hit
    rate, with the overlap against the row it equals without trays; each with the τ it needs to
    match the drafted row's projection (`tau_to_match`, `against`: a tree round costs more host and
    device time than a chain round of the same width, and its τ must pay for that)."""
    from d3d.decoding.methods import method_row

    plain, drafted = roles(rows)
    if plain + suffix not in loops or drafted + suffix not in loops:  # --compiled-rows left them out
        return []
    t_ar, t_ref = loops[plain + suffix]["round_wall_ms"], loops[drafted + suffix]["round_wall_ms"]
    out = []
    for name, dc in rows.items():
        lp = loops.get(name + suffix)
        if name == plain or lp is None:
            continue
        row, t_round = method_row(dc.method), lp["round_wall_ms"]
        hit = t_hit = overlap = None
        if row.trays:
            hit, t_hit = hit_rates[name], hit_round(lp)
            ref = without_trays(name, rows)
            if ref is not None and ref + suffix in loops:
                overlap = overlap_from_rounds(loops[ref + suffix]["round_wall_ms"], t_round, lp["tray_ms"])
        r = projection_row(name, dc.method, lp["backend"], row.budget(dc), taus[name], hit, t_ar, t_round, t_hit,
                           overlap, mask_cost_ms)
        out.append({**r, "tau_to_match": taus[drafted] * expected_round(hit, t_round, t_hit) / t_ref,
                    "against": drafted})
    return out


def problems(res: dict) -> list[str]:
    """What makes a readiness run unusable: a latency or round time that is not a positive number,
    a pass whose device time was not separated from the host's (the pre-queued sleep ran dry), a
    loop that ran no round or not on its backend, a projection that is not a positive finite
    speedup; on CUDA, an overlap outside [0, 1] by more than noise (0.25: the rounds' medians
    disagree; on a CPU the rounds of toy models are too short and too noisy for the bound)."""
    import math

    good = lambda x: isinstance(x, (int, float)) and math.isfinite(x) and x > 0  # noqa: E731
    bad = [f"passes[{k}]" for k, p in res.get("passes", {}).items()
           if not good(p["device_ms"]) or not good(p["host_issue_ms"])]
    bad += [f"passes[{k}]: the host did not run ahead of the device" for k, p in res.get("passes", {}).items()
            if p["ran_dry"]]
    bad += [f"loops[{k}]" for k, lp in res.get("loops", {}).items() if not lp["rounds"] or not good(lp["round_wall_ms"])]
    bad += [f"loops[{k}] ran on {lp['backend']}" for k, lp in res.get("loops", {}).items()
            if lp["backend"] != (k.partition("@")[2] or "eager")]
    bad += [f"loops[{k}]: {lp['compiles_in_timed']} graphs compiled inside the timed call"
            for k, lp in res.get("loops", {}).items() if lp["backend"] != "eager" and lp.get("compiles_in_timed")]
    bad += overlap_problems(res)
    for r in res.get("projection", []):
        where = f"projection[{r['row']}, {r['backend']}]"
        bad += [where] * (not good(r["projected_speedup"]))
        ov = r["overlap_unclipped"]
        if ov is not None and res.get("device", "").startswith("cuda"):
            bad += [f"{where}: overlap {ov}"] * (not -0.25 <= ov <= 1.25)
    missing = [k for k in ("passes", "verify_ms", "sync_draft_ms", "packed_ms", "loops", "projection") if k not in res]
    return bad + [f"{k} missing" for k in missing]


# The least share of a tray pass an async row must hide behind verification on the compiled backend
# at the paper's shapes (a Qwen3-8B target, a Qwen3-1.7B drafter) on CUDA: below it, async spends
# more than half its tray pass on the round's critical path, and loses to sync wherever hits are rare
MIN_OVERLAP = 0.5
OVERLAP_SHAPES = ("qwen3_8b", "qwen3_1p7b")


def overlap_problems(res: dict) -> list[str]:
    """Each async row (a row with trays) timed on the compiled backend at OVERLAP_SHAPES on CUDA
    whose measured overlap (loop_rounds' `overlap`) is missing or under MIN_OVERLAP, by name."""
    if not res.get("device", "").startswith("cuda") or (res.get("target"), res.get("drafter")) != OVERLAP_SHAPES:
        return []
    return [f"loops[{k}]: overlap {lp['overlap']} < {MIN_OVERLAP} (the share of its tray pass hidden behind "
            f"verification)" for k, lp in res.get("loops", {}).items()
            if lp["backend"] == "compiled" and lp.get("trays") and not (lp["overlap"] or 0) >= MIN_OVERLAP]


class Results(dict):
    """The result dict, rewritten to its JSON file after every stage (and handed to `on_stage`,
    so the GPU check records each stage in its own JSON as it lands)."""

    def __init__(self, path: Path, on_stage=None, **kw):
        super().__init__(**kw)
        self.path, self.on_stage = path, on_stage
        path.parent.mkdir(parents=True, exist_ok=True)

    def stage(self, name: str, value) -> None:
        self[name] = value
        self.setdefault("stages_done", []).append(name)
        self.path.write_text(json.dumps(self, indent=2, default=str))
        if self.on_stage is not None:
            self.on_stage(name, value)
        print(f"[gpu_readiness] {name} done", flush=True)


def main(argv: list[str] | None = None, on_stage=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpu_readiness",
                   help="conf/bench/<preset>.yaml: the rows whose loops are timed and projected (bench.methods)")
    p.add_argument("--target", default="qwen3_8b", choices=sorted(SHAPES))
    p.add_argument("--drafter", default="qwen3_1p7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=2048, help="cached context before the timed passes (2-4k is typical)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--block-size", type=int, default=16, help="block size of the drafter and of every drafted row")
    p.add_argument("--backends", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                   help="decode.backend of the loops, each row on those its method runs on (compiled: cold "
                        "compiles, ~90 s per 8B graph)")
    p.add_argument("--compiled-rows", nargs="+", default=None, metavar="ROW",
                   help="only these rows of the preset on the compiled backend (default: every row; each costs "
                        "cold compiles). A backend without the plain and the drafted row gets no projection")
    p.add_argument("--loop-tokens", type=int, default=64, help="tokens each real loop decodes (random weights: τ = 1)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tau", nargs="+", default=["7.88"], metavar="TAU|ROW=TAU",
                   help="τ measured elsewhere, for every row (paper: 7.88, Qwen3-8B) and ROW=TAU for one row of "
                        "the preset (random weights give no τ)")
    p.add_argument("--hit-rate", nargs="*", default=[], metavar="ROW=RATE",
                   help="a row's hit rate (default: the paper's AIME25 study at its block size and tray tokens, "
                        "PAPER_HIT_RATES); every row with trays needs one")
    p.add_argument("--draft-vocab", type=int, default=32000,
                   help="rows of the draft-vocabulary head timed beside the full one (0: not timed)")
    p.add_argument("--tray-tokens", type=int, default=384, help="tokens of the tray pass timed with each head")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from d3d.decoding.methods import method_row

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    B = args.block_size
    try:
        rows = preset_rows(args.preset, B)
        plain, drafted = roles(rows)
        taus = per_row(args.tau, rows, "--tau")
        hits = per_row(args.hit_rate, rows, "--hit-rate")
        unknown = sorted(set(args.compiled_rows or ()) - set(rows))
        if unknown:
            raise ValueError(f"--compiled-rows {' '.join(unknown)}: no such row in the preset ({', '.join(rows)})")
    except ValueError as err:
        p.error(str(err))
    budget = {name: method_row(dc.method).budget(dc) for name, dc in rows.items()}
    trays = [name for name, dc in rows.items() if method_row(dc.method).trays]
    for name in trays:  # a budget's hit rate is its own: never one for all
        hits[name] = PAPER_HIT_RATES.get((B, budget[name])) if hits[name] is None else hits[name]
    hits = {name: hits[name] for name in trays}
    missing = [name for name, h in hits.items() if h is None] + [name for name, t in taus.items() if t is None]
    if missing:
        p.error(f"no hit rate or τ for {', '.join(missing)}: the paper's hit rates are for B = 16 at "
                f"{sorted(t for _, t in PAPER_HIT_RATES)} tray tokens. Fix: --hit-rate ROW=RATE, --tau ROW=TAU")

    res = Results(Path(args.out or f"outputs/bench/gpu_readiness_{args.target}.json"), on_stage,
                  target=args.target, drafter=args.drafter, device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, prefix=args.prefix, block_size=B, preset=args.preset,
                  rows={name: {k: getattr(dc, k) for k in method_row(dc.method).reads() if k != "backend"}
                        for name, dc in rows.items()},
                  taus=taus, hit_rates=hits, backends=args.backends)
    target = random_model(args.target, device, dtype, seed=0)
    drafter = as_drafter(random_model(args.drafter, device, dtype, seed=1), B)
    split = lambda model, **kw: pass_split(model, args.prefix, device, args.repeats, **kw)  # noqa: E731
    passes = {f"verify_{b}": split(target, width=b) for b in sorted({*args.block_sizes, 1, B})}
    passes["ar_step_masked"] = split(target, width=1, masked=True)
    passes["sync_draft"] = split(drafter, blocks=1)
    # each row's tray pass as B-token blocks of its budget (a tree's trays pack as many tokens)
    passes.update({f"packed_{name}": split(drafter, blocks=-(-budget[name] // B)) for name in trays})
    res.stage("passes", passes)
    res.stage("verify_ms", {b: passes[f"verify_{b}"]["device_ms"] for b in sorted({*args.block_sizes, 1, B})})
    res.stage("sync_draft_ms", passes["sync_draft"]["device_ms"])
    res.stage("packed_ms", {name: passes[f"packed_{name}"]["device_ms"] for name in trays})
    if args.draft_vocab:
        dv = draft_vocab_passes(drafter, args.draft_vocab, args.prefix, device, args.repeats, max(1, args.tray_tokens // B))
        res.stage("draft_vocab", dv)
    mask_cost = passes["ar_step_masked"]["device_ms"] - passes["verify_1"]["device_ms"]
    res.stage("ar_mask_cost_ms", mask_cost)
    loops = {}
    for backend in args.backends:
        suffix = "" if backend == "eager" else f"@{backend}"
        for name, dc in rows.items():
            if backend not in method_row(dc.method).backends:  # a method that does not run there
                continue
            if backend == "compiled" and args.compiled_rows is not None and name not in args.compiled_rows:
                continue
            cfg = replace(dc, backend=backend)
            loops[name + suffix] = {**loop_rounds(target, drafter, cfg, args.prefix, args.loop_tokens, device),
                                    "method": cfg.method, "backend": cfg.backend,
                                    "trays": method_row(cfg.method).trays}
            res.stage("loops", loops)
    projected = []
    for backend in args.backends:
        projected += projections(loops, rows, "" if backend == "eager" else f"@{backend}", taus, hits,
                                 mask_cost if backend == "eager" else None)
    res.stage("projection", projected)
    res.stage("problems", problems(res))

    print(f"{args.target} target, {args.drafter} drafter, {res['device_name']}, {args.dtype}, prefix {args.prefix}, "
          f"preset {args.preset}")
    print("\n| pass | device ms | host issue ms | host-bound |\n|---|---|---|---|")
    for name, ps in passes.items():
        print(f"| {name} | {ps['device_ms']:.3f} | {ps['host_issue_ms']:.3f} | "
              f"{'yes' if ps['host_issue_ms'] > ps['device_ms'] else 'no'} |")
    if args.draft_vocab:
        dv = res["draft_vocab"]
        print(f"\ndraft vocabulary ({dv['draft_vocab']} of {dv['vocab']} rows): one-block draft {dv['full_draft_ms']:.3f} -> "
              f"{dv['draft_vocab_draft_ms']:.3f} ms ({dv['draft_speedup']:.2f}x), {dv['tray_blocks'] * B}-token tray pass "
              f"{dv['full_tray_ms']:.3f} -> {dv['draft_vocab_tray_ms']:.3f} ms ({dv['tray_speedup']:.2f}x)")
    print(f"\nAR step: the explicit mask costs {mask_cost:.3f} ms of device time (eager AR skips it; verification "
          "with a mask pays it): projected_speedup_masked_ar adds it to the eager AR round")
    print("\n| loop | backend | round wall ms | draft ms | verify ms | tray ms | overhead ms | overlap |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, lp in loops.items():
        ov = "—" if lp["overlap"] is None else f"{lp['overlap']:.2f}"
        print(f"| {name} | {lp['backend']} | {lp['round_wall_ms']:.2f} | {lp['draft_ms']:.2f} | {lp['verify_ms']:.2f} | "
              f"{lp['tray_ms']:.2f} | {lp['overhead_ms']:.2f} | {ov} |")
    print(f"\n| row | backend | packed tokens | τ | hit rate | round ms (miss / hit) | overlap | projected speedup over "
          f"{plain} | with {plain} masked | τ to match {drafted} |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in projected:
        hr = "—" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        rt = f"{r['round_ms']:.2f}" + ("" if r["hit_round_ms"] is None else f" / {r['hit_round_ms']:.2f}")
        ov = "—" if r["overlap"] is None else f"{r['overlap']:.2f}"
        fair = "—" if r["projected_speedup_masked_ar"] is None else f"{r['projected_speedup_masked_ar']:.2f}×"
        print(f"| {r['row']} | {r['backend']} | {r['budget_tokens'] or '—'} | {r['tau_used']} | {hr} | {rt} | {ov} | "
              f"{r['projected_speedup']:.2f}× | {fair} | {r['tau_to_match']:.2f} |")
    print(f"\nproblems: {res['problems'] or 'none'}\nwritten: {res.path}")
    return res


if __name__ == "__main__":
    sys.exit(1 if main()["problems"] else 0)
