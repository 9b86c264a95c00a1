"""scripts/memory_plan.py: drafter shapes from the configs, what each engine shards, the 8B-drafter
overlays' fit, and docs/gpu.md's tables as the script prints them."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, load_script


@pytest.fixture(scope="module")
def plan():
    return load_script("memory_plan")


@pytest.mark.parametrize("name, published", [("qwen3_1p7b", 1.72e9), ("qwen3_8b", 8.19e9), ("qwen3_32b", 32.8e9)])
def test_parameter_counts_are_the_published_ones(plan, name, published):
    from d3d.models.random_models import SHAPES

    assert plan.params(plan.shape_of_config(SHAPES[name])) == pytest.approx(published, rel=0.01)


def test_the_drafter_shape_follows_its_init(plan):
    """target_copy is the target's shape, a pretrained drafter its model's, target_layers the target's
    with fewer layers, and a shape by hand the same as its config."""
    from d3d.models.random_models import SHAPES

    _, cfg = plan.compose_overlay("train", ["+experiment=qwen3_8b_d8b"])
    assert plan.overlay_shapes(cfg)[0] == plan.shape_of_config(SHAPES["qwen3_8b"])
    _, cfg = plan.compose_overlay("train", ["+experiment=qwen3_32b_d8b"])
    d, t, _ = plan.overlay_shapes(cfg)
    assert (d.layers, t.layers) == (36, 64)
    _, cfg = plan.compose_overlay("train", ["+experiment=qwen3_8b", "drafter=target_layers", "drafter.layers=[0,5,9]"])
    assert plan.overlay_shapes(cfg)[0].layers == 3 and plan.overlay_shapes(cfg)[0].hidden == 4096


def test_what_each_engine_shards(plan):
    """Per GPU, on 8 GPUs: single and DDP hold everything (8B drafter: 122 GiB of fp32 weights, grads
    and AdamW before activations, the issue's figure); FSDP2 and ZeRO-3 an eighth of it; ZeRO-2 the
    bf16 weights and gradient buckets whole."""
    from d3d.models.random_models import SHAPES

    s = plan.shape_of_config(SHAPES["qwen3_8b"])
    step = plan.Step(batch=1, seq=1024, rows=1024, chunk_rows=1024, checkpointing=True, flex=True)
    states = {e: plan.train_peak(s, e, 8, step)["states"] / plan.GIB for e in plan.ENGINES}
    assert states["single"] == pytest.approx(122, abs=1)
    assert states["ddp"] == pytest.approx(states["single"] * 20 / 16)
    assert states["fsdp"] == states["deepspeed_zero3"] == pytest.approx(states["single"] / 8)
    assert states["deepspeed_zero2"] == pytest.approx(states["single"] * (4 + 14 / 8) / 16)
    # gathering engines pay for the unsharded root and layers; the others for autocast's weight copy
    g = {e: plan.train_peak(s, e, 8, step)["gathered"] for e in plan.ENGINES}
    assert g["fsdp"] > 0 and g["single"] == g["ddp"] == 2 * plan.params(s) and g["deepspeed_zero2"] == 0


@pytest.mark.parametrize("name", ["qwen3_8b", "qwen3_32b"])
def test_the_1p7b_drafter_overlays_fit_an_h100_under_every_engine(plan, name):
    """Training, recovery and the layer sweep of the 1.7B drafter fit 8 x H100 whatever the engine."""
    rows = (plan.train_plan([f"+experiment={name}"], 8) + plan.evaluate_plan([f"+experiment={name}"], 8)
            + plan.prune_plan([f"+experiment={name}"], 8))
    assert {r["engine"] for r in rows} == set(plan.ENGINES)
    assert all(plan.fits(r["total"], "H100") for r in rows), [r for r in rows if not plan.fits(r["total"], "H100")]


def launch_lines(name: str) -> dict[str, list[str]]:
    """The overlay header's `accelerate launch` lines per GPU class: {gpu: [config file, overrides...]}."""
    text = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()
    out, gpu = {}, None
    for line in text.splitlines():
        if m := re.match(r"#\s+8 x (H100|H200)", line):
            gpu = m.group(1)
        elif gpu and (m := re.match(r"#\s+accelerate launch --config_file (\S+) -m d3d.train (.*)", line)):
            out[gpu] = [m.group(1), *m.group(2).split()]
            gpu = None
    return out


@pytest.mark.parametrize("name", ["qwen3_8b_d8b", "qwen3_32b_d8b"])
def test_the_8b_drafter_overlays_fit_the_gpus_their_header_names(plan, name):
    """Each GPU class's launch line in the overlay's header: its accelerate config exists, and
    training, its evaluation, recovery and the layer sweep fit 8 of those GPUs with the plan's headroom; the same
    global batch on both; one process (no sharding) would not fit."""
    lines = launch_lines(name)
    assert set(lines) == {"H100", "H200"}, lines
    batches = set()
    for gpu, (config, *overrides) in lines.items():
        assert (ROOT / config).is_file()
        engine = {"fsdp.yaml": "fsdp", "deepspeed_zero3.yaml": "deepspeed_zero3",
                  "deepspeed_zero2.yaml": "deepspeed_zero2", "ddp.yaml": "ddp"}[config.rsplit("/", 1)[1]]
        rows = (plan.train_plan(overrides, 8, (engine, "single")) + plan.evaluate_plan(overrides, 8, (engine,))
                + plan.prune_plan(overrides, 8, (engine,)))
        for r in rows:
            assert plan.fits(r["total"], gpu) == (r["engine"] != "single" or r["stage"] == "layer sweep"), (gpu, r)
        train = rows[0]
        batches.add(train["micro_batch"] * train["grad_accum"])
    assert len(batches) == 1, batches


def test_decoding_needs_two_gpus_where_the_issue_found_it_refused(plan):
    """Qwen3-32B with the 1.7B drafter at 16 requests (the paper's load test, 82.3 GiB by the bound)
    and Qwen3-32B with an 8B drafter do not fit one H100; both fit an H200; the 8B pair fits one H100."""
    def most(overlay, batch, gpu):
        return max(plan.decode_gpus(r, gpu) for r in plan.decode_plan([f"+experiment={overlay}"], batch))

    assert most("qwen3_32b", 16, "H100") == 2 and most("qwen3_32b_d8b", 1, "H100") == 2
    assert most("qwen3_32b", 16, "H200") == most("qwen3_32b_d8b", 16, "H200") == 1
    assert most("qwen3_8b", 16, "H100") == 1


def test_docs_gpu_md_holds_the_tables_the_script_prints(plan):
    """docs/gpu.md's fit tables are the script's output, not typed by hand: regenerate them with
    `python scripts/memory_plan.py --markdown` when the plan or an overlay changes."""
    assert plan.markdown(8) in (ROOT / "docs" / "gpu.md").read_text()


def test_docs_gpu_md_holds_the_cost_table_the_script_prints():
    """docs/gpu.md's cost table is scripts/gpu_cost.py's output at its stated inputs."""
    cost = load_script("gpu_cost")
    assert cost.markdown(cost.OVERLAYS, cost.Inputs()) in (ROOT / "docs" / "gpu.md").read_text()


def test_the_cost_follows_its_inputs():
    """Training time is inverse in the MFU and linear in the steps; an 8B drafter trains ~4.4x longer
    than the 1.7B (7.6B / 1.7B matmul parameters: the 8B's untied input embedding is a lookup); the eval
    of Qwen3-32B + 8B holds two H100s (the plan)."""
    cost = load_script("gpu_cost")
    x = cost.Inputs()
    train = lambda overrides, x: next(r for r in cost.stage_rows(overrides, x) if r["stage"] == "train")  # noqa: E731
    base = train(["+experiment=qwen3_8b"], x)["seconds"]
    assert train(["+experiment=qwen3_8b"], cost.Inputs(mfu=x.mfu / 2))["seconds"] == pytest.approx(2 * base)
    assert train(["+experiment=qwen3_8b", "train.max_steps=10000"], x)["seconds"] == pytest.approx(base / 2)
    assert train(["+experiment=qwen3_8b_d8b"], x)["seconds"] / base == pytest.approx((8.19 - 0.62) / 1.72, rel=0.05)
    ev = next(r for r in cost.stage_rows(["+experiment=qwen3_32b_d8b"], x) if r["stage"] == "eval")
    assert ev["gpus"] == 2


def test_pruning_recovery_is_priced_at_its_global_batch():
    """d3d.prune recovers on train.batch_size x grad_accum per GPU (with_global_batch), so the recovery
    part of the prune row grows with grad_accum (it was priced at one micro-batch: 4x low at grad_accum 4)."""
    cost = load_script("gpu_cost")
    x = cost.Inputs()

    prune = {n: next(r for r in cost.stage_rows(["+experiment=qwen3_8b", f"train.grad_accum={n}"], x)
                     if r["stage"] == "prune")["seconds"] for n in (1, 2, 4)}
    one_micro_batch = prune[2] - prune[1]  # the sweep does not change with grad_accum; recovery does
    assert one_micro_batch > 0 and prune[4] - prune[1] == pytest.approx(3 * one_micro_batch)


def test_eager_evaluation_is_priced_host_bound():
    """An eager round takes the host's time to issue its aten ops when that is longer than reading the
    weights (docs/design.md: ~2.6 k ops at ~7.5 µs a Qwen3-8B AR round, ~20 ms, against ~7 ms of HBM
    reads): the eager eval of qwen3_8b costs several times the bandwidth-bound figure, and with no host
    cost (or decode.backend=compiled) it is the bandwidth-bound one again."""
    cost = load_script("gpu_cost")
    ev = lambda x, *o: next(r for r in cost.stage_rows(["+experiment=qwen3_8b", *o], x) if r["stage"] == "eval")  # noqa: E731
    eager, bound = ev(cost.Inputs()), ev(cost.Inputs(host_us_per_op=0))
    assert eager["seconds"] > 3 * bound["seconds"]
    assert "eager" in eager["how"]
    # the AR rounds alone (the drafting ones' ops set to 0): one Qwen3-8B round's 2,600 ops per token,
    # 7.5 µs more an op costs 786 items x 600 tokens x 2,600 x 7.5 µs more
    ar_only = dict(eager_ops_sync=0, eager_ops_async=0)
    slower = ev(cost.Inputs(host_us_per_op=15, **ar_only))["seconds"] - ev(cost.Inputs(**ar_only))["seconds"]
    assert slower == pytest.approx(786 * 600 * 2_600 * 7.5e-6)
