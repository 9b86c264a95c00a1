"""Decoding: contract 1 (greedy == target.generate), 2 (lossless sampling), 4 (estimator == loop),
async == sync, hits and misses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.drafts import Chain, Draft
from d3d.decoding.methods import Method, drafts_of, method_row
from d3d.decoding.schedules import Async, Schedule, Sync
from d3d.decoding.tree import Tree
from d3d.decoding.tree_drafts import TreeDrafts
from d3d.decoding.verify import Sampling, probs
from d3d.estimator import greedy_rounds, match_lengths
from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.models.drafter import build_drafter
from d3d.models.drafter_settings import DrafterSettings
from d3d.models.masks import tree_ancestors
from d3d.settings import bind_config
from tests.conftest import compose
from tests.integration.conftest import PROMPTS, reference, two_token_tv


CASES = [("ar", 1, 1, 0), ("sync", 2, 1, 0), ("sync", 6, 1, 0), ("async", 6, 3, 2), ("async", 4, 4, 1),
         ("async", 6, 6, 3)]


@pytest.mark.parametrize("method,B,C,F", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_contract1_greedy_equals_generate(models, method, B, C, F, batch):
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:batch]]
    gen = SpecGenerator(target, tok, None if method == "ar" else drafter,
                        DecodeConfig(method=method, block_size=B, C=C, F=F, max_new_tokens=40))
    res = gen.generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 40, tok.eos_token_id), (method, row)
    assert sum(res.taus()) == res.new_tokens


@pytest.mark.parametrize("method", ["sync", "async"])
def test_eos_inside_a_block_ends_there(models, method):
    target, drafter, tok = models
    prompt = tok(PROMPTS[0])["input_ids"]
    free = reference(target, tok, prompt, 30, tok.eos_token_id)
    eos = free[7]  # pretend the 8th generated token is an end-of-sequence token
    gen = SpecGenerator(target, tok, drafter, DecodeConfig(method=method, block_size=6, C=3, F=2, max_new_tokens=30),
                        eos_token_ids=[eos])
    res = gen.generate([prompt])
    assert res.token_ids[0] == reference(target, tok, prompt, 30, eos) == free[: free.index(eos) + 1]
    assert res.finish_reasons == ["stop"]


def test_the_generate_reference_stops_where_our_ar_loop_stops(models):
    """d3d.decoding.reference.HFGenerate (eval's `generate` row): the same tokens as our AR loop, the
    end-of-sequence token kept and the finish reason alike, and the whole budget otherwise."""
    from d3d.decoding.reference import HFGenerate

    target, _, tok = models
    prompt = tok(PROMPTS[0])["input_ids"]
    free = reference(target, tok, prompt, 30, tok.eos_token_id)
    eos = free[7]  # pretend the 8th generated token is an end-of-sequence token
    for eos_ids, n in (([eos], 30), ([tok.eos_token_id], 12)):
        cfg = DecodeConfig(method="ar", block_size=1, max_new_tokens=n)
        ours = SpecGenerator(target, tok, None, cfg, eos_token_ids=eos_ids).generate([prompt])
        theirs = HFGenerate(target, tok, cfg, eos_ids).generate([prompt])
        assert theirs.token_ids == ours.token_ids and theirs.finish_reasons == ours.finish_reasons
        assert theirs.prefill_s > 0 and theirs.decode_s > 0
    assert ours.new_tokens == 12 and ours.finish_reasons == ["length"]


def test_max_new_tokens_is_exact(models):
    target, drafter, tok = models
    for n in (1, 5, 13):
        res = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=n)).generate(
            [tok(PROMPTS[1])["input_ids"]])
        assert len(res.token_ids[0]) == n


@pytest.mark.parametrize("overlap", ["none", "thread"])
def test_async_returns_the_sync_tokens_and_rounds(models, overlap):
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    threads = torch.get_num_threads()
    sync = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=30)).generate(prompts)
    gen = SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=6, C=4, F=2, overlap=overlap,
                                                           cpu_threads_drafter=1, max_new_tokens=30))
    asyn = gen.generate(prompts)
    assert asyn.token_ids == sync.token_ids
    assert asyn.taus() == sync.taus()  # a hit serves exactly the block a synchronous draft would
    # the worker thread is gone and the process keeps all its cores for what runs next
    assert gen.passes.pool is None and torch.get_num_threads() == threads


def test_overlap_mode_resolution():
    """The overlap mode is asked of the method's class: async resolves decode.overlap per device,
    a method that does not overlap (sync) runs serially whatever decode.overlap says. A value
    outside auto | stream | thread | none never reaches this: DecodeConfig refuses it
    (test_bad_decode_settings_are_refused_at_construction)."""
    from d3d.errors import ConfigError

    cpu, cfg = torch.device("cpu"), lambda **kw: DecodeConfig(method="async", **kw)
    assert Async.overlap_mode(cfg(overlap="auto"), cpu) == "none"  # serial on CPU (measured faster)
    assert Async.overlap_mode(cfg(overlap="auto"), torch.device("cuda")) == "stream"
    assert Async.overlap_mode(cfg(overlap="thread"), cpu) == "thread"
    assert Async.overlap_mode(cfg(overlap="none"), torch.device("cuda")) == "none"
    assert Sync.overlap_mode(DecodeConfig(method="sync", overlap="thread"), cpu) == "none"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Async.overlap_mode(cfg(overlap="stream"), cpu)
    with pytest.raises(ConfigError, match="for CPUs; on CUDA use stream"):  # its worker would use the default stream
        Async.overlap_mode(cfg(overlap="thread"), torch.device("cuda"))


def test_hits_and_misses_on_a_constructed_case(models):
    """With every slot covered and every alternative tray present (F = V-1), a round that ends in
    a rejection is always a hit; with F = 0 only the all-accepted tray exists, so only rounds that
    accept every draft can hit."""
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    prompt = [tok(PROMPTS[2])["input_ids"]]
    full = SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=4, C=4, F=s.vocab_size - 1,
                                                            max_new_tokens=24)).generate(prompt)
    pairs = [(r.tau[0], r.hit[0]) for r in full.rounds if r.hit is not None]
    assert pairs and all(hit for tau, hit in pairs if tau < 4)
    assert full.hit_rate > 0.5
    for C, F in [(4, 0), (1, 2)]:
        none = SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=4, C=C, F=F,
                                                                max_new_tokens=24)).generate(prompt)
        pairs = [(r.tau[0], r.hit[0]) for r in none.rounds if r.hit is not None]
        assert not any(hit for tau, hit in pairs if tau < 4)
        assert none.token_ids == full.token_ids


def test_contract4_estimator_equals_loop_tau(models):
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    for text in PROMPTS:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=40)).generate([prompt])
        ids = prompt + res.token_ids[0]
        m = match_lengths(drafter, ids, len(prompt), 6, s.mask_token_id, s.vocab_size)
        assert greedy_rounds(m, len(prompt), len(ids), 6) == res.taus()


@pytest.mark.parametrize("nodes", [3, 15])
def test_contract4_estimator_equals_loop_tau_on_trees(models, nodes):
    """The offline estimator with the tree's drafts: the loop's τ round by round, on the greedy tree loop's
    own output (= the target's greedy response)."""
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    for text in PROMPTS:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, drafter, DecodeConfig(method="tree", block_size=6, tree_nodes=nodes,
                                                               max_new_tokens=40)).generate([prompt])
        ids = prompt + res.token_ids[0]
        tree = drafts_of(DecodeConfig(method="tree", block_size=6, tree_nodes=nodes))
        m = match_lengths(drafter, ids, len(prompt), 6, s.mask_token_id, s.vocab_size, drafts=tree)
        assert greedy_rounds(m, len(prompt), len(ids), 6) == res.taus(), text


@pytest.mark.parametrize("method,backend", [("sync", "eager"), ("tree", "eager"), ("async_tree", "eager")] + [
    # inductor compiles each pass per batch bucket (4096 rows, then the rows left): ~1-2 min on 2 cores
    pytest.param(m, "compiled", marks=pytest.mark.heavy) for m in ("tree", "async_tree")])
def test_contract2_end_to_end_two_tokens(models, method, backend):
    """The loop at T = 1 on a 2-token horizon: the joint law of (x1, x2) is the target's (a tree's
    second token is decided by a child's own law after a sibling was accepted or rejected; an async
    tree's by a tray's tree when the first round hit). On the compiled backend too, where the
    accepted path's slots are moved in the static buffers between compiled passes."""
    target, drafter, tok = models
    prompt = tok("ab")["input_ids"]
    n = 3000
    s = Sampling(temperature=1.0, top_k=4)  # top-k keeps the support small enough to test
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method=method, block_size=4, temperature=1.0, top_k=4,
                                                           tree_nodes=4, tree_trays=6, max_new_tokens=2,
                                                           backend=backend),
                        seed=0).generate([prompt] * n)
    tv = two_token_tv(target, prompt, s, res.token_ids)
    assert tv < 0.06, tv  # 16 outcomes, n = 3000: sampling noise gives TV ~0.03


