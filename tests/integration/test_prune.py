"""d3d.prune on the smoke setup: contract 6, estimator == loop on a pruned drafter, resume."""

from __future__ import annotations

import pytest
import torch

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.estimator import greedy_rounds, match_lengths
from d3d.generate import run_generate
from d3d.models import load_model, load_tokenizer, resolve_model_path
from d3d.models.drafter_settings import DrafterSettings
from d3d.errors import ConfigError
from d3d.utils.io import read_jsonl
from d3d.prune import run_prune
from d3d.examples import held_out
from d3d.settings import bind_config
from tests.conftest import CACHE_DIR, ROOT, Killed, accelerate_env, compose, kill_on, torchrun

TINY4 = ["+experiment=smoke", "target.tiny.num_hidden_layers=4", "target.name=tiny4", "data.limit=10",
         "generate.max_new_tokens=24", "train.val_size=3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune_root")
    run_generate(compose("generate", TINY4, path))
    return path


def prune(root, name, *extra):
    cfg = compose("prune", TINY4 + ["prune.num_layers=2", "prune.recovery_steps=1", "prune.min_retention=0",
                                    "prune.calib_size=3", f"prune.out_dir={root}/pruned/{name}", *extra], root)
    out = run_prune(cfg)
    return list(read_jsonl(out / "steps.jsonl")), out, cfg


def test_contract6_pruned_checkpoint_loads_plainly_and_decodes(root):
    rows, out, cfg = prune(root, "acc")
    assert [r["layers"] for r in rows] == [4, 3, 2]
    assert len({r["removed"] for r in rows[1:]}) == 2
    table = (out / "steps.md").read_text().splitlines()
    assert len(table) == 2 + 3 and table[-1].startswith("| 2 | ")
    assert (out / "pruning.png").stat().st_size > 1000
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(out / "final")
    assert plain.config.num_hidden_layers == 2
    assert DrafterSettings.of(plain).kept_layers == rows[-1]["kept_layers"]
    path = resolve_model_path(bind_config(cfg, "prune").target, cfg.paths.cache_dir)
    tok, target = load_tokenizer(path), load_model(path, "float32", "cpu")
    prompt = tok("Hello there")["input_ids"]
    res = SpecGenerator(target, tok, plain.eval(), DecodeConfig(method="sync", block_size=4, max_new_tokens=20)).generate([prompt])
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert res.token_ids[0] == ref
    # contract 4 on the pruned drafter: the estimator's rounds are the loop's rounds
    s = DrafterSettings.of(plain)
    m = match_lengths(plain, prompt + res.token_ids[0], len(prompt), 4, s.mask_token_id, s.vocab_size)
    assert greedy_rounds(m, len(prompt), len(prompt) + len(res.token_ids[0]), 4) == res.taus()


def test_killed_prune_resumes_from_its_last_step(root):
    full, _, _ = prune(root, "full")
    part, _, _ = prune(root, "resumed", "prune.stop_at_step=1")
    assert [r["step"] for r in part] == [0, 1]
    resumed, _, _ = prune(root, "resumed")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert [r["removed"] for r in resumed] == [r["removed"] for r in full]


def test_resume_refuses_other_settings(root):
    """A rerun with another recovery (or another starting drafter) used to continue the old run."""
    prune(root, "guarded", "prune.num_layers=1")
    with pytest.raises(ConfigError, match=r"\(prune\.recovery_steps differ\)"):
        prune(root, "guarded", "prune.num_layers=2", "prune.recovery_steps=2")
    rows, _, _ = prune(root, "guarded", "prune.num_layers=2", "prune.min_retention=0.5")  # go further: fine
    assert [r["step"] for r in rows] == [0, 1, 2]



def test_an_unknown_method_is_refused_before_the_drafter_loads(root, monkeypatch):
    """prune.method=nope used to fail at step 1, after the drafter was built and step 0 measured."""
    import d3d.prune

    for owner, loader in ((d3d.prune, "build_drafter"), (d3d.prune.SavedDrafter, "load")):
        monkeypatch.setattr(owner, loader, lambda *a, **k: pytest.fail("the drafter loaded before the check"))
    with pytest.raises(ConfigError, match=r"^prune.method='nope': no such pruning criterion. Fix: use one of acceptance"):
        prune(root, "unknown_method", "prune.method=nope")


