"""d3d.train end to end on the smoke experiment: resume exactly (contract 5), λ is a real switch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from d3d.generate import run_generate
from d3d.train import run_train
from d3d.utils.io import read_jsonl
from d3d.settings import bind_config
from tests.conftest import CACHE_DIR, ROOT, Killed, accelerate_env, compose, kill_on, torchrun


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A project root with smoke responses from the tiny target (generated once for the module)."""
    path = tmp_path_factory.mktemp("train_root")
    run_generate(compose("generate", ["+experiment=smoke", "data.limit=10", "generate.max_new_tokens=24"], path))
    return path


def train(root, name, *overrides):
    cfg = compose("train", ["+experiment=smoke", "data.limit=10", f"train.out_dir={root}/ckpt/{name}",
                            "train.max_steps=6", "train.save_every=3", "train.eval_every=3", "train.log_every=1",
                            *overrides], root)
    out = run_train(cfg)
    return [r for r in read_jsonl(out / "metrics.jsonl")], out


def losses(rows):
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_contract5_resume_matches_uninterrupted(root):
    full, _ = train(root, "full")
    part, out = train(root, "resumed", "train.stop_at_step=3")
    assert [s for s, _ in losses(part)] == [1, 2, 3]
    assert (out / "last" / "trainer_state.json").is_file()
    resumed, _ = train(root, "resumed")
    assert losses(resumed) == losses(full)  # exactly: same data, anchors, optimizer and RNG state
    assert [r["val_tau"] for r in resumed if "val_tau" in r] == [r["val_tau"] for r in full if "val_tau" in r]


def test_resume_refuses_other_settings_allows_a_longer_budget(root):
    """Rerunning a finished run with another λ used to report the old drafter as the new one."""
    from d3d.errors import ConfigError

    first, out = train(root, "guarded", "train.max_steps=3")
    with pytest.raises(ConfigError, match=r"\(train\.ar_weight differ\).*train.resume=false"):
        train(root, "guarded", "train.max_steps=3", "train.ar_weight=0")
    longer, _ = train(root, "guarded", "train.max_steps=5")  # a budget is not the experiment: resumes
    assert [s for s, _ in losses(longer)][-1] == 5 and losses(longer)[:3] == losses(first)
    fresh, _ = train(root, "guarded", "train.max_steps=2", "train.ar_weight=0", "train.resume=false")
    assert [s for s, _ in losses(fresh)] == [1, 2] and not any("loss_ar" in r for r in fresh)


def test_other_settings_are_refused_before_the_drafter_is_built(root, monkeypatch):
    """The refusal came after build_drafter: minutes of loading on the CPU default before the one line."""
    import d3d.train
    from d3d.errors import ConfigError

    train(root, "refused_early", "train.max_steps=3")
    monkeypatch.setattr(d3d.train, "build_drafter", lambda *a, **k: pytest.fail("the drafter was built before the check"))
    with pytest.raises(ConfigError, match=r"\(train\.ar_weight differ\).*train.resume=false"):
        train(root, "refused_early", "train.max_steps=3", "train.ar_weight=0")


def test_a_new_benchmark_file_leaves_a_training_folder_resumable(root, tmp_path, monkeypatch):
    """Adding conf/benchmark/<new>.yaml adds its name to every prompt set's exclude_eval: a run
    resumed with more exclusions resumes; one that would now include an excluded benchmark is refused."""
    from d3d.errors import ConfigError
    from tests.conftest import conf_with_benchmark

    first, out = train(root, "new_bench", "train.max_steps=3")
    conf_with_benchmark(tmp_path, monkeypatch, "gsm_hard")
    longer, _ = train(root, "new_bench", "train.max_steps=4")
    assert [s for s, _ in losses(longer)] == [1, 2, 3, 4] and losses(longer)[:3] == losses(first)
    with pytest.raises(ConfigError, match=r"\(data\.exclude_eval \(without aime24 aime25 alpaca gsm_hard humaneval "
                                          r"livecodebench math500 mbpp mt_bench\) differ\).*train.resume=false"):
        train(root, "new_bench", "train.max_steps=5", "data.exclude_eval=[gsm8k]")


