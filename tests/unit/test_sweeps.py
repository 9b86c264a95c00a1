"""scripts/sweep.py's command lines, printed by --dry-run (nothing runs). Every claim's sweep end to
end is in tests/integration/test_sweeps.py."""

from __future__ import annotations


def test_swept_keys_win_over_trailing_overrides(sweep, capsys):
    """Trailing overrides change a sweep's defaults (eval.n) but not what it varies: an override of
    decode.block_size in the block-size sweep is dropped with a note, not silently measured."""
    sweep.main(["block_size", "--dry-run", "++decode.block_size=8", "eval.n=3", "train.max_steps=5"])
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if line.startswith("$ -m d3d.eval")]
    assert [line.rsplit(" ", 1)[1] for line in evals] == [f"decode.block_size={B}" for B in (4, 8, 16)]
    assert all("eval.n=3" in line and line.count("decode.block_size=") == 1 for line in evals)
    assert out.count("ignoring ++decode.block_size=8") == 3
    train = next(line for line in out.splitlines() if line.startswith("$ -m d3d.train"))
    assert "train.max_steps=5" in train and "drafter.block_size=4,8,16" in train


def test_recipe_arms_change_one_key_at_equal_wall_time(sweep, capsys):
    """The recipe study: every arm trains under the same budget and τ cadence, each with its own change
    last (a trailing override of an arm's key is dropped, not measured as that arm) in its own folder."""
    sweep.main(["recipe", "+experiment=pipeline_cpu", "train.lr=2e-5", "--dry-run", "--minutes", "5",
                "--arms", "base", "train.lr=1e-4", "train.gamma=3 train.ar_weight=0"])
    out = capsys.readouterr().out
    trains = [line for line in out.splitlines() if line.startswith("$ -m d3d.train")]
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