def test_stop_string_inside_an_accepted_run(models):
    target, drafter, tok = models
    prompt = tok(PROMPTS[3])["input_ids"]
    free = reference(target, tok, prompt, 30, tok.eos_token_id)
    stop = tok.decode(free[9:11])  # text made by the 10th and 11th tokens
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=30,
                                                           stop_strings=[stop])).generate([prompt])
    out = res.token_ids[0]
    assert out == free[: len(out)] and stop in tok.decode(out) and stop not in tok.decode(out[:-1])
    assert res.finish_reasons == ["stop"]


@pytest.mark.slow
def test_contract1_on_the_real_smollm2_target(cache_dir):
    """fp32 greedy equality with generate on the CPU default target, drafter = its untrained copy."""
    cfg = bind_config(compose("train", []), "train")
    path = resolve_model_path(cfg.target, cache_dir)
    tok, target = load_tokenizer(path), load_model(path, "float32", "cpu")
    drafter, _ = build_drafter(cfg.drafter, cfg.target, cache_dir, dtype="float32")
    from d3d.data.chat import chat_prompt_ids

    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": q}]) for q in
               ["What is 12 times 7? Explain briefly.", "Write a Python function that reverses a string."]]
    for method in ["sync", "async"]:
        res = SpecGenerator(target, tok, drafter, DecodeConfig(method=method, block_size=16, C=4, F=2,
                                                               max_new_tokens=48)).generate(prompts)
        for row, p in enumerate(prompts):
            assert res.token_ids[row] == reference(target, tok, p, 48, tok.eos_token_id), (method, row)


