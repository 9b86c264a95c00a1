"""What a draft vocabulary (drafter.draft_vocab) saves: the drafter's pass time with and without it at
real shapes, and how much of a response set N tokens cover.

    python scripts/bench_draft_vocab.py passes [--shapes qwen25_coder_05b qwen3_1p7b --draft-vocab 32000
                                                --prefix 256 --rounds 5 --repeats 3 --device cpu]
    python scripts/bench_draft_vocab.py coverage RESPONSES_DIR ... [--texts FILE.jsonl:FIELD --tokenizer DIR]
                                                 [--ids ROWS.jsonl:token_ids --drafter DRAFTER_DIR]
                                                 [--sizes 1000 2000 ...]

`passes` times, on random weights of each shape (a pass's time does not depend on the weights), one
synchronous draft pass (a block of 16 after a cached prefix; B = 16 rows) and one tray pass (24 blocks:
384 tokens, a chain's C=12 F=2 tray pass), each as the decoding loop runs it: the backbone, the LM head
on every row of the pass and the float copy of its logits, and, with a draft vocabulary, the scatter of
one block's logits into the target's vocabulary that the round makes its drafts from. The full head and
the draft head (its first N rows: timing does not depend on which) run on the same backbone, swapped
in place, interleaved round by round (the order alternating); each round's figure is the median of
its repeats after a warm-up, and the table's is the median over rounds. `coverage` reads response folders
(d3d.generate's output) and reports, per folder, the share of response tokens the N most frequent ones
cover, as d3d.models.drafter.choose_draft_vocab picks them (here without the tokenizer's specials,
which the responses' own counts already rank): chosen on the even rows, measured on them and on the odd
rows; `--tokenizer DIR` gives the vocabulary's size (else the largest id seen + 1), and
`--texts FILE.jsonl:FIELD` adds texts (reference answers, say) tokenised there, `--ids` token-id lists
(a d3d.bench run's responses), and `--drafter DIR` measures a trained drafter's own map on every set. Both write JSON (default under docs/results/) with the
machine's CPU or GPU recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from d3d.utils.io import write_json
from d3d.utils.runinfo import run_info

# Config fields of the published models (their config.json): the Qwen2.5-Coder-0.5B drafter and Qwen3-1.7B.
SHAPES = {
    "qwen25_coder_05b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                       tie_word_embeddings=True, max_position_embeddings=32768)),
    "qwen3_1p7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=32768)),
}
BLOCK = 16


def random_drafter(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from d3d.models.drafter_settings import DrafterSettings

    kind, fields = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    vocab = fields["vocab_size"]
    DrafterSettings(block_size=BLOCK, mask_token_id=vocab - 1, vocab_size=vocab,
                    kept_layers=list(range(fields["num_hidden_layers"]))).attach(model)
    return model


@torch.inference_mode()
def pass_ms(model, prefix: torch.Tensor, blocks: int, repeats: int) -> float:
    """Median of `repeats` passes of `blocks` blocks after a cached prefix (one warm-up first), each
    as Passes.draft_pass / the tray pass runs it, plus the mapping of one block (Passes.target_vocab);
    the cache is cropped back to the prefix after each, as the loop crops a pass's blocks."""
    from transformers import DynamicCache

    from d3d.models.drafter_settings import DrafterSettings, draft_map
    from d3d.models.forward import hidden_states, in_target_vocab, logits_at
    from d3d.models.masks import block_layout, clean_layout
    from d3d.utils.timing import timed

    n, dev = prefix.shape[1], prefix.device
    s = DrafterSettings.of(model)
    x = torch.full((1, blocks * BLOCK), s.mask_token_id, dtype=torch.long, device=dev)
    layout = block_layout(torch.full((1, blocks), n, device=dev), BLOCK)
    d2t = draft_map(model)
    cache = DynamicCache(config=model.config)
    hidden_states(model, prefix, clean_layout(n, device=dev), cache=cache, plain=True)

    def one():
        h = hidden_states(model, x, layout, cache=cache, cache_len=n, plain=False)
        logits = logits_at(model, h, s.vocab_size, draft_ids=True).float()
        in_target_vocab(logits[:, :BLOCK], d2t, s.vocab_size)
        cache.crop(-x.shape[1])  # back to the prefix

    return timed(one, dev, repeats)