def test_ar_weight_zero_is_a_real_switch(root):
    with_ar, _ = train(root, "lam1", "train.ar_weight=1")
    without, _ = train(root, "lam0", "train.ar_weight=0")
    assert all("loss_ar" in r for r in with_ar if "loss" in r)
    assert not any("loss_ar" in r for r in without)
    assert losses(with_ar)[-1] != losses(without)[-1]


def test_missing_responses_fail_with_the_fix(tmp_path):
    from d3d.errors import ConfigError

    with pytest.raises(ConfigError, match="d3d.generate"):
        run_train(compose("train", ["+experiment=smoke"], tmp_path))


def test_train_cli_saves_a_loadable_drafter(root):
    proc = subprocess.run([sys.executable, "-m", "d3d.train", "+experiment=smoke", "data.limit=10",
                           f"paths.root_dir={root}", f"paths.cache_dir={CACHE_DIR}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from d3d.models.drafter import load_drafter
    from d3d.models.drafter_settings import DrafterSettings

    model, tok = load_drafter(root / "checkpoints" / "tiny_random-copy-lam1.0" / "final", dtype="float32")
    assert DrafterSettings.of(model).target == "tiny_random"
    assert "held-out τ" in proc.stdout


@pytest.mark.heavy  # torchrun: two real processes and a gloo process group
def test_contract9_two_processes_equal_one_process_on_the_global_batch(root, tmp_path):
    """Two real processes (DDP, gloo), one sequence each per step, end every step with the same
    weights as each other and as one process that takes the same two sequences as two micro-batches
    (grad_accum=2); the LR follows the same schedule and final/ loads."""
    import torch

    from d3d.models.drafter import build_drafter, load_drafter
    from d3d.train import TrainRecipe

    common = ["+experiment=smoke", "data.limit=10", "train.max_steps=4", "train.warmup_steps=2", "train.eval_every=0",
              "train.log_every=1", "train.save_every=100", "train.batch_size=1", "train.lr=1e-3",
              "train.freeze_embeddings=false", "train.progress=false"]
    proc = torchrun(2, ROOT / "tests" / "multiproc" / "train_worker.py", tmp_path, root, *common,
                    f"train.out_dir={tmp_path}/ddp")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["num_processes"], r["world_size"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    assert all(r["distributed_type"].endswith("MULTI_CPU") for r in ranks)

    cfg = compose("train", common + ["train.grad_accum=2", f"train.out_dir={tmp_path}/one"], root)
    typed = bind_config(cfg, "train")
    start, _ = build_drafter(typed.drafter, typed.target, typed.paths.cache_dir, dtype="float32")
    single = TrainRecipe(cfg)
    single.train()
    one = {k: v.detach() for k, v in single.drafter().state_dict().items()}
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    moved = max((one[k] - w).abs().max().item() for k, w in start.state_dict().items())
    assert moved > 1e-4  # the weights trained (else equality below would say nothing)
    for k in one:
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)  # DDP: every rank steps on the same gradient
        torch.testing.assert_close(w0[k], one[k], rtol=1e-5, atol=2e-6)
    lrs = lambda rows: [(r["step"], r["lr"]) for r in rows if "lr" in r]
    ddp_rows = list(read_jsonl(tmp_path / "ddp" / "metrics.jsonl"))
    assert lrs(ddp_rows) == lrs(read_jsonl(tmp_path / "one" / "metrics.jsonl"))
    assert [r["step"] for r in ddp_rows] == [1, 2, 3, 4]
    final, _ = load_drafter(tmp_path / "ddp" / "final", dtype="float32")
    torch.testing.assert_close(final.state_dict()["model.norm.weight"], w0["model.norm.weight"])



@pytest.mark.heavy  # torchrun: three two-process runs (gloo) and one single-process run, ~2 min on 2 cores
def test_fsdp2_two_processes_equal_one_process_evaluate_and_resume_exactly(root, tmp_path, fresh_accelerate_state):
    """conf/accelerate/fsdp.yaml (FSDP2, full shard) on two real processes: the drafter's parameters
    are DTensor shards (not DDP replicas); held-out τ is evaluated at steps 0, 2 and 4 (it died at
    step 0: the estimator called the sharded drafter outside the root's forward); the weights equal
    one process on the same global batch (contract 9) within fp32 rounding of the reduction order;
    and a run stopped after its step-2 checkpoint and resumed ends bit-equal to the uninterrupted one."""
    import torch

    from d3d.models.drafter import load_drafter
    from d3d.train import TrainRecipe

    env = {**accelerate_env(ROOT / "conf" / "accelerate" / "fsdp.yaml", 2), "ACCELERATE_MIXED_PRECISION": "no"}
    common = ["+experiment=smoke", "data.limit=10", "train.max_steps=4", "train.warmup_steps=2", "train.eval_every=2",
              "train.log_every=1", "train.save_every=2", "train.batch_size=1", "train.lr=1e-3",
              "train.freeze_embeddings=false", "train.progress=false", "train.mixed_precision=no"]
    worker = ROOT / "tests" / "multiproc" / "train_worker.py"

    def run(name: str, run_dir: str, *extra: str) -> tuple[list[dict], list[dict]]:
        out = tmp_path / name  # this run's rank files
        out.mkdir()
        proc = torchrun(2, worker, out, root, *common, f"train.out_dir={tmp_path / run_dir}", *extra, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        return ranks, list(read_jsonl(tmp_path / run_dir / "metrics.jsonl"))

    ranks, rows = run("fsdp", "fsdp_run")
    assert [(r["rank"], r["num_processes"], r["world_size"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    assert all(r["distributed_type"].endswith("FSDP") for r in ranks)
    assert all(r["dtensor_params"] == r["params"] for r in ranks)  # every parameter sharded: FSDP2, not DDP
    assert all(r["local_numel"] < 0.75 * r["numel"] for r in ranks)  # each rank holds about half
    assert [r["step"] for r in rows if "val_tau" in r] == [0, 2, 4]

    cfg = compose("train", common + ["train.grad_accum=2", f"train.out_dir={tmp_path}/one"], root)
    single = TrainRecipe(cfg)
    single.train()
    one = {k: v.detach() for k, v in single.drafter().state_dict().items()}
    w0, w1 = (torch.load(tmp_path / "fsdp" / f"rank{r}.pt") for r in range(2))
    for k in one:
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)
        torch.testing.assert_close(w0[k], one[k], rtol=1e-5, atol=2e-6)  # fp32: sums in another order
    lrs = lambda rows: [(r["step"], r["lr"]) for r in rows if "lr" in r]  # noqa: E731
    one_rows = list(read_jsonl(tmp_path / "one" / "metrics.jsonl"))
    assert lrs(rows) == lrs(one_rows)
    taus = lambda rows: [r["val_tau"] for r in rows if "val_tau" in r]  # noqa: E731
    assert taus(rows) == pytest.approx(taus(one_rows), abs=1e-9)  # each rank's half of the responses, summed
    final, _ = load_drafter(tmp_path / "fsdp_run" / "final", dtype="float32")
    for k, v in final.state_dict().items():
        torch.testing.assert_close(v, w0[k], rtol=0, atol=0)

    _, part = run("stopped", "resumed_run", "train.stop_at_step=2")  # as if killed after its step-2 save
    assert [r["step"] for r in part if "loss" in r] == [1, 2]
    _, resumed = run("resumed", "resumed_run")
    assert [(r["step"], r["loss"], r.get("val_tau")) for r in resumed if "loss" in r] == \
        [(r["step"], r["loss"], r.get("val_tau")) for r in rows if "loss" in r]
    r0 = torch.load(tmp_path / "resumed" / "rank0.pt")
    for k in w0:
        torch.testing.assert_close(r0[k], w0[k], rtol=0, atol=0)


@pytest.mark.parametrize("window", ["writing", "complete", "between_renames"])
def test_a_kill_anywhere_in_a_save_resumes_like_an_uninterrupted_run(root, monkeypatch, window):
    """Killed in the save at step 6 (saves at 3 and 6): the rerun continues from a whole checkpoint
    (not step 0), and metrics hold each step once, equal to an uninterrupted run's."""
    import d3d.train
    import d3d.utils.checkpoints as ck

    full, _ = train(root, "full")
    name = f"killed_{window}"
    with monkeypatch.context() as m:
        if window == "writing":  # the state is written, its COMPLETE marker is not
            m.setattr(d3d.train, "mark_complete", kill_on(2, ck.mark_complete))
        elif window == "complete":  # complete, not yet promoted
            m.setattr(d3d.train, "promote", kill_on(2, ck.promote))
        else:  # last/ moved aside, last.partial not yet in its place (the old rmtree-then-rename gap)
            m.setattr(ck, "_rename", kill_on(3, ck._rename))
        with pytest.raises(Killed):
            train(root, name)
    steps_run = []
    real_step = d3d.train.optimizer_step  # called once per optimizer step
    monkeypatch.setattr(d3d.train, "optimizer_step", lambda *a, **k: (steps_run.append(1), real_step(*a, **k))[1])
    resumed, out = train(root, name)
    # a complete step-6 state wins (promoted on restart); an unfinished one is redone from step 3; never step 0
    assert len(steps_run) == (3 if window == "writing" else 0)
    assert [r["step"] for r in resumed] == [r["step"] for r in full]  # each step once
    assert losses(resumed) == losses(full)
    assert not (out / "last.partial").exists() and not (out / "last.old").exists()


def test_a_checkpoint_ahead_of_its_metrics_is_refused(root):
    """metrics.jsonl cut back (or replaced) under a checkpoint: resuming used to continue past rows
    that no longer exist, ending with a history that lacks steps it trained."""
    from d3d.utils.io import CorruptFile

    _, out = train(root, "cut", "train.stop_at_step=3")
    rows = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(rows[:2]))  # steps 0 and 1 only; last/ holds step 3
    with pytest.raises(CorruptFile, match=r"last was saved after metrics.jsonl recorded step 3, .* up to step 1"):
        train(root, "cut")


def test_starting_over_drops_the_earlier_runs_checkpoint(root):
    """train.resume=false stopped before its first save, then resumed: it used to continue the
    earlier run's last/ (step 6) on top of the new run's rows."""
    full, _ = train(root, "full")
    _, out = train(root, "over", "train.max_steps=6")
    train(root, "over", "train.resume=false", "train.stop_at_step=1")  # saves every 3: no checkpoint yet
    resumed, _ = train(root, "over")
    assert losses(resumed) == losses(full)


@pytest.mark.heavy  # torchrun: one two-process run (gloo), ~1 min on 2 cores
def test_fsdp2_under_bf16_reduces_in_fp32_and_evaluates_a_bf16_gather_without_grad(root, tmp_path):
    """conf/accelerate/fsdp.yaml under bf16 mixed precision, as on a GPU node: the prepared FSDP2 root
    gathers its weights in bf16 but reduce-scatters the gradients in fp32, as DDP all-reduces them (so
    the 1.7B and 8B drafters train alike; accelerate's default policy reduces in bf16). The held-out τ
    decodes a gather in bf16 (the dtype the drafter decodes in) whose parameters take no gradient:
    an fp32 gather requiring grad made autocast cache a bf16 copy of every weight beside it."""
    env = {**accelerate_env(ROOT / "conf" / "accelerate" / "fsdp.yaml", 2), "ACCELERATE_MIXED_PRECISION": "bf16"}
    common = ["+experiment=smoke", "data.limit=10", "train.max_steps=2", "train.warmup_steps=1", "train.eval_every=2",
              "train.log_every=1", "train.save_every=2", "train.batch_size=1", "train.freeze_embeddings=false",
              "train.progress=false", "train.mixed_precision=bf16", f"train.out_dir={tmp_path}/run"]
    proc = torchrun(2, ROOT / "tests" / "multiproc" / "train_worker.py", tmp_path, root, *common, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["distributed_type"].endswith("FSDP") for r in ranks)
    for r in ranks:
        assert r["mp_policy"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}, r
        assert r["evaluated"] == [{"dtype": "torch.bfloat16", "requires_grad": False}] * 2, r  # steps 0 and 2