@pytest.mark.parametrize("C,F", [(4, 2), (9, 1)])
def test_budget_is_the_packed_pass_size(models, monkeypatch, C, F):
    """run.json and the budget sweep report the method's budget (Method.budget) as the packed tokens: it must be the
    size of the pass the loop really runs (glue + trays), also when C exceeds the draft slots."""
    target, drafter, tok = models
    sizes, real = [], Async._tray_pass

    def tray_pass(self, dr, *args):
        forward = dr.forward
        dr.forward = lambda ids, layout, **kw: (sizes.append(ids.shape[1]), forward(ids, layout, **kw))[1]
        try:
            return real(self, dr, *args)
        finally:
            dr.forward = forward

    monkeypatch.setattr(Async, "_tray_pass", tray_pass)
    cfg = DecodeConfig(method="async", block_size=6, C=C, F=F, max_new_tokens=20)
    SpecGenerator(target, tok, drafter, cfg).generate([tok(PROMPTS[0])["input_ids"]])
    assert sizes and set(sizes) == {method_row("async").budget(cfg)}  # (C, F) = (9, 1) at B = 6: 42 tokens, not 60


TRAP_CASES = [(m, t, batch) for m in ("ar", "sync", "async", "tree", "async_tree") for t in (0.0, 1.0) for batch in (1, 3)]