def test_killed_step_does_not_score_again(root, monkeypatch):
    """A step scores every layer in one sweep (minutes at 0.5B on CPU), recorded in scores.jsonl as
    soon as it ends: a run killed after it (here while measuring τ before recovery) does not sweep
    again on resume, and chooses the same layer."""
    import d3d.prune

    full, _, _ = prune(root, "one_step", "prune.num_layers=1")
    real_tau, real_sweep, sweeps, taus = d3d.prune.tau_of, d3d.prune.score_layers, [], []

    def sweep(*args, **kwargs):
        sweeps.append(1)
        return real_sweep(*args, **kwargs)

    def tau_of(*args):
        taus.append(1)
        if len(taus) == 2:  # τ_full, then the first τ after the sweep
            raise Killed
        return real_tau(*args)

    monkeypatch.setattr(d3d.prune, "score_layers", sweep)
    monkeypatch.setattr(d3d.prune, "tau_of", tau_of)
    with pytest.raises(Killed):
        prune(root, "killed_scoring", "prune.num_layers=1")
    assert len(sweeps) == 1
    rows, out, _ = prune(root, "killed_scoring", "prune.num_layers=1")
    assert len(sweeps) == 1  # not swept again
    assert rows[1]["scores"] == full[1]["scores"] and rows[1]["removed"] == full[1]["removed"]
    assert len(list(read_jsonl(out / "scores.jsonl"))) == 1


def test_several_layers_a_step_where_the_scores_say_it_is_safe(root):
    """prune.layers_per_step removes the best-scored layers whose removal alone keeps
    step_safe_retention of τ, in one step, and never more than num_layers in all."""
    rows, _, _ = prune(root, "multi", "prune.layers_per_step=3", "prune.step_safe_retention=0", "prune.num_layers=2")
    assert [r["layers"] for r in rows] == [4, 2]  # both layers in the first step
    scores = rows[1]["scores"]
    best_two = sorted(sorted(range(4), key=lambda i: -scores[i])[:2])
    assert rows[1]["removed"] == best_two
    rows, _, _ = prune(root, "multi_unsafe", "prune.layers_per_step=3", "prune.step_safe_retention=100",
                       "prune.num_layers=2")
    assert [r["layers"] for r in rows] == [4, 3, 2]  # no second layer is "safe": one a step


def test_distilled_recovery_trains_toward_the_unpruned_drafter(root):
    """prune.recovery_loss=distill: the same removal recovered with the KL to the unpruned drafter's
    laws ends with other weights than the D3D objective's; the tree criterion scores and retains by
    the tree's τ."""
    from safetensors.torch import load_file

    runs = {}
    for loss in ("objective", "distill"):
        rows, out, _ = prune(root, f"recover_{loss}", f"prune.recovery_loss={loss}", "prune.recovery_steps=2",
                             "prune.num_layers=1", "prune.tree_nodes=3")
        runs[loss] = (rows, load_file(str(out / "final" / "model.safetensors")))
    (rows_o, w_o), (rows_d, w_d) = runs["objective"], runs["distill"]
    assert rows_d[0]["tau_of"] == rows_d[1]["tau_of"] == "tree3"
    assert rows_o[1]["removed"] == rows_d[1]["removed"]  # same scores, same layer
    assert any(not torch.equal(w_o[k], w_d[k]) for k in w_o)


@pytest.mark.parametrize("method", ["last", "similarity"])
def test_baselines(root, method):
    rows, _, _ = prune(root, method, f"prune.method={method}")
    assert [r["layers"] for r in rows] == [4, 3, 2]
    if method == "last":
        assert [r["removed"] for r in rows[1:]] == [3, 2]


