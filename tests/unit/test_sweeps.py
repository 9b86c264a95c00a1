"""scripts/sweep.py's command lines, printed by --dry-run (nothing runs). Every claim's sweep end to
end is in tests/integration/test_sweeps.py."""

from __future__ import annotations

import pytest


def test_swept_keys_win_over_trailing_overrides(sweep, capsys):
    """Trailing overrides change a sweep's defaults (eval.n) but not what it varies: an override of
    decode.block_size in the block-size sweep is dropped with a note, not silently measured."""
    sweep.main(["block_size", "--dry-run", "++decode.block_size=8", "eval.n=3", "train.max_steps=5"])
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if line.startswith("$ python -m d3d.eval")]
    assert [line.rsplit(" ", 1)[1] for line in evals] == [f"decode.block_size={B}" for B in (4, 8, 16)]
    assert all("eval.n=3" in line and line.count("decode.block_size=") == 1 for line in evals)
    assert out.count("ignoring ++decode.block_size=8") == 3
    trains = [line for line in out.splitlines() if line.startswith("$ python -m d3d.train")]
    assert [("train.max_steps=5" in t, f"drafter.block_size={B} " in t) for t, B in zip(trains, (4, 8, 16))] == [(True, True)] * 3


def test_recipe_arms_change_one_key_at_equal_wall_time(sweep, capsys):
    """The recipe study: every arm trains under the same budget and τ cadence, each with its own change
    last (a trailing override of an arm's key is dropped, not measured as that arm) in its own folder."""
    sweep.main(["recipe", "+experiment=pipeline_cpu", "train.lr=2e-5", "--dry-run", "--minutes", "5",
                "--arms", "base", "train.lr=1e-4", "train.gamma=3 train.ar_weight=0"])
    out = capsys.readouterr().out
    trains = [line for line in out.splitlines() if line.startswith("$ python -m d3d.train")]
    assert len(trains) == 3
    assert all("train.max_minutes=5.0" in t and "train.eval_every=100000" in t and "+experiment=pipeline_cpu" in t
               for t in trains)
    assert trains[0].endswith("recipe/base") and "train.lr=2e-5" in trains[0]  # base: the trailing recipe as is
    assert trains[1].endswith("recipe/lr_1e-4 train.lr=1e-4") and "train.lr=2e-5" not in trains[1]
    assert trains[2].endswith("recipe/gamma_3__ar_weight_0 train.gamma=3 train.ar_weight=0")
    assert out.count("ignoring train.lr=2e-5") == 1


def test_recipe_refuses_an_arm_that_is_not_a_train_override(sweep, capsys):
    import pytest

    with pytest.raises(SystemExit):
        sweep.main(["recipe", "--dry-run", "--arms", "lr=1e-4"])
    assert "--arms 'lr=1e-4': an arm is 'base' or train.<key>=<value>" in capsys.readouterr().err


def test_gpu_preset_launches_each_arm_over_the_node_gpus(sweep):
    """--preset gpu: every arm is its own `accelerate launch` over the node's GPUs (training under the
    chosen conf/accelerate file, evaluation under ddp.yaml), at the paper's sizes: qwen3_8b's 20k steps and
    2048 new tokens, each benchmark's seeded subset (no eval.n cap), the seven benchmarks."""
    from d3d.config import compose
    from d3d.configdir import config_dir

    result = sweep.main(["ar_loss", "--preset", "gpu", "--gpus", "2", "--accelerate", "fsdp", "--dry-run",
                         "--root", "/scratch/d3d"])
    commands = result["commands"]
    assert len(commands) == 8  # 4 training arms, then 4 evaluations
    head = lambda config, job: ["accelerate", "launch", "--config_file", str(config_dir() / "accelerate" / f"{config}.yaml"),  # noqa: E731
                                "--num_processes", "2", "-m", f"d3d.{job}"]
    assert [c[:8] for c in commands] == [head("fsdp", "train")] * 4 + [head("ddp", "eval")] * 4
    assert [c[-2:] for c in commands[:2]] == [["train.ar_weight=0.0", "train.out_dir=/scratch/d3d/checkpoints/sweeps/ar_loss/lam0.0"],
                                              ["train.ar_weight=0.5", "train.out_dir=/scratch/d3d/checkpoints/sweeps/ar_loss/lam0.5"]]
    hydra_free = lambda c: [o for o in c[8:] if not o.startswith("hydra.")]  # noqa: E731
    train, ev = compose("train", hydra_free(commands[0])), compose("eval", hydra_free(commands[4]))
    assert (train.train.max_steps, train.train.ar_weight, train.target.name) == (20000, 0.0, "qwen3_8b")
    assert ev.eval.n is None and ev.eval.max_new_tokens == 2048 and len(ev.benchmark.specs) == 7
    assert ev.benchmark.specs.gsm8k.n == 128 and ev.drafter.checkpoint.endswith("ar_loss/lam0.0/final")


