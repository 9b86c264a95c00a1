"""A drafter with a draft vocabulary (drafter.draft_vocab; docs/design.md, Draft vocabulary): decoding
stays lossless when the drafter cannot draft some of the target's likely tokens, its rounds are
those of a full head that gives those tokens -inf, and it saves, loads and is scored by pruning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.methods import scored_drafts
from d3d.decoding.verify import Sampling
from d3d.layer_scores import score_layers
from d3d.models.drafter import (DraftHead, attach_draft_head, load_drafter, read_draft_head, save_drafter,
                                special_ids)
from d3d.models.drafter_settings import DrafterSettings
from tests.integration.conftest import PROMPTS, reference, two_token_tv, tiny_drafter
from tests.integration.test_layer_scores import lively_examples


class MaskedHead(nn.Module):
    """The reference a draft head must equal: the full head's logits, -inf outside the draft vocabulary."""

    def __init__(self, weight: torch.Tensor, d2t: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.register_buffer("outside", torch.ones(weight.shape[0], dtype=torch.bool).index_fill_(0, d2t, False))

    def forward(self, h):
        return (h @ self.weight.T).masked_fill(self.outside, float("-inf"))


def excluding(drafter, tok, likely: list[int], seed: int = 0) -> torch.Tensor:
    """A draft vocabulary of about half the ids (the specials always in) without the `likely` ones."""
    V = DrafterSettings.of(drafter).vocab_size
    g = torch.Generator().manual_seed(seed)
    keep = set(torch.randperm(V, generator=g)[: V // 2].tolist()) | set(special_ids(tok, V))
    return torch.tensor(sorted(keep - set(likely)))


def with_draft_vocab(drafter, d2t):
    out = copy.deepcopy(drafter)
    attach_draft_head(out, d2t)
    return out


def with_masked_head(drafter, d2t):
    out = copy.deepcopy(drafter)
    out.set_output_embeddings(MaskedHead(drafter.get_output_embeddings().weight, d2t))
    return out


@pytest.fixture(scope="module")
def vocab_models(models):
    """The tiny pair, and the drafter cut to a draft vocabulary without the target's two likeliest first
    tokens after "ab" (the law tests' prompt) and its greedy tokens on PROMPTS[0]."""
    target, drafter, tok = models
    prompt = tok("ab")["input_ids"]
    with torch.no_grad():
        first = target(torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist()
    greedy = reference(target, tok, tok(PROMPTS[0])["input_ids"], 12, tok.eos_token_id)[::2]
    d2t = excluding(drafter, tok, first + greedy)
    return target, with_draft_vocab(drafter, d2t), tok, d2t, first, drafter


def test_the_draft_vocabulary_excludes_likely_target_tokens(vocab_models):
    target, dv, tok, d2t, first, _ = vocab_models
    head = dv.get_output_embeddings()
    assert isinstance(head, DraftHead) and torch.equal(head.d2t, d2t) and head.weight.shape[0] == len(d2t)
    assert not set(first) & set(d2t.tolist())  # the law tests' likeliest first tokens cannot be drafted
    assert DrafterSettings.of(dv).draft_vocab == len(d2t) < DrafterSettings.of(dv).vocab_size


T1, T07 = dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.8)
# ~13 s each here: the default suite runs one chain with trays, one chain and one tree with trays
LAW_CASES = [("async", T1), ("sync", T07), ("async_tree", T07)] + [
    pytest.param(m, s, marks=pytest.mark.heavy) for m, s in [("sync", T1), ("tree", T1), ("async_tree", T1),
                                                              ("async", T07), ("tree", T07)]]


@pytest.mark.parametrize("method,sampling", LAW_CASES)
def test_the_target_law_holds_with_a_draft_vocabulary(vocab_models, method, sampling):
    """The joint law of two sampled tokens is the target's (as test_decoding's contract 2), with drafts
    from a vocabulary that holds neither of the target's two likeliest first tokens: they come only
    from the residual, which is right only if q is zero outside the draft vocabulary."""
    target, dv, tok, _, _, _ = vocab_models
    prompt = tok("ab")["input_ids"]
    n = 2500
    s = Sampling(**sampling)
    res = SpecGenerator(target, tok, dv, DecodeConfig(method=method, block_size=4, C=3, F=2, tree_nodes=4, tree_trays=6,
                                                      max_new_tokens=2, **sampling), seed=0).generate([prompt] * n)
    tv = two_token_tv(target, prompt, s, res.token_ids)
    assert tv < 0.07, tv  # <= 25 outcomes, n = 2500: sampling noise gives TV ~0.03-0.04


@pytest.mark.parametrize("method", ["sync", "async_tree", *(pytest.param(m, marks=pytest.mark.heavy) for m in ("async", "tree"))])
def test_greedy_with_a_draft_vocabulary_equals_generate_and_the_masked_full_head(vocab_models, method):
    """Ragged batch of 3: the target's greedy text, and the very rounds of the full head with -inf
    outside the draft vocabulary (a decoder that forgot the d2t map drafts other tokens: other rounds)."""
    target, dv, tok, d2t, _, drafter = vocab_models
    masked = with_masked_head(drafter, d2t)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    cfg = DecodeConfig(method=method, block_size=6, C=4, F=2, tree_nodes=6, tree_trays=4, max_new_tokens=30)
    res = SpecGenerator(target, tok, dv, cfg).generate(prompts)
    ref = SpecGenerator(target, tok, masked, cfg).generate(prompts)
    for row, p in enumerate(prompts):
        assert res.token_ids[row] == reference(target, tok, p, 30, tok.eos_token_id), (method, row)
    assert res.taus() == ref.taus()
    assert max(res.taus()) > 1  # drafts were accepted: the rounds compared say something


@pytest.mark.parametrize("tree_nodes", [None, pytest.param(6, marks=pytest.mark.heavy)])
def test_the_estimator_gives_the_loops_rounds_with_a_draft_vocabulary(vocab_models, tree_nodes):
    """Contract 4 for a draft-vocabulary drafter: the offline estimator's greedy τ per round is the loop's."""
    from d3d.decoding.methods import drafts_of
    from d3d.estimator import greedy_rounds, match_lengths

    target, dv, tok, _, _, _ = vocab_models
    s = DrafterSettings.of(dv)
    method = "sync" if tree_nodes is None else "tree"
    cfg = DecodeConfig(method=method, block_size=6, tree_nodes=tree_nodes or 6, max_new_tokens=40)
    for text in PROMPTS[:2]:
        prompt = tok(text)["input_ids"]
        res = SpecGenerator(target, tok, dv, cfg).generate([prompt])
        ids = prompt + res.token_ids[0]
        m = match_lengths(dv, ids, len(prompt), 6, s.mask_token_id, s.vocab_size,
                          drafts=drafts_of(cfg) if tree_nodes else None)
        assert greedy_rounds(m, len(prompt), len(ids), 6) == res.taus()


def test_save_load_decode_round_trip(vocab_models, tmp_path):
    target, dv, tok, d2t, _, full = vocab_models
    folder = save_drafter(dv, tok, tmp_path / "dv")
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as fh:
        assert torch.equal(fh.get_tensor("lm_head.d2t"), d2t) and fh.get_tensor("lm_head.weight").shape[0] == len(d2t)
    weight, saved = read_draft_head(folder)  # the one reader (load_drafter, scripts/bench_draft_vocab.py --drafter)
    assert torch.equal(saved, d2t) and torch.equal(weight, dv.get_output_embeddings().weight)
    assert read_draft_head(save_drafter(full, tok, tmp_path / "full")) == (None, None)
    loaded, _ = load_drafter(folder, dtype="float32")
    head = loaded.get_output_embeddings()
    assert isinstance(head, DraftHead) and torch.equal(head.d2t, d2t)
    assert torch.equal(head.weight, dv.get_output_embeddings().weight)
    assert DrafterSettings.of(loaded).draft_vocab == len(d2t)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    for cfg in (DecodeConfig(method="async", block_size=6, C=4, F=2, max_new_tokens=24),
                DecodeConfig(method="tree", block_size=6, tree_nodes=6, max_new_tokens=24, temperature=0.8)):
        a = SpecGenerator(target, tok, dv, cfg, seed=3).generate(prompts)
        b = SpecGenerator(target, tok, loaded, cfg, seed=3).generate(prompts)
        assert a.token_ids == b.token_ids and a.taus() == b.taus()


def test_a_damaged_draft_head_is_refused_in_one_line(vocab_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from d3d.errors import ConfigError

    _, dv, tok, _, _, _ = vocab_models
    folder = save_drafter(dv, tok, tmp_path / "dv")
    weights = next(folder.glob("*.safetensors"))
    tensors = load_file(str(weights))
    del tensors["lm_head.d2t"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lm_head.d2t"):
        load_drafter(folder, dtype="float32")


@pytest.mark.parametrize("tree_nodes", [None, pytest.param(5, marks=pytest.mark.heavy)])
def test_the_pruning_sweep_scores_a_draft_vocabulary_drafter(tmp_path, tree_nodes):
    """score_layers on a draft-vocabulary drafter: the estimator per layer, and the masked full head's
    scores; the draft vocabulary leaves out tokens the drafter drafts, so they differ from the full head's."""
    model, tok, _ = tiny_drafter(tmp_path, layers=4, block=4)
    s = DrafterSettings.of(model)
    drafts = scored_drafts(s.block_size, tree_nodes)
    examples = [lively_examples(model, s, seed) for seed in range(2)]
    drafted = sorted({t for ex in examples for e in ex for t in e.ids[e.prompt_len:]})
    d2t = excluding(model, tok, drafted[::3])
    dv, masked = with_draft_vocab(model, d2t), with_masked_head(model, d2t)
    differs = False
    for ex in examples:
        got = score_layers(dv, ex, s.block_size, s.mask_token_id, s.vocab_size, drafts=drafts).taus
        assert got == pytest.approx(score_layers(masked, ex, s.block_size, s.mask_token_id, s.vocab_size,
                                                 drafts=drafts).taus, abs=1e-12)
        differs |= got != score_layers(model, ex, s.block_size, s.mask_token_id, s.vocab_size, drafts=drafts).taus
    assert differs


@pytest.fixture(scope="module")
def varied_root(tmp_path_factory):
    """A project root with smoke responses of varied text: the random tiny target answers with one
    token repeated, so each response is replaced by a stretch of its prompt (something for a draft
    vocabulary to leave out)."""
    import json

    from d3d.generate import run_generate
    from tests.conftest import compose

    root = tmp_path_factory.mktemp("varied")
    run_generate(compose("generate", ["+experiment=smoke", "data.limit=10", "generate.max_new_tokens=24"], root))
    for shard in root.glob("data/responses/**/responses.rank*.jsonl"):
        rows = [json.loads(line) for line in shard.read_text().splitlines()]
        shard.write_text("".join(json.dumps({**r, "response_ids": r["prompt_ids"][5:29]}) + "\n" for r in rows))
    return root


def train_dv(root, name, *overrides):
    from d3d.train import run_train
    from d3d.utils.io import read_jsonl
    from tests.conftest import compose

    cfg = compose("train", ["+experiment=smoke", "data.limit=10", f"train.out_dir={root}/ckpt/{name}",
                            "train.max_steps=2", "train.save_every=1", "train.eval_every=2", "train.log_every=1",
                            "drafter.draft_vocab=15", *overrides], root)
    out = run_train(cfg)
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r], out


def test_training_with_a_draft_vocabulary_reports_its_coverage(varied_root):
    """d3d.train with drafter.draft_vocab: the head over N tokens chosen from the training responses,
    the share of loss rows outside it per step, its coverage of each split in summary.json, and a
    final/ that loads with its map."""
    import json

    rows, out = train_dv(varied_root, "dv")
    summary = json.loads((out / "summary.json").read_text())["draft_vocab"]
    assert summary["size"] == 15 and 0 < summary["coverage_train"] < 1 and 0 < summary["coverage_val"] < 1
    assert all(0 <= r["dn_outside"] < 1 and 0 <= r["ar_outside"] < 1 for r in rows)
    assert any(r["dn_outside"] > 0 for r in rows)  # 15 tokens do not hold every response token
    model, tok = load_drafter(out / "final", dtype="float32")
    head = model.get_output_embeddings()
    assert isinstance(head, DraftHead) and head.weight.shape[0] == 15 == DrafterSettings.of(model).draft_vocab
    # chosen from the training split (not the held-out one): its 15 most frequent tokens with the specials
    from d3d.examples import held_out
    from d3d.models.drafter import choose_draft_vocab
    from d3d.settings import bind_config
    from d3d.train import responses
    from tests.conftest import compose

    cfg = bind_config(compose("train", ["+experiment=smoke", "data.limit=10"], varied_root), "train")
    train = held_out(cfg.train, cfg.seed).train
    V = DrafterSettings.of(model).vocab_size
    d2t, share = choose_draft_vocab(responses(train), 15, V, special_ids(tok, V, DrafterSettings.of(model).mask_token_id))
    assert torch.equal(head.d2t, d2t) and summary["coverage_train"] == round(share, 5)


@pytest.mark.heavy  # three short training runs: ~35 s on 2 cores
def test_training_with_a_draft_vocabulary_resumes_exactly(varied_root):
    """The draft vocabulary is chosen again from the same responses on resume: the same losses."""
    full, _ = train_dv(varied_root, "full", "train.max_steps=4")
    train_dv(varied_root, "resumed", "train.max_steps=4", "train.stop_at_step=2")
    resumed, _ = train_dv(varied_root, "resumed", "train.max_steps=4")
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in full]


def test_a_bad_draft_vocab_is_refused_before_any_model_or_response_loads(tmp_path, monkeypatch):
    from d3d.errors import ConfigError
    from d3d.train import run_train
    from tests.conftest import compose

    def no_loading(*args, **kwargs):
        raise AssertionError("a model or the responses loaded before the refusal")

    monkeypatch.setattr("d3d.models.drafter.load_model", no_loading)
    monkeypatch.setattr("d3d.train.held_out", no_loading)
    for n in (2, 10**6):
        cfg = compose("train", ["+experiment=smoke", f"train.out_dir={tmp_path}/ckpt", f"drafter.draft_vocab={n}"], tmp_path)
        with pytest.raises(ConfigError, match=f"^drafter.draft_vocab={n}: .* Fix: set drafter.draft_vocab between"):
            run_train(cfg)
