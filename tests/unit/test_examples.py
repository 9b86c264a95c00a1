"""The training input pipeline (d3d.examples) on small synthetic response folders, no model:
the Arrow cache, the cached length-grouped order (exact resume, N ranks = one process), the padding
it leaves, and DataLoader workers packing the batches one process would."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from d3d.errors import ConfigError
from d3d.examples import StepBatches, StepLoader, batch_at, load_examples, split_examples
from d3d.objective import ObjectiveConfig
from tests.conftest import load_script

bench = load_script("bench_data")


@pytest.fixture(scope="module")
def responses(tmp_path_factory):
    """600 responses at long-tailed (log-normal) lengths, in two shards."""
    return bench.write_synthetic_responses(tmp_path_factory.mktemp("responses"), 600, seed=3)


def ids_of(examples) -> list[tuple]:
    return [tuple(e.ids) for e in examples]


def test_the_set_is_each_id_once_in_id_order_cut_to_max_len(tmp_path):
    """What load_examples read from the jsonl rows before: sorted by id, the first row of an id kept,
    cut to max_len, a row with no response token left after the cut dropped."""
    rows = [("b", [1, 2], [3, 4, 5]), ("a", [6], [7]), ("b", [9], [9]), ("c", [1, 2, 3, 4], [5]), ("a0", [8], [])]
    for r, part in enumerate((rows[:3], rows[3:])):
        (tmp_path / f"responses.rank{r}.jsonl").write_text("".join(
            json.dumps({"id": i, "prompt_ids": p, "response_ids": q}) + "\n" for i, p, q in part))
    examples = load_examples(tmp_path, 4)
    assert (tmp_path / "examples.arrow").is_file()
    assert [(e.ids, e.prompt_len) for e in examples] == [([6, 7], 1), ([1, 2, 3, 4], 2)]  # c: no reply within 4
    assert [(e.ids, e.prompt_len) for e in load_examples(tmp_path, 8)] == [([6, 7], 1), ([1, 2, 3, 4, 5], 2), ([1, 2, 3, 4, 5], 4)]


def test_a_prompt_two_shards_answer_differently_is_refused(tmp_path):
    from d3d.data.responses import ConflictingShards

    for r, reply in enumerate(([3], [3], [4])):
        (tmp_path / f"responses.rank{r}.jsonl").write_text(json.dumps({"id": "p", "prompt_ids": [1], "response_ids": reply}) + "\n")
    with pytest.raises(ConflictingShards, match=r"'p' has different responses in responses.rank0.jsonl and responses.rank2.jsonl"):
        load_examples(tmp_path, 8)
    (tmp_path / "responses.rank2.jsonl").unlink()  # the same answer in two shards is one row
    assert [e.ids for e in load_examples(tmp_path, 8)] == [[1, 3]]


def test_the_cache_is_rebuilt_when_a_shard_changes_and_kept_when_none_does(responses, tmp_path):
    folder = bench.write_synthetic_responses(tmp_path / "r", 40, seed=1)
    first = load_examples(folder, 4096)
    cache = folder / "examples.arrow"
    stamp = cache.stat().st_mtime_ns
    assert ids_of(load_examples(folder, 4096)) == ids_of(first) and cache.stat().st_mtime_ns == stamp
    shard = folder / "responses.rank1.jsonl"
    with open(shard, "a") as f:  # a generate run that went on
        f.write(json.dumps({"id": "s9999999", "prompt_ids": [1], "response_ids": [2, 3]}) + "\n")
    grown = load_examples(folder, 4096)
    assert len(grown) == len(first) + 1 and grown[-1].ids == [1, 2, 3]
    shard.write_text(shard.read_text().replace("[2, 3]", "[2, 4]"))  # same size, another mtime
    os.utime(shard, ns=(stamp + 10**9, stamp + 10**9))
    assert load_examples(folder, 4096)[-1].ids == [1, 2, 4]


def test_a_pickled_set_carries_the_path_not_the_tokens(responses):
    train, _ = split_examples(load_examples(responses, 4096), 10, 0)
    blob = pickle.dumps(train)
    assert len(blob) < 20_000 < sum(len(e.ids) for e in train) * 4
    assert ids_of(pickle.loads(blob)) == ids_of(train)


def read_steps(train, steps, bs, accum, ranks, grouping, seed=0):
    """{(step, piece): example ids} as `ranks` processes of `accum` micro-batches read them."""
    per_step = bs * accum * ranks
    return {(s, m * ranks + r): ids_of(batch_at(train, s, m, per_step, bs, seed, r, ranks, grouping))
            for s in steps for m in range(accum) for r in range(ranks)}


@pytest.mark.parametrize("grouping", [0, 4])
def test_n_ranks_read_what_one_process_reads_and_a_resumed_run_reads_on(responses, grouping):
    """Contract 9 and exact resume with the order cached per epoch: 4 ranks x 1 micro-batch read the
    slices that 1 process x 4 micro-batches reads, and a fresh process (a resumed run) reading from
    step 9 on reads what the running one does. 590 examples / 24 a step: steps straddle epochs."""
    train, _ = split_examples(load_examples(responses, 4096), 10, 0)
    steps = range(60)
    four_ranks = read_steps(train, steps, 6, 1, 4, grouping)
    assert four_ranks == read_steps(train, steps, 6, 4, 1, grouping)
    fresh, _ = split_examples(load_examples(responses, 4096), 10, 0)
    assert read_steps(fresh, range(9, 60), 6, 1, 4, grouping) == {k: v for k, v in four_ranks.items() if k[0] >= 9}
    # each epoch reads every example once: the first 590 positions are the set, shuffled
    flat = [x for s in steps for p in range(4) for x in four_ranks[(s, p)]]
    assert sorted(flat[: len(train)]) == sorted(ids_of(train)) and flat[: len(train)] != ids_of(train)


def packed_steps(train, grouping, steps=30, bs=4, accum=2, ranks=4):
    objective = ObjectiveConfig.shipped(16, anchors_per_seq=32)
    batches = StepBatches(train, objective, 1, 0, 0, bs, accum, grouping, steps, rank=1, ranks=ranks)
    return [b for s in range(steps) for b in batches[s]]


def test_length_grouping_keeps_padding_under_15_percent_on_long_tailed_lengths(responses):
    """The issue's goal on a log-normal length set: a plain shuffle pads ~30 % of the packed rows (batch 4)."""
    train, _ = split_examples(load_examples(responses, 3072), 10, 0)
    plain, grouped = (bench.padding_share(packed_steps(train, g)) for g in (0, 16))
    assert plain > 0.25 and grouped <= 0.15, (plain, grouped)


