"""d3d.train's data-parallel slicing on stand-in examples (no model, no process group). Training
end to end, resumes and two real processes are in tests/integration/test_train.py."""

from __future__ import annotations

from d3d.train import batch_at


def test_each_rank_and_micro_batch_reads_its_own_slice():
    """Data-parallel training: the ranks x micro-batches of one step partition that step's global
    batch (on one process it is the same sequence), and consecutive steps do not overlap."""
    train_set = list(range(100))  # stand-ins for examples: batch_at only indexes
    bs, accum, ranks = 2, 3, 4
    per_step = bs * accum * ranks
    seen = []
    for step in range(4):  # 96 of the 100 examples: one epoch, no example twice
        parts = [batch_at(train_set, step, m, per_step, bs, 0, r, ranks) for m in range(accum) for r in range(ranks)]
        flat = [x for p in parts for x in p]
        one_process = [x for m in range(accum * ranks) for x in batch_at(train_set, step, m, per_step, bs, 0)]
        assert sorted(flat) == sorted(one_process)
        seen += flat
    assert len(set(seen)) == len(seen) == 4 * per_step