def test_gpu_preset_without_a_gpu_says_how_to_fix_it(sweep, capsys, monkeypatch):
    import pytest
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit):
        sweep.main(["budget", "--preset", "gpu", "--dry-run"])
    assert "--preset gpu: no GPU visible here. Fix:" in capsys.readouterr().err


def test_a_hydra_launcher_submits_a_stage_at_once(sweep, monkeypatch):
    """--hydra-launcher: each arm is a one-job multirun of that launcher, and the arms of one stage are all
    submitted before the sweep waits for any (each command blocks until its job ends)."""
    events = []

    class Job:
        def __init__(self, cmd):
            self.arm = cmd[-1]
            events.append(("submit", self.arm))

        def wait(self):
            events.append(("wait", self.arm))
            return 0

    monkeypatch.setattr(sweep.subprocess, "Popen", Job)
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: events.append(("run", a[0][-1])))
    sw = sweep.Sweep("block_size", sweep.PRESETS["gpu"], "d", [], sweep.Path("/r"), dry=False,
                     launcher=sweep.Launcher(hydra_launcher="slurm"))
    with sw.together():
        for B in (4, 8):
            sw.run("train", f"B{B}", fixed=(f"train.out_dir=/r/B{B}",))
    assert sw.commands[0][1:8] == ["-m", "d3d.train", "-m", "hydra/launcher=slurm",
                                   "hydra.sweep.dir=/r/outputs/sweeps/block_size/hydra/train_B4", "hydra.sweep.subdir=job",
                                   "train.out_dir=/r/B4"]
    assert events == [("submit", "train.out_dir=/r/B4"), ("submit", "train.out_dir=/r/B8"),
                      ("wait", "train.out_dir=/r/B4"), ("wait", "train.out_dir=/r/B8")]


def test_results_go_under_outputs_and_into_docs_only_when_published(sweep, tmp_path, monkeypatch):
    """The table, plot and data of a run go to a new outputs/sweeps/<claim>/<date_time>/ under --root;
    docs/results/ (the curated record) is written only with --publish."""
    rows = [{"benchmark": "gsm8k", "tau": 2.5, "sync_speedup": 1.5}, {"benchmark": "math500", "tau": 2.0, "sync_speedup": 1.2}]
    monkeypatch.setitem(sweep.CLAIMS, "async_vs_sync", lambda sw: {"rows": rows, "x": "benchmark", "plot": ["tau"]})
    monkeypatch.chdir(tmp_path)
    args = ["async_vs_sync", "--drafter", str(tmp_path), "--root", str(tmp_path)]
    sweep.main(args)
    assert not (tmp_path / "docs").exists()
    (run,) = (tmp_path / "outputs" / "sweeps" / "async_vs_sync").iterdir()
    assert sorted(p.name for p in run.iterdir()) == ["async_vs_sync.json", "async_vs_sync.md", "async_vs_sync.png"]
    assert sweep.json.loads((run / "async_vs_sync.json").read_text())["rows"] == rows
    sweep.main([*args, "--publish"])
    published = tmp_path / "docs" / "results" / "async_vs_sync.md"
    assert published.read_text() == (run / "async_vs_sync.md").read_text() and published.read_text().count("\n") == 4