@pytest.mark.parametrize("method,temperature,batch", TRAP_CASES)
def test_contract8_loop_is_device_clean(models, method, temperature, batch):
    """The CPU stand-in for a GPU run: with the default device set to `meta`, any tensor the loop
    makes without naming a device is a meta tensor, and the first op that mixes it with the
    model's (CPU) tensors fails. On CUDA the same bug mixes CPU and CUDA tensors. The outputs must
    also equal an untrapped run's (same seed), so the trap changed nothing but the failure mode."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:batch]]
    if batch > 1:
        prompts[1] = prompts[1][:2]  # ragged: rows of different lengths, finishing at different rounds
    cfg = DecodeConfig(method=method, block_size=4, C=3, F=2, tree_nodes=5, tree_trays=4, temperature=temperature,
                       max_new_tokens=12 + batch)
    make = lambda: SpecGenerator(target, tok, None if method == "ar" else drafter, cfg, seed=3)  # noqa: E731
    free = make().generate(prompts)
    torch.set_default_device("meta")
    try:
        trapped = make().generate(prompts)
    finally:
        torch.set_default_device(None)
    assert trapped.token_ids == free.token_ids and trapped.taus() == free.taus()


def test_estimator_is_device_clean(models):
    """Pruning runs the offline estimator on the GPU: the same meta-device trap as the loop."""
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    ids = tok(PROMPTS[0])["input_ids"] + tok(PROMPTS[3])["input_ids"]
    free = match_lengths(drafter, ids, 4, 6, s.mask_token_id, s.vocab_size, chunk=5)
    torch.set_default_device("meta")
    try:
        trapped = match_lengths(drafter, ids, 4, 6, s.mask_token_id, s.vocab_size, chunk=5)
    finally:
        torch.set_default_device(None)
    assert torch.equal(trapped, free)


def test_batched_async_serves_each_row_that_hit(models):
    """In a batch, a row whose outcome hit takes its tray and only the rows that missed are
    drafted (on CPU, from a copy of their KV rows); the output is still the sync loop's."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    sync = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=30)).generate(prompts)
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=6, C=4, F=2,
                                                           max_new_tokens=30)).generate(prompts)
    assert res.token_ids == sync.token_ids and res.taus() == sync.taus()
    mixed = [r for r in res.rounds if r.drafted_rows is not None and 0 < r.drafted_rows < len(r.rows)]
    assert mixed, "no round served some rows from trays and drafted the others"
    for prev, cur in zip(res.rounds, res.rounds[1:]):  # a round drafts exactly the rows that missed before
        missed = [row for row, h in zip(prev.rows, prev.hit) if not h and row in cur.rows]
        assert (cur.drafted_rows or 0) == len(missed)


@pytest.mark.parametrize("key, value, message", [
    ("block_size", 0, r"decode.block_size=0: an integer in \[2, 256\]"), ("block_size", -1, "block_size=-1"),
    ("block_size", 1000, r"block_size=1000: an integer in \[2, 256\]"), ("temperature", -1, "temperature=-1: a number >= 0"),
    ("top_p", 2, r"top_p=2: a number in \(0, 1\]"), ("top_p", 0, "top_p=0"), ("top_k", -1, "top_k=-1: an integer >= 0"),
    ("method", "nonsense", "method='nonsense': use ar, sync"), ("max_new_tokens", 0, "max_new_tokens=0"),
    ("C", 0, "C=0"), ("F", -1, "F=-1"), ("coverage", "most", "coverage='most'"),
    ("tree_nodes", 0, "tree_nodes=0: an integer >= 1"), ("tree_trays", 0, "tree_trays=0: an integer >= 1"),
    ("overlap", "threads", "overlap='threads': use auto, stream, thread or none"),
    ("backend", "jit", "backend='jit': use eager, static, compiled or frozen"),
])
def test_bad_decode_settings_are_refused_before_any_model_loads(key, value, message):
    """Before: these failed deep in torch after the models loaded, ran silently greedy, or did nothing.
    A DecodeConfig refuses its values' ranges; the method's row refuses what depends on the method
    (d3d.decoding.methods.checked, which bind_decode and SpecGenerator call)."""
    from d3d.errors import ConfigError
    from d3d.decoding.methods import checked

    with pytest.raises(ConfigError, match=message) as err:
        checked(DecodeConfig(**{key: value}))
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)  # one line, with the fix


@pytest.mark.parametrize("method", ["sync", "async"])
def test_one_token_prompts_and_a_row_that_ends_in_round_one(models, method):
    """Empty caches (one-token prompts) and a row retired in the first round: HF skips empty layers
    when selecting rows, which left the drafter's cache at the old batch size (a crash in sync)."""
    target, drafter, tok = models
    prompts = [[5], [77], [120]]
    cfg = DecodeConfig(method=method, block_size=4, C=3, F=2, max_new_tokens=12)
    free = SpecGenerator(target, tok, drafter, cfg, eos_token_ids=[]).generate(prompts)
    eos = free.token_ids[0][0]  # row 0 stops at its first token
    res = SpecGenerator(target, tok, drafter, cfg, eos_token_ids=[eos]).generate(prompts)
    for p, got in zip(prompts, res.token_ids):
        assert got == reference(target, tok, p, 12, eos)
    assert res.finish_reasons[0] == "stop" and len(res.token_ids[0]) == 1


