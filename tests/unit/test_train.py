"""d3d.train's data-parallel slicing on stand-in examples (no model, no process group). Training
end to end, resumes and two real processes are in tests/integration/test_train.py."""

from __future__ import annotations

import json

from d3d.examples import batch_at


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


def write_responses(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "responses.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_resumed_on_other_responses_is_refused_before_the_drafter_loads(tmp_path, monkeypatch):
    """The resume key held the data config, not the data: a run resumed on other responses (one
    token changed, or rows appended) trained on them silently. A copy of the same responses (new
    mtimes) has the same fingerprint."""
    import shutil

    import pytest

    from d3d.errors import ConfigError
    from d3d.settings import bind_config
    from d3d.examples import load_examples
    from d3d.train import TrainRecipe
    from d3d.training import train_resume_key, with_global_batch
    from d3d.utils.checkpoints import mark_complete
    from d3d.utils.io import write_json
    from tests.conftest import compose

    rows = [{"id": f"p{i:02d}", "prompt_ids": [1, 2, 3], "response_ids": [4 + i, 5, 6, 7]} for i in range(8)]
    data, out = tmp_path / "responses", tmp_path / "ckpt"
    write_responses(data, rows)
    raw = compose("train", ["+experiment=smoke", f"train.responses_dir={data}", f"train.out_dir={out}"], tmp_path)
    cfg = bind_config(raw, "train")
    cfg.train = with_global_batch(cfg.train, 1)
    fingerprint = load_examples(data, cfg.train.max_len).fingerprint()
    shutil.copytree(data, tmp_path / "copy", ignore=shutil.ignore_patterns("*.arrow"))
    assert load_examples(tmp_path / "copy", cfg.train.max_len).fingerprint() == fingerprint
    (out / "last").mkdir(parents=True)  # a checkpoint of a run trained on `rows`
    write_json(out / "last" / "trainer_state.json", {"step": 2, "resume_key": train_resume_key(cfg, fingerprint)})
    mark_complete(out / "last", 2)
    monkeypatch.setattr("d3d.train.build_drafter", lambda *a, **k: pytest.fail("the drafter loaded"))
    for other in ([{**rows[0], "response_ids": [4, 5, 6, 8]}, *rows[1:]],  # one token
                  rows + [{**rows[0], "id": "p99"}]):  # appended by a later generate run
        write_responses(data, other)
        with pytest.raises(ConfigError, match=r"was trained with other settings \(responses differ\).*Fix: resume"):
            TrainRecipe(raw)


def test_a_prune_run_resumed_on_other_responses_is_refused_before_the_drafter_loads(tmp_path, monkeypatch):
    """The same for d3d.prune: its calibration and hold-out split, and its recovery, read the responses."""
    import pytest

    from d3d.errors import ConfigError
    from d3d.prune import prune_resume_key, run_prune
    from d3d.settings import bind_config
    from d3d.examples import load_examples
    from d3d.training import with_global_batch
    from tests.conftest import compose

    rows = [{"id": f"p{i:02d}", "prompt_ids": [1, 2, 3], "response_ids": [4 + i, 5, 6, 7]} for i in range(8)]
    data, out = tmp_path / "responses", tmp_path / "pruned"
    write_responses(data, rows)
    raw = compose("prune", ["+experiment=smoke", f"train.responses_dir={data}", f"prune.out_dir={out}"], tmp_path)
    cfg = bind_config(raw, "prune")
    cfg.train = with_global_batch(cfg.train, 1)
    key = prune_resume_key(cfg, load_examples(data, cfg.train.max_len).fingerprint())
    out.mkdir()
    (out / "steps.jsonl").write_text(json.dumps({"step": 0, "resume_key": key}) + "\n")
    for name in ("build_drafter", "SavedDrafter.load"):
        monkeypatch.setattr(f"d3d.prune.{name}", lambda *a, **k: pytest.fail("the drafter loaded"))
    write_responses(data, rows + [{**rows[0], "id": "p99"}])
    with pytest.raises(ConfigError, match=r"was pruned with other settings \(responses differ\)"):
        run_prune(raw)