def test_holdout_measures_the_retention_on_responses_the_choice_did_not_see(root, monkeypatch):
    """With prune.holdout_size the retention (the stopping rule) is τ on the held-out responses after
    the calibration ones, never on the ones that chose the layer. A stand-in τ that differs by
    response set and layer count tells the sets apart (the tiny drafter's real τ is 2.0 on both)."""
    import d3d.prune

    seen = []

    def tau_of(model, examples, s, tree_nodes, acc):
        seen.append(tuple(tuple(e.ids) for e in examples))
        return 10.0 * len(examples) + len(s.kept_layers)

    monkeypatch.setattr(d3d.prune, "tau_of", tau_of)
    rows, out, cfg = prune(root, "holdout", "train.val_size=5", "prune.holdout_size=2", "prune.num_layers=1")
    val = held_out(bind_config(cfg, "prune").train, int(cfg.seed)).val  # train.val_size=5
    calib, holdout = (tuple(tuple(e.ids) for e in part) for part in (val[:3], val[3:5]))
    assert set(seen) == {calib, holdout} and not set(calib) & set(holdout)
    step0, step1 = rows
    assert (step0["tau"], step0["holdout_tau"], step1["tau"], step1["holdout_tau"]) == (34.0, 24.0, 33.0, 23.0)
    assert step1["retention"] == 23.0 / 24.0  # the hold-out's, not the calibration's 33/34
    assert seen.count(holdout) == 3  # τ_full, and before and after the recovery
    header = (out / "steps.md").read_text().splitlines()[0]
    assert "hold-out τ before" in header and "hold-out τ after" in header
    # a hold-out run resumes only as one; too few held-out responses is a clear error
    with pytest.raises(ConfigError, match="holdout_size"):
        prune(root, "holdout", "train.val_size=5", "prune.num_layers=2")
    with pytest.raises(ConfigError, match="train.val_size"):
        prune(root, "too_few", "prune.holdout_size=1")


@pytest.mark.parametrize("window", ["writing", "before_row", "before_promotion", "between_renames"])
def test_a_kill_anywhere_in_a_step_resumes_to_the_same_rows_and_weights(root, monkeypatch, window):
    """Killed while finishing step 2: the rerun's rows equal an uninterrupted run's, and last/ holds
    as many layers as the last row says (before: the unpruned drafter, or one removal unrecorded)."""
    import json

    import d3d.prune
    import d3d.utils.checkpoints as ck
    from d3d.utils.io import JsonlWriter

    full, _, _ = prune(root, "full")
    with monkeypatch.context() as m:
        if window == "writing":
            m.setattr(d3d.prune, "mark_complete", kill_on(2, ck.mark_complete))
        elif window == "before_row":
            is_step = lambda self, rows: any("removed" in r for r in rows)
            m.setattr(JsonlWriter, "write", kill_on(3, JsonlWriter.write, is_step))  # rows 0, 1, then 2
        elif window == "before_promotion":
            m.setattr(d3d.prune, "promote", kill_on(2, ck.promote))
        else:  # last/'s renames only (final/ and step_<k>/ are published with the same two renames)
            m.setattr(ck, "_rename", kill_on(3, ck._rename, lambda src, dst: dst.name.startswith("last")))
        with pytest.raises(Killed):
            prune(root, f"killed_{window}")
    rows, out, _ = prune(root, f"killed_{window}")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["removed"] for r in rows] == [r["removed"] for r in full]
    last = json.loads((out / "last" / "config.json").read_text())
    assert last["num_hidden_layers"] == rows[-1]["layers"] == 2


def test_latencies_are_timed_in_the_deployment_dtype(tmp_path, monkeypatch):
    """prune's draft latencies time the drafter in the dtype it will decode in (bf16 on a GPU, or on
    a CPU with native bf16), not in the fp32 it is pruned and recovered in; the model is untouched."""
    import torch

    from d3d.models.drafter import build_drafter
    from d3d.models.drafter_settings import DrafterSettings
    from d3d.prune import draft_latency_ms

    cfg = bind_config(compose("train", ["+experiment=smoke"], tmp_path), "train")
    model, _ = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    monkeypatch.setenv("D3D_CPU_BF16", "1")  # as on an AMX / AVX512-BF16 CPU
    assert draft_latency_ms(model, DrafterSettings.of(model), prefix=16, repeats=1) > 0
    assert set(seen) == {torch.bfloat16} and next(model.parameters()).dtype == torch.float32
    seen.clear()
    monkeypatch.setenv("D3D_CPU_BF16", "0")
    draft_latency_ms(model, DrafterSettings.of(model), prefix=16, repeats=1)
    assert set(seen) == {torch.float32}


def _cut_save(model, tok, folder, *args, **kwargs):
    """save_drafter killed after it made the folder and an empty config.json (as a SIGKILL can)."""
    from pathlib import Path

    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text("")
    raise Killed


def _final_is_whole(out, step):
    import json

    from d3d.utils.checkpoints import drafter_problem

    assert drafter_problem(out / "final") is None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"] == str(out / "final") and summary["final_step"] == step
    assert load_model(str(out / "final"), "float32", "cpu").config.d3d["kept_layers"] == [0, 1, 2, 3]