# ---- the seam: a new method is its class (and its config), nothing else


class PromptLookup(Schedule):
    """Prompt-lookup drafts (drafter-free): what followed the latest earlier occurrence of the row's
    last n tokens (n = 3, 2, 1) in its own prompt and output, the pending token repeated where none
    occurred, verified as a chain. Written against the seam only: its class attributes and the hooks."""

    needs_drafter = False
    NGRAM = 3

    def begin(self, prompts):
        self.text = [list(p) for p in prompts]  # each row's tokens so far, the pending one last

    def propose(self, r):
        n = self.passes.B - 1
        r.draft = Draft(torch.tensor([self.lookup(t, n) for t in self.text], dtype=torch.long, device=self.passes.device))

    @classmethod
    def lookup(cls, text: list[int], n: int) -> list[int]:
        for size in range(min(cls.NGRAM, len(text) - 1), 0, -1):
            for start in range(len(text) - size - 1, -1, -1):
                if text[start : start + size] == text[-size:]:
                    follow = text[start + size : start + size + n]
                    return follow + [text[-1]] * (n - len(follow))
        return [text[-1]] * n

    def commit(self, r, host, most):
        for text, (a, tok, _, *drafted) in zip(self.text, host):
            text.extend(drafted[:a] + [tok])

    def retire(self, keep, keep_list):
        self.text = [self.text[i] for i in keep_list]


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_a_chain_method_registered_in_a_test_decodes_losslessly(models, monkeypatch, backend):
    """A new chain method is one class and one registry entry: its decode file binds with the keys
    its class declares, and the driver runs it unchanged: greedy output equals generate on a
    ragged batch, and it samples (T > 0) with its drafts verified as certain (q one-hot)."""
    from d3d.decoding.methods import METHODS
    from d3d.settings import bind_decode, decode_keys

    monkeypatch.setitem(METHODS, "lookup", Method(Chain, PromptLookup))
    target, _, tok = models
    assert set(decode_keys("lookup")) == {"method", "temperature", "top_p", "top_k", "backend", "block_size"}
    cfg = bind_decode({"name": "lookup_b5", "method": "lookup", "block_size": 5, "temperature": 0.0, "top_p": 1.0,
                       "top_k": 0, "backend": backend}, "methods.lookup")
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    res = SpecGenerator(target, tok, None, replace(cfg, max_new_tokens=40)).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 40, tok.eos_token_id), row
    assert sum(res.taus()) == res.new_tokens and max(res.taus()) > 1  # some lookups were accepted
    sampled = SpecGenerator(target, tok, None, replace(cfg, temperature=1.0, max_new_tokens=20), eos_token_ids=[])
    assert [len(t) for t in sampled.generate(prompts, seed=1).token_ids] == [20] * 3


def test_an_async_subclass_under_a_new_name_keeps_its_overlap(models, monkeypatch):
    """The driver asks the class whether it overlaps, not the name: an Async subclass registered as
    `trays` keeps the side stream on CUDA and the worker thread on CPU (before: overlap was decided
    by `method == "async"`, so it silently ran serially), and returns the sync tokens and rounds."""
    from d3d.decoding.methods import METHODS

    monkeypatch.setitem(METHODS, "trays", Method(Chain, type("Trays", (Async,), {})))
    target, drafter, tok = models
    trays = lambda **kw: DecodeConfig(method="trays", block_size=6, C=4, F=2, max_new_tokens=30, **kw)  # noqa: E731
    assert METHODS["trays"].overlap_mode(trays(), torch.device("cuda")) == "stream"
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    sync = SpecGenerator(target, tok, drafter, DecodeConfig(method="sync", block_size=6, max_new_tokens=30)).generate(prompts)
    gen = SpecGenerator(target, tok, drafter, trays(overlap="thread", cpu_threads_drafter=1))
    assert gen.passes.overlap == "thread"
    res = gen.generate(prompts)
    assert res.token_ids == sync.token_ids and res.taus() == sync.taus()
    assert all(r.tray_wait_s is not None for r in res.rounds)  # the tray pass ran in the worker thread, every round