def passes(args) -> dict:
    from d3d.models.drafter import attach_draft_head
    from d3d.models.target import torch_dtype

    device = torch.device(args.device)
    dtype = torch_dtype(args.dtype, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"threads": torch.get_num_threads(), "draft_vocab": args.draft_vocab, "prefix": args.prefix, "block": BLOCK, "tray_blocks": args.tray_blocks,
           "rounds": args.rounds, "repeats_per_round": args.repeats, "dtype": str(dtype).split(".")[-1], "shapes": {}}
    for shape in args.shapes:
        model = random_drafter(shape, device, dtype)
        full_head = model.get_output_embeddings()
        draft = copy_with_draft_head(model, args.draft_vocab, attach_draft_head)
        heads = {"full": full_head, "draft": draft}
        prefix = torch.randint(10, SHAPES[shape][1]["vocab_size"] - 1, (1, args.prefix), device=device)
        times: dict = {(h, p): [] for h in heads for p in ("block", "tray")}
        t0 = time.perf_counter()
        for r in range(args.rounds):  # interleaved: a change in machine load hits both heads alike
            for name in (heads if r % 2 == 0 else reversed(list(heads))):
                model.set_output_embeddings(heads[name])
                times[(name, "block")].append(pass_ms(model, prefix, 1, args.repeats))
                times[(name, "tray")].append(pass_ms(model, prefix, args.tray_blocks, args.repeats))
        model.set_output_embeddings(full_head)
        med = {f"{h}_{p}_ms": round(statistics.median(v), 3) for (h, p), v in times.items()}
        row = {**med,
               "block_speedup": round(med["full_block_ms"] / med["draft_block_ms"], 3),
               "tray_speedup": round(med["full_tray_ms"] / med["draft_tray_ms"], 3),
               # the median of each round's own ratio: robust to a load that drifts between rounds
               **{f"{p}_speedup_paired": round(statistics.median(f / d for f, d in zip(times[("full", p)], times[("draft", p)])), 3)
                  for p in ("block", "tray")},
               "head_rows": {"full": full_head.weight.shape[0], "draft": args.draft_vocab},
               "all_ms": {f"{h}_{p}": [round(t, 3) for t in v] for (h, p), v in times.items()},
               "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"{shape}: B={BLOCK} pass full {med['full_block_ms']:.1f} ms, draft vocab {med['draft_block_ms']:.1f} ms "
              f"({row['block_speedup']:.2f}x, per round {row['block_speedup_paired']:.2f}x); {args.tray_blocks * BLOCK}-token "
              f"tray pass {med['full_tray_ms']:.1f} -> {med['draft_tray_ms']:.1f} ms ({row['tray_speedup']:.2f}x, per round "
              f"{row['tray_speedup_paired']:.2f}x)", flush=True)
        out["shapes"][shape] = row
        del model, full_head, draft, heads
    return out


def copy_with_draft_head(model, n: int, attach):
    """The DraftHead of the model's first n rows, the model's own head left in place."""
    full = model.get_output_embeddings()
    tied = model.config.tie_word_embeddings
    attach(model, torch.arange(n, device=full.weight.device))
    draft = model.get_output_embeddings()
    model.set_output_embeddings(full)
    model.config.tie_word_embeddings = tied
    return draft