def test_a_kill_in_the_step0_save_of_final_never_leaves_it_broken(root, monkeypatch):
    """Killed while step 0 saved final/, rerun where no removal keeps the retention: it used to
    finish with rc 0 and a summary.json naming a final/ with an empty config.json."""
    import d3d.prune

    with monkeypatch.context() as m:
        m.setattr(d3d.prune, "save_drafter", _cut_save)
        with pytest.raises(Killed):
            prune(root, "cut_final")
    assert not (root / "pruned" / "cut_final" / "final").exists()  # the cut save stayed in final.partial
    _, out, _ = prune(root, "cut_final", "prune.min_retention=2", "prune.num_layers=1")
    _final_is_whole(out, 0)


def test_a_broken_final_from_an_older_run_is_redone_on_resume(root, monkeypatch):
    """final/ written in place by an older version and cut by a kill (no marker, empty config.json):
    the resume sees it and saves the drafter of the step final/ holds again."""
    import d3d.prune

    with monkeypatch.context() as m:
        m.setattr(d3d.prune, "choose_layers", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            prune(root, "old_final")  # step 0 recorded, final/ whole
    final = root / "pruned" / "old_final" / "final"
    (final / "COMPLETE").unlink(missing_ok=True)
    (final / "config.json").write_text("")
    _, out, _ = prune(root, "old_final", "prune.min_retention=2", "prune.num_layers=1")
    _final_is_whole(out, 0)


def test_a_last_checkpoint_ahead_of_steps_jsonl_is_refused(root):
    """steps.jsonl cut back under last/: the resume used to continue from the pruned drafter with the
    step counter of the shorter record, removing layers no row accounts for."""
    from d3d.utils.io import CorruptFile

    rows, out, _ = prune(root, "ahead")
    lines = (out / "steps.jsonl").read_text().splitlines(keepends=True)
    (out / "steps.jsonl").write_text("".join(lines[:2]))  # steps 0 and 1; last/ holds step 2
    with pytest.raises(CorruptFile, match=r"last was saved after steps.jsonl recorded step 2, .* up to step 1.* Fix: delete"):
        prune(root, "ahead")


def test_removing_every_layer_is_refused_in_one_line(root):
    """prune.num_layers at the drafter's layer count used to save a 0-layer final/ and succeed."""
    from d3d.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^prune.num_layers=4 would remove every layer of a 4-layer drafter. Fix: set prune.num_layers=3"):
        prune(root, "all_layers", "prune.num_layers=4")


def test_recovery_lr_is_recoverys_own(root):
    """prune.recovery_lr sets recovery's learning rate apart from train.lr (1e-4 lost τ on the Qwen
    drafter, 1e-5 won it back): a near-zero one leaves the pruned weights as the removal left them."""
    from safetensors.torch import load_file

    weights = {}
    for name, extra in (("lr_default", []), ("lr_tiny", ["prune.recovery_lr=1e-12"]), ("lr_none", ["prune.recovery_steps=0"])):
        _, out, _ = prune(root, f"recover_{name}", "prune.num_layers=1", "prune.recovery_steps=2", *extra)
        weights[name] = load_file(str(out / "final" / "model.safetensors"))
    near = lambda a, b: all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert near(weights["lr_tiny"], weights["lr_none"]) and not near(weights["lr_default"], weights["lr_none"])


@pytest.mark.heavy  # torchrun: two processes pruning three steps, and one process doing the same: ~2 min on 2 cores
def test_two_processes_choose_the_layers_one_process_does(root, tmp_path, monkeypatch, fresh_accelerate_state):
    """`accelerate launch --config_file conf/accelerate/fsdp.yaml -m d3d.prune` on two processes (the
    yaml's own variables, torchrun starting them): each scores its half of the calibration responses
    and the exact τ counts are summed, so the scores equal one process's and the same layers go;
    recovery runs through the prepared FSDP2 step on the same global batch (train.global_batch_size:
    2 x 1 micro-batch against 1 x 2), so the later steps' scores and choices are the same too. In fp32: bf16
    recoveries on 1 and 2 processes round differently."""
    import json

    monkeypatch.setenv("D3D_CPU_BF16", "0")
    common = TINY4 + ["prune.num_layers=3", "prune.recovery_steps=2", "prune.min_retention=0", "prune.calib_size=3",
                      "train.freeze_embeddings=false", "train.batch_size=1", "train.global_batch_size=2",
                      "prune.progress=false", "prune.recovery_lr=1e-3", f"paths.root_dir={root}",
                      f"paths.cache_dir={CACHE_DIR}"]
    env = {**accelerate_env(ROOT / "conf" / "accelerate" / "fsdp.yaml", 2), "ACCELERATE_MIXED_PRECISION": "no"}
    proc = torchrun(2, "d3d.prune", *common, f"prune.out_dir={tmp_path}/two", env=env, module=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[d3d.prune] 2 processes (FSDP): scoring split over them, recovery on a global batch of 2" in proc.stdout
    two = list(read_jsonl(tmp_path / "two" / "steps.jsonl"))
    one = list(read_jsonl(run_prune(compose("prune", common + [f"prune.out_dir={tmp_path}/one"])) / "steps.jsonl"))
    assert [r["removed"] for r in two] == [r["removed"] for r in one] and len(one) == 4
    # On this 4-layer copy every candidate scores alike (ties go to the lowest layer), so the choice
    # alone says little; the τ do: each is a sum over the two halves, and they move with recovery
    # (2 -> 7 -> 11.2). Shares that add up to the whole on responses whose scores differ:
    # tests/integration/test_layer_scores.py.
    for a, b in zip(two[1:], one[1:]):
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-9)
    assert len({r["tau"] for r in one}) > 2
    for a, b in zip(two, one):  # the same counts; recovered drafters equal up to fp32 reduction order
        assert (a["tau_before_recovery"], a["tau"]) == pytest.approx((b["tau_before_recovery"], b["tau"]), abs=1e-6)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["final_step"] == 3


def test_each_step_writes_its_weights_once(root):
    """step_<k>/, final/ and last/ of a step hold the same fp32 weights: written once, the other two
    folders link the files (they used to be written three times: 3 x 33 GB a step at 8B)."""
    import os

    _, out, _ = prune(root, "written_once", "prune.num_layers=1")
    inode = lambda name: os.stat(out / name / "model.safetensors").st_ino  # noqa: E731
    assert inode("step_1") == inode("final") == inode("last")


def test_save_dtype_writes_the_drafters_in_bf16_and_resumes_from_fp32(root):
    """train.save_dtype=bfloat16 (the GPU overlays): final/ and step_<k>/ in bf16, config.json saying so
    and loading as a drafter; last/, the checkpoint a resumed run continues from, stays fp32."""
    import json

    from safetensors import safe_open

    from d3d.models.drafter import load_drafter

    _, out, _ = prune(root, "bf16_saved", "prune.num_layers=1", "train.save_dtype=bfloat16")

    def dtypes(name):
        with safe_open(str(out / name / "model.safetensors"), "pt") as f:
            return {f.get_slice(k).get_dtype() for k in f.keys()}

    assert dtypes("final") == dtypes("step_1") == {"BF16"} and dtypes("last") == {"F32"}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    model, _ = load_drafter(out / "final", dtype="float32")
    assert next(model.parameters()).dtype == torch.float32


def test_recovery_trains_only_the_layers_from_recovery_from_layer(root):
    """prune.recovery_from_layer=2 on the 4-layer drafter: recovery leaves the starting drafter's layers
    0 and 1 as the removal left them (no gradient, no AdamW state) and trains 2 and 3, whichever one
    the step removed; without it every layer trains."""
    from safetensors.torch import load_file

    finals = {}
    for name, extra in (("frozen_below_2", ["prune.recovery_from_layer=2"]), ("all_layers", []),
                        ("none", ["prune.recovery_steps=0"])):
        rows, out, _ = prune(root, f"from_{name}", "prune.num_layers=1", "prune.recovery_steps=2",
                             "prune.recovery_lr=1e-3", *extra)
        finals[name] = (rows[-1]["kept_layers"], load_file(str(out / "final" / "model.safetensors")))
        if name != "none":  # the step's row says how long its recovery took, a part of the whole step
            assert 0 < rows[-1]["recovery_s"] <= rows[-1]["step_s"], rows[-1]
    kept, none = finals["none"]
    assert all(finals[n][0] == kept for n in finals)  # the same layer goes first in every run

    def changed(name) -> dict[int, bool]:  # by the starting drafter's layer index
        weights = finals[name][1]
        return {original: any(not torch.equal(weights[k], none[k]) for k in weights if k.startswith(f"model.layers.{i}."))
                for i, original in enumerate(kept)}

    assert changed("frozen_below_2") == {o: o >= 2 for o in kept}
    assert all(changed("all_layers").values())