class Siblings(TreeDrafts):
    """A third shape of drafts, written against the seam only: the two likeliest first drafts side by
    side, a tree of two siblings under the pending token (verified, accepted and kept as a tree)."""

    keys = ("block_size",)

    @classmethod
    def width(cls, cfg):
        return 3  # the pending token and the two siblings

    def make(self, pending, logits):
        law = probs(logits[:, : self.B], Sampling(1.0))
        top, tokens = law[:, 0].topk(2, dim=-1)
        b, dev = len(pending), pending.device
        parents = torch.tensor([-1, 0, 0], device=dev).expand(b, 3)
        tree = Tree(tokens, parents, torch.tensor([0, 1, 1], device=dev).expand(b, 3),
                    torch.cat([torch.zeros(b, 1, device=dev), top.log()], dim=1))
        return Draft(tokens, logits, None, torch.cat([pending[:, None], tokens], dim=1), tree_ancestors(parents), law, tree)

    def match_depth(self, logits, truth):
        """1 where the response's next token is one of the two siblings (the offline estimator's m(a))."""
        siblings = probs(logits[:, :1], Sampling(1.0))[:, 0].topk(2, dim=-1).indices
        return (siblings == truth[:, :1]).any(dim=-1).long()


@pytest.mark.parametrize("schedule", [Sync, Async])
def test_a_drafts_kind_registered_in_a_test_decodes_losslessly(models, monkeypatch, schedule):
    """A new shape of drafts is one class and one row: sibling drafts, drafted synchronously or with
    trays of their outcomes, give generate's greedy tokens on a ragged batch."""
    from d3d.decoding.methods import METHODS

    monkeypatch.setitem(METHODS, "siblings", Method(Siblings, schedule))
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    prompts[1] = prompts[1][:2]  # ragged
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method="siblings", block_size=6, tree_trays=8,
                                                           max_new_tokens=30)).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), row
    assert sum(res.taus()) == res.new_tokens and max(res.taus()) == 2  # a sibling was accepted, never more


def test_the_estimator_scores_a_new_drafts_kind_with_no_edit(models, monkeypatch):
    """The offline estimator asks the Drafts kind (match_depth), never the method's name: sibling
    drafts, registered in the test, get the loop's τ round by round on its own greedy output."""
    from d3d.decoding.methods import METHODS

    monkeypatch.setitem(METHODS, "siblings", Method(Siblings, Sync))
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    cfg = DecodeConfig(method="siblings", block_size=6, max_new_tokens=40)
    for text in PROMPTS:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, drafter, cfg).generate([prompt])
        ids = prompt + res.token_ids[0]
        m = match_lengths(drafter, ids, len(prompt), 6, s.mask_token_id, s.vocab_size, drafts=drafts_of(cfg))
        assert greedy_rounds(m, len(prompt), len(ids), 6) == res.taus(), text
        assert 2 in res.taus()  # a sibling was accepted: the walk had something to match


# ---------------------------------------------------------------- trees (decode.method=tree)

@pytest.mark.parametrize("nodes", [1, 12])  # a one-draft chain; a tree wider than the block's 5 slots
@pytest.mark.parametrize("batch", [1, 3])
def test_contract1_greedy_tree_equals_generate(models, nodes, batch):
    """A tree of drafts verified in one pass, ragged rows keeping each its own accepted path: the
    target's greedy tokens (a keep of the path's slots that moved none fails at nodes=12)."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:batch]]
    res = SpecGenerator(target, tok, drafter, DecodeConfig(method="tree", block_size=6, tree_nodes=nodes,
                                                           max_new_tokens=40)).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 40, tok.eos_token_id), (nodes, row)
    assert sum(res.taus()) == res.new_tokens


def test_a_tree_as_wide_as_the_chain_accepts_more_on_this_pair(models):
    """At equal verify width (sync B = 6 against a tree of 5 nodes + the pending token), the same
    tokens and more accepted per round: best-first trades the chain's unlikely deep slots for likely
    alternatives near the root (measured on this pair: τ 1.50 against 1.25; 15 nodes: 1.60)."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = lambda **kw: SpecGenerator(target, tok, drafter, DecodeConfig(block_size=6, max_new_tokens=30, **kw)).generate(prompts)
    sync, tree = run(method="sync"), run(method="tree", tree_nodes=5)
    assert tree.token_ids == sync.token_ids and tree.mean_tau > sync.mean_tau


