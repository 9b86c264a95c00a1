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