def test_two_workers_pack_the_batches_of_the_loop_process(responses):
    """Anchors come from per-(seed, step, slice) generators, so where a batch is packed changes
    nothing: 2 DataLoader workers from step 5 yield what the loop's own process packs."""
    train, _ = split_examples(load_examples(responses, 512), 10, 0)
    objective = ObjectiveConfig.shipped(4, anchors_per_seq=8)
    batches = StepBatches(train, objective, 1, 0, 7, 2, 2, 4, 12, rank=1, ranks=2)
    here, there = StepLoader(batches, 5, 0), StepLoader(batches, 5, 2)
    assert here.next_step == there.next_step == 5
    for _ in range(5, 12):
        for a, b in zip(next(here), next(there), strict=True):
            for field in ("input_ids", "dn_rows", "dn_targets", "ar_rows"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
            assert torch.equal(a.layout.block, b.layout.block) and a.n_tokens == b.n_tokens
    assert here.next_step == 12
    with pytest.raises(StopIteration):
        next(there)


def test_a_shard_edited_in_place_with_its_size_and_mtime_kept_rebuilds_the_cache(tmp_path, monkeypatch):
    """`cp -p` / `rsync -a` of other responses over a shard keeps its size and mtime: the cache, keyed
    on both, served the old rows. A copy of the folder (new inodes, same bytes) keeps its cache."""
    import shutil

    import d3d.examples as ex

    folder = bench.write_synthetic_responses(tmp_path / "r", 40, seed=1)
    first = load_examples(folder, 4096)
    shard = folder / "responses.rank1.jsonl"
    before = shard.stat()
    text = shard.read_text()
    # the first reply's first token gets a leading digit, a prompt loses a space: same size, other rows
    edited = text.replace('"response_ids": [', '"response_ids": [7', 1).replace(", ", ",", 1)
    assert len(edited) == len(text) and edited != text
    shard.write_text(edited)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size and shard.stat().st_mtime_ns == before.st_mtime_ns
    again = load_examples(folder, 4096)
    assert len(again) == len(first) and sum(a != b for a, b in zip(ids_of(again), ids_of(first))) == 1
    copy = shutil.copytree(folder, tmp_path / "copy")  # copy2: the same mtimes, other inodes
    built = []
    monkeypatch.setattr(ex, "build_cache", lambda *a: built.append(a))
    assert ids_of(load_examples(copy, 4096)) == ids_of(again) and built == []


def test_a_val_size_that_leaves_nothing_to_train_on_names_the_key_and_the_fix(tmp_path):
    folder = bench.write_synthetic_responses(tmp_path / "r", 10, seed=1)
    with pytest.raises(ConfigError, match=r"^train.val_size=10 holds out all 10 responses, leaving none for training. "
                                          r"Fix: set train.val_size below 10"):
        split_examples(load_examples(folder, 4096), 10, 0)