def test_sampled_tree_decoding_runs_and_is_seeded(models):
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    gen = SpecGenerator(target, tok, drafter, DecodeConfig(method="tree", block_size=6, tree_nodes=8, temperature=1.0,
                                                           max_new_tokens=25))
    a, b = gen.generate(prompts, seed=3), gen.generate(prompts, seed=3)
    assert a.token_ids == b.token_ids and all(len(t) == 25 or r == "stop" for t, r in zip(a.token_ids, a.finish_reasons))
    assert sum(a.taus()) == a.new_tokens and max(a.taus()) >= 2


# ---------------------------------------------------------------- async trees (decode.method=async_tree)

@pytest.mark.parametrize("nodes,trays", [(1, 1), (5, 3), (12, 20)])
@pytest.mark.parametrize("batch", [1, 3])
def test_contract1_greedy_async_tree_equals_generate(models, nodes, trays, batch):
    """Trays keyed by the tree's outcomes, ragged rows each keeping its own path in both caches:
    the target's greedy tokens, and the tree's own rounds (a hit serves the block a synchronous
    draft pass would have drafted, so the trees and τ are the tree method's, in fp32)."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:batch]]
    run = lambda method: SpecGenerator(target, tok, drafter, DecodeConfig(  # noqa: E731
        method=method, block_size=6, tree_nodes=nodes, tree_trays=trays, max_new_tokens=40)).generate(prompts)
    res, tree = run("async_tree"), run("tree")
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 40, tok.eos_token_id), (nodes, trays, row)
    assert res.taus() == tree.taus() and sum(res.taus()) == res.new_tokens
    assert res.hit_rate is not None and res.hit_rate > 0  # trays were found (a key that never matches fails here)


def test_an_async_tree_hit_serves_the_block_a_synchronous_draft_would(models, monkeypatch):
    """Round by round, the drafter logits a tree grows from are the same for async_tree (a hit's
    tray, a miss's draft pass) as for tree (a draft pass after committing the path), in fp32 to
    rounding; and some paths end off the chain (node index != depth), where a tray keyed by the
    accepted count instead of the end node would serve another path's block. No tray is keyed by
    an outcome that cannot happen (a child's token at its parent would have extended the path)."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    seen, ends, real_make, real_accept = [], [], TreeDrafts.make, TreeDrafts.accept

    def make(self, pending, q_logits):
        seen[-1].append(q_logits[:, : self.B].clone())
        return real_make(self, pending, q_logits)

    def accept(self, r, p_logits):
        real_accept(self, r, p_logits)
        ends.extend(zip(r.outcome.tolist(), r.accepted.tolist()))

    impossible, real_trays = [], Async._tray_pass

    def tray_pass(self, dr, d, *args):  # a tray keyed (n, token of a child of n) is spent on nothing
        keys, logits = real_trays(self, dr, d, *args)
        for row in range(len(keys)):
            children = set(zip(d.tree.parents[row, 1:].tolist(), d.tree.tokens[row].tolist()))
            impossible.extend(k for k in map(tuple, keys[row].tolist()) if k in children)
        return keys, logits

    monkeypatch.setattr(TreeDrafts, "make", make)
    monkeypatch.setattr(TreeDrafts, "accept", accept)
    monkeypatch.setattr(Async, "_tray_pass", tray_pass)
    runs = {}
    for method in ("tree", "async_tree"):
        seen.append([])
        runs[method] = SpecGenerator(target, tok, drafter, DecodeConfig(
            method=method, block_size=6, tree_nodes=10, tree_trays=64, max_new_tokens=30)).generate(prompts)
    tree, asyn = seen
    assert runs["async_tree"].hit_rate > 0.2 and len(tree) == len(asyn)
    for i, (a, b) in enumerate(zip(tree, asyn)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), (i, (a - b).abs().max())
    assert any(node != depth for node, depth in ends)
    assert not impossible, impossible[:5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_async_tree_trays_cover_every_outcome_when_wide_enough(models, temperature):
    """With a tray for every (node, token) pair a round can end in (tree_trays >= (nodes + 1) * V),
    every round is a hit, greedy or sampled (so an outcome is keyed by the node its path ends at and
    a token that is no child of it); with one tray, only the likeliest outcome can be."""
    target, drafter, tok = models
    s = DrafterSettings.of(drafter)
    prompt = [tok(PROMPTS[2])["input_ids"]]
    run = lambda trays: SpecGenerator(target, tok, drafter, DecodeConfig(  # noqa: E731
        method="async_tree", block_size=4, tree_nodes=3, tree_trays=trays, temperature=temperature,
        max_new_tokens=24)).generate(prompt, seed=1)
    full = run(4 * s.vocab_size)
    hits = [r.hit[0] for r in full.rounds]
    assert len(hits) > 3 and all(hits)
    one = run(1)
    assert one.hit_rate < 1
    if temperature == 0:
        assert one.token_ids == full.token_ids


def test_async_tree_with_a_worker_thread_equals_serial(models):
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = lambda overlap: SpecGenerator(target, tok, drafter, DecodeConfig(  # noqa: E731
        method="async_tree", block_size=6, tree_nodes=8, tree_trays=6, overlap=overlap, cpu_threads_drafter=1,
        max_new_tokens=30)).generate(prompts)
    serial, threaded = run("none"), run("thread")
    assert threaded.token_ids == serial.token_ids and threaded.taus() == serial.taus()
    assert [r.hit for r in threaded.rounds] == [r.hit for r in serial.rounds]
    assert all(r.tray_wait_s is not None for r in threaded.rounds)


def test_sampled_async_tree_decoding_runs_and_is_seeded(models):
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    gen = SpecGenerator(target, tok, drafter, DecodeConfig(method="async_tree", block_size=6, tree_nodes=8, tree_trays=8,
                                                           temperature=1.0, max_new_tokens=25))
    a, b = gen.generate(prompts, seed=3), gen.generate(prompts, seed=3)
    assert a.token_ids == b.token_ids and sum(a.taus()) == a.new_tokens
    assert all(len(t) == 25 or r == "stop" for t, r in zip(a.token_ids, a.finish_reasons))


# ---------------------------------------------------------------- hostile settings (issue 38)

@pytest.mark.parametrize("method", ["tree", "async_tree"])
def test_a_tree_sampled_at_top_k_1_is_the_greedy_output(models, method):
    """T = 1 with top-k 1 leaves one token per step: a tree (its other nodes at q = 0) must then
    return the target's greedy tokens, ragged rows and block 2 (one draft slot) included."""
    target, drafter, tok = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    for block in (2, 6):
        cfg = DecodeConfig(method=method, block_size=block, tree_nodes=4, tree_trays=3, temperature=1.0, top_k=1,
                           max_new_tokens=20)
        res = SpecGenerator(target, tok, drafter, cfg).generate(prompts, seed=1)
        for row, p in enumerate(prompts):
            assert res.token_ids[row] == reference(target, tok, p, 20, tok.eos_token_id), (block, row)
    # top-p: runs on ragged rows, seeded, every token accounted for by a round
    gen = SpecGenerator(target, tok, drafter, replace(cfg, top_k=0, top_p=0.5))
    a, b = gen.generate(prompts, seed=2), gen.generate(prompts, seed=2)
    assert a.token_ids == b.token_ids and sum(a.taus()) == a.new_tokens


def test_the_python_api_refuses_a_pass_the_device_cannot_hold(models):
    """The memory bound was the CLI's only (d3d.decoding.cost.check_decode_cost): SpecGenerator built the
    131072-token tray pass of `block_size=256 C=256` (a 17 GB mask at toy size) and trees beyond
    the block's distinct nodes; d3d.bench and any caller reach it. Now the engine
    applies the same bound at construction (batch 1) and per call (the call's batch)."""
    from d3d.errors import ConfigError

    target, drafter, tok = models
    with pytest.raises(ConfigError, match=r"^decode.block_size=256 decode.C=256 decode.F=2 \(method async, batch 1\)"):
        SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=256, C=256))
    vocab = target.config.vocab_size
    with pytest.raises(ConfigError, match=rf"^decode.tree_nodes={vocab + 1} \(method tree\): .* at most {vocab} "):
        SpecGenerator(target, tok, drafter, DecodeConfig(method="tree", block_size=2, tree_nodes=vocab + 1))
    # fits one request, not 64 at once: refused when the call's batch is known, before any pass
    gen = SpecGenerator(target, tok, drafter, DecodeConfig(method="async", block_size=16, C=16, F=100))
    with pytest.raises(ConfigError, match=r"\(method async, batch 64\).*or fewer requests at once"):
        gen.generate([[1, 2, 3]] * 64, max_new_tokens=4)
