"""One held-out split (d3d.examples.held_out): the scripts that report a held-out τ read the responses
d3d.train held out, whatever train.* setting decides them. They built the split themselves before,
without train.drop_looping, so with it their "held-out τ" came from other responses."""

from __future__ import annotations

import json
import sys

import pytest

from d3d.examples import ExampleSet, load_examples, split_examples
from tests.conftest import CACHE_DIR, compose, load_script


class Stop(Exception):
    """Raised where a run has made its split: nothing after it (a drafter, vLLM) is needed here."""


def stop(*args, **kwargs):
    raise Stop


class StopAtLoad:
    """Stands in for d3d.models.drafter.SavedDrafter in a script: naming the drafter ends the run."""

    named = staticmethod(stop)


@pytest.fixture
def responses(tmp_path):
    """12 responses, 4 of them caught in a repetition loop: train.drop_looping changes the split."""
    rows = [{"id": f"p{i:02d}", "prompt_ids": [1, 2, 3],
             "response_ids": [4, 5, 6, 7] * 30 if i % 3 == 1 else [4 + i, 5, 6, 7, 8]} for i in range(12)]
    folder = tmp_path / "responses"
    folder.mkdir()
    (folder / "responses.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def made(monkeypatch):
    """The rows of every ExampleSet made from here on (a split's parts are ExampleSets)."""
    seen: list[tuple[int, ...]] = []
    init = ExampleSet.__init__

    def recording(self, path, rows, max_len, table=None):
        init(self, path, rows, max_len, table)
        seen.append(tuple(self.rows.tolist()))

    monkeypatch.setattr(ExampleSet, "__init__", recording)
    return seen


def overrides(tmp_path, responses) -> list[str]:
    return ["+experiment=smoke", f"train.responses_dir={responses}", "train.drop_looping=true", "train.val_size=3",
            f"paths.root_dir={tmp_path}", f"paths.cache_dir={CACHE_DIR}"]


def train_held_out(tmp_path, responses, monkeypatch) -> tuple[int, ...]:
    """The rows d3d.train holds out (what it validates on), with the drafter never built."""
    from d3d.train import TrainRecipe

    val = []
    monkeypatch.setattr("d3d.train.cut_responses", lambda examples, n: val.append(examples) or examples)
    monkeypatch.setattr("d3d.train.build_drafter", stop)
    with pytest.raises(Stop):
        TrainRecipe(compose("train", overrides(tmp_path, responses) + [f"train.out_dir={tmp_path}/ckpt"]))
    return tuple(val[0].rows.tolist())


# script, its arguments besides the overrides, and the name in it that is called once the split is made
SCRIPTS = [
    ("estimate_tau", ["--drafter", "unused"], "SavedDrafter"),
    ("recovery_study", ["--drafter", "unused"], "make_accelerator"),
    ("prune_study", ["--drafter", "unused"], "SavedDrafter"),
    ("served_tau", ["--served", "unused", "--out", "unused.json"], "cpu"),
    ("bench_train", [], "build_drafter"),
]


@pytest.mark.parametrize("script, args, after_split", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_a_script_holds_out_what_d3d_train_holds_out_with_drop_looping(script, args, after_split, tmp_path,
                                                                       responses, made, monkeypatch):
    expected = train_held_out(tmp_path, responses, monkeypatch)
    # the split without train.drop_looping holds out other rows: the check below can tell them apart
    assert tuple(split_examples(load_examples(responses, 384), 3, 0)[1].rows.tolist()) != expected
    made.clear()
    module = load_script(script)
    monkeypatch.setattr(module, after_split, StopAtLoad if after_split == "SavedDrafter" else stop)
    monkeypatch.setenv("D3D_VLLM_PYTHON", sys.executable)  # served_tau asks for vLLM's interpreter first
    monkeypatch.setattr(sys, "argv", [script, *args, *overrides(tmp_path, responses)])
    with pytest.raises(Stop):
        module.main()
    assert expected in made, f"{script} held out other responses than d3d.train: {made}"


def test_choose_budget_calibrates_on_what_d3d_train_holds_out(tmp_path, responses, made, monkeypatch):
    """scripts/choose_budget.py --held-out: its calibration responses are the held-out split's first --n
    (it took the responses folder's last rows before, responses the drafter may have trained on)."""
    import argparse

    expected = train_held_out(tmp_path, responses, monkeypatch)
    made.clear()
    args = argparse.Namespace(held_out=True, n=2, overrides=overrides(tmp_path, responses))
    pairs = load_script("choose_budget").calibration(args, None, None, None)  # no model: the split only
    assert expected in made, f"choose_budget held out other responses than d3d.train: {made}"
    rows = [json.loads(line) for line in (responses / "responses.rank0.jsonl").read_text().splitlines()]
    assert pairs == [(rows[i]["prompt_ids"] + rows[i]["response_ids"], 3) for i in expected[:2]]