def coverage(args) -> dict:
    """Per response set: the draft vocabulary choose_draft_vocab picks from its even rows (the N most
    frequent tokens, then the lowest ids: a BPE tokenizer's earliest merges), and the share of tokens
    it covers on those rows (in sample) and on its odd rows (held out: what a drafter meets after training)."""
    from d3d.models.drafter import choose_draft_vocab, coverage as covered

    vocab = None
    sets = {str(folder): [r["response_ids"] for r in read_rows(folder)] for folder in args.responses}
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
        vocab = len(tok)
        for spec in args.texts:
            path, field = spec.rsplit(":", 1)
            texts = [json.loads(line)[field] for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
            sets[f"{path}:{field}"] = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for spec in args.ids:
        path, field = spec.rsplit(":", 1)
        lists = [json.loads(line)[field] for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        sets[f"{path}:{field}"] = [list(ids) for ids in dict.fromkeys(map(tuple, lists))]
    d2t = None
    if args.drafter:  # the map d3d.train chose and saved (lm_head.d2t), measured on every set as it is
        from d3d.models.drafter import read_draft_head

        d2t = read_draft_head(args.drafter)[1]
        if d2t is None:
            sys.exit(f"error: --drafter {args.drafter}: no lm_head.d2t in its weights (a full-head drafter). "
                     "Fix: name a drafter trained with drafter.draft_vocab=N.")
    out = {"sizes": args.sizes, "tokenizer": str(args.tokenizer), "drafter": str(args.drafter) if d2t is not None else None,
           "drafter_vocab": len(d2t) if d2t is not None else None, "sets": {}}
    for name, rows in sets.items():
        v = vocab or 1 + max(t for ids in rows for t in ids)
        row = {"rows": len(rows), "tokens": sum(map(len, rows)),
               "distinct": len({t for ids in rows for t in ids}), "in_sample": {}, "held_out": {}}
        for n in [n for n in args.sizes if n <= v]:
            chosen, row["in_sample"][n] = choose_draft_vocab(rows[0::2], n, v, [])
            row["in_sample"][n], row["held_out"][n] = round(row["in_sample"][n], 5), round(covered(rows[1::2], chosen), 5)
        if d2t is not None:
            row["drafter_map"] = round(covered(rows, d2t), 5)
            print(f"{name}: the drafter's map of {len(d2t)} covers {100 * row['drafter_map']:.2f}%", flush=True)
        out["sets"][name] = row
        print(f"{name}: {row['rows']} rows, {row['tokens']} tokens, {row['distinct']} distinct; chosen on the even rows, "
              "covers (in sample / odd rows): " + ", ".join(f"N={n}: {100 * row['in_sample'][n]:.2f}% / "
                                                          f"{100 * row['held_out'][n]:.2f}%" for n in row["in_sample"]), flush=True)
    return out


def read_rows(folder: Path) -> list[dict]:
    """The whole rows of a response folder (a shard being appended to may end in a partial line)."""
    rows = []
    for shard in sorted(Path(folder).glob("responses.rank*.jsonl")):
        for line in shard.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("passes")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--tray-blocks", type=int, default=24)  # 384 tokens: a chain's C=12 F=2 at B=16
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None)
    c = sub.add_parser("coverage")
    c.add_argument("responses", nargs="*", type=Path)
    c.add_argument("--texts", nargs="*", default=[], help="FILE.jsonl:FIELD texts (e.g. reference answers)")
    c.add_argument("--tokenizer", type=Path, help="the tokenizer folder that --texts are tokenised with")
    c.add_argument("--sizes", nargs="+", type=int, default=[500, 1000, 2000, 4000, 8000, 16000, 32000])
    c.add_argument("--ids", nargs="*", default=[], help="FILE.jsonl:FIELD token-id lists (a d3d.bench rows.jsonl's "
                   "token_ids: the target's responses to its prompts; equal lists are counted once)")
    c.add_argument("--drafter", type=Path, default=None,
                   help="a trained draft-vocabulary drafter: also the share of each set its saved map covers")
    c.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = passes(args) if args.what == "passes" else coverage(args)
    device = getattr(args, "device", "cpu")
    result["run"] = run_info(device)
    stamp = time.strftime("%Y-%m-%d")
    path = args.out or Path("docs/results") / f"draft_vocab_{args.what}_{stamp}.json"
    write_json(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