def job_paths(sweep, command: list[str]) -> dict:
    """The paths one sweep command's job reads: its config composed from the command's overrides
    (the output folders and the drafter) and the Hydra folder its override names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from omegaconf import OmegaConf

    from d3d.config import compose

    job = next(c for c in command if c.startswith("d3d.")).split(".", 1)[1]
    overrides = command[command.index(f"d3d.{job}") + 1:]
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if o.startswith("hydra.")])
    cfg = compose(job, [o for o in overrides if not o.startswith("hydra.")])
    # Hydra puts the value in its own config (OmegaConf), which reads the escapes of `${`
    found = {p.key_or_group: OmegaConf.create({"v": p.value()}).v for p in parsed if p.key_or_group.endswith(".dir")}
    for key in ("drafter.checkpoint", f"{job}.out_dir"):
        if any(o.startswith(key + "=") for o in overrides):
            found[key] = OmegaConf.select(cfg, key)
    return found


@pytest.mark.parametrize("claim", ["ar_loss", "budget", "pruning", "recipe"])
def test_a_root_and_a_drafter_with_any_characters_reach_each_job_as_they_are(sweep, tmp_path, claim):
    """--root and --drafter paths holding `,` `=` a quote, brackets, spaces, `${` or a non-ASCII letter:
    they were pasted into the jobs' overrides unquoted, so Hydra read a sweep, a list, a syntax
    error or an interpolation."""
    root = tmp_path / "josé's sweeps, run=1 [a] ${x}"
    drafter = tmp_path / "my drafter, v=2 ${y}" / "final"
    result = sweep.main([claim, "--dry-run", "--root", str(root), "--drafter", str(drafter), "+experiment=smoke"])
    paths = [job_paths(sweep, c) for c in result["commands"]]
    assert all(paths) and all(str(p).startswith((str(root), str(drafter))) for found in paths for p in found.values()), paths
    if claim != "recipe" and claim != "ar_loss":
        assert str(drafter) in [found.get("drafter.checkpoint") for found in paths]


def test_a_root_that_cannot_be_an_override_is_one_line(sweep, tmp_path, capsys):
    """A path the override grammar cannot carry (one that ends in a backslash and a line break) is one
    line naming its key, before any job starts."""
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["budget", "--dry-run", "--drafter", str(tmp_path / "final\\\n")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: drafter.checkpoint=") and "Fix:" in err[0], err


def test_a_root_that_is_a_file_is_one_line_before_any_arm(sweep, tmp_path, capsys, monkeypatch):
    """--root at a file: each arm's Hydra failed making its folder, then the sweep's own traceback."""
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: pytest.fail("an arm ran"))
    (tmp_path / "root").write_text("")
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["ar_loss", "--root", str(tmp_path / "root"), "+experiment=smoke"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith(f"error: --root={tmp_path / 'root'}: ") and "Fix:" in err[0], err


def test_a_failed_arm_is_one_line_after_its_own_message(sweep, tmp_path, capsys, monkeypatch):
    """An arm that stops (its job said why in one line, exit 2) was followed by the sweep's
    CalledProcessError traceback; now one line naming the arm, with the arm's exit status."""
    def job(cmd, check):
        raise sweep.subprocess.CalledProcessError(2, cmd)

    monkeypatch.setattr(sweep.subprocess, "run", job)
    with pytest.raises(SystemExit) as exit_:
        sweep.main(["ar_loss", "--root", str(tmp_path), "+experiment=smoke"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: the arm `python -m d3d.train") and "exit status 2" in err[0] \
        and "Fix:" in err[0], err


def test_slurm_arms_of_an_8b_drafter_get_the_fsdp_launch(sweep, tmp_path):
    """--hydra-launcher slurm --accelerate fsdp: every training and pruning job's tasks get FSDP2's
    launch variables (d3d.utils.cluster.DistributedTasks), evaluation jobs stay data-parallel."""
    result = sweep.main(["pruning", "--preset", "gpu", "--hydra-launcher", "slurm", "--accelerate", "fsdp",
                         "--dry-run", "--root", str(tmp_path), "+experiment=qwen3_8b_d8b"])
    by_job = {}
    for cmd in result["commands"]:
        by_job.setdefault(cmd[2], []).append(cmd)
    assert set(by_job) >= {"d3d.prune", "d3d.eval"}, list(by_job)
    assert all("hydra.callbacks.distributed_tasks.accelerate=fsdp" in c for c in by_job["d3d.prune"])
    assert not any("distributed_tasks" in " ".join(c) for c in by_job["d3d.eval"])
