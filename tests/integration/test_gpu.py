"""The GPU check's contract checks, as tests: scripts/gpu_check.py runs the `gpu`-marked ones with
`pytest -m gpu` on a lent machine (recording each in gpu_check.json as it ends), then times the real
shapes. In file order, as the check's stages: greedy, sampling, race, async_sync, engine,
placement, compiled_equal (the runner maps a test to its stage by its name).

Where they run: on D3D_CHECK_DEVICE (default cuda; they skip on a machine without CUDA, unless it
says cpu, which is how `gpu_check --device cpu --toy` runs them here); D3D_CHECK_TOY=1 decodes
fewer tokens. The race and async-against-sync checks also have a CPU variant (`-cpu_suite`, not
marked gpu: the default suite runs it, the race check on the worker thread).

On the GPU machines there is no Hydra, OmegaConf, datasets or DeepSpeed: nothing this file or its
conftest files import at collection may need them (tests/integration/test_gpu_readiness.py
collects it in a process where they cannot be imported)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from d3d.decoding import DecodeConfig, SpecGenerator
from d3d.decoding.divergence import classify
from d3d.decoding.methods import METHODS
from d3d.decoding.verify import Sampling, probs, sample_verify
from d3d.models.random_models import NoText, random_prompts, tiny_pair

DEVICE = os.environ.get("D3D_CHECK_DEVICE", "cuda")
TOY = os.environ.get("D3D_CHECK_TOY") == "1"
CUDA = DEVICE.startswith("cuda")
ON_DEVICE = [pytest.mark.gpu, pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                                                 reason="needs CUDA (D3D_CHECK_DEVICE=cpu runs it on the CPU)")]
# one test on the check's device (gpu-marked) and, for the checks cheap enough, one on the CPU in
# the default suite
DEVICES = [pytest.param(DEVICE, marks=ON_DEVICE, id=DEVICE)]
AND_CPU = DEVICES + [pytest.param("cpu", id="cpu_suite")]


def on_device(fn):
    for mark in ON_DEVICE:
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module", autouse=True)
def precise_and_one_thread():
    """fp32 means fp32 on CUDA (no TF32 in the equality checks). On the CPU one thread per op: the
    race check needs it (both runs then split no reduction differently), and on 2 shared cores two
    OpenMP teams made these minutes instead of seconds."""
    tf32, threads = torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_num_threads(threads)


def new_tally() -> dict:
    return {"cases": 0, "equal": 0, "numerical": 0, "real": 0, "details": []}


def tally(out: dict, target, prompt: list[int], ref: list[int], got: list[int], **where) -> dict:
    """Count one greedy comparison; a difference is classified by the target's logit margin."""
    d = classify(target, prompt, ref, got)
    out["cases"] += 1
    out["equal"] += d is None
    if d is not None:
        out[d["kind"]] += 1
        out["details"].append({**where, **d})
    return out


def generator(target, drafter, method: str, **cfg) -> SpecGenerator:
    return SpecGenerator(target, NoText(), None if method == "ar" else drafter, DecodeConfig(method=method, **cfg),
                         eos_token_ids=[])


# ---- greedy: every loop gives transformers' greedy tokens (fp32, batch 1 and a ragged batch) ----

# (tree and async_tree read tree_nodes / tree_trays at their defaults, 15 and 23; C and F are async's)
GREEDY_CASES = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("sync", 6, 1, 0), ("async", 4, 3, 2), ("async", 6, 6, 3),
                ("tree", 6, 1, 0), ("async_tree", 6, 1, 0)]


@on_device
@pytest.mark.parametrize("batch", [1, 3], ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("method,B,C,F", GREEDY_CASES, ids=[f"{m}_B{b}_C{c}_F{f}" for m, b, c, f in GREEDY_CASES])
def test_greedy_equals_generate(method, B, C, F, batch, record_property):
    """generate runs unmasked kernels and the loop masked ones: a rare near-tie may flip even in
    fp32, so the criterion is no divergence that rounding cannot explain (d3d.decoding.divergence)."""
    n = 16 if TOY else 32
    target, drafter = tiny_pair(DEVICE, torch.float32, block_size=6)
    prompts = random_prompts(batch, 256, seed=batch)
    res = generator(target, drafter, method, block_size=B, C=C, F=F, max_new_tokens=n).generate(prompts)
    case = new_tally()
    for p, got in zip(prompts, res.token_ids):
        ref = target.generate(torch.tensor([p], device=DEVICE), max_new_tokens=n, do_sample=False)
        tally(case, target, p, ref[0, len(p):].tolist(), got, method=method, B=B, C=C, F=F, batch=batch)
    record_property("result", case)
    assert case["cases"] == batch and case["real"] == 0, case["details"]


# ---- greedy with the drafter's options (docs/design.md, Causal blocks and Draft vocabulary): a causal
# block and a draft vocabulary change the drafter's passes (its mask, its head and the scatter to target ids) ----

def with_option(drafter, option: str):
    """The drafter with drafter.block_attention=causal, or a draft vocabulary of every other token
    (and the mask), so that half the target's greedy tokens cannot be drafted."""
    from d3d.models.drafter import attach_draft_head
    from d3d.models.drafter_settings import DrafterSettings

    s = DrafterSettings.of(drafter)
    if option == "causal":
        s.block_attention = "causal"
        s.attach(drafter)
    else:
        attach_draft_head(drafter, torch.tensor(sorted(set(range(0, s.vocab_size, 2)) | {s.mask_token_id})))
    return drafter


@on_device
@pytest.mark.parametrize("option", ["causal", "draft_vocab"])
@pytest.mark.parametrize("method", ["sync", "async", "tree"])
def test_greedy_with_drafter_options_equals_generate(method, option, record_property):
    n = 16 if TOY else 32
    target, drafter = tiny_pair(DEVICE, torch.float32, block_size=6)
    prompts = random_prompts(3, 256, seed=7)
    res = generator(target, with_option(drafter, option), method, block_size=6, C=3, F=2,
                    max_new_tokens=n).generate(prompts)
    case = new_tally()
    for p, got in zip(prompts, res.token_ids):
        ref = target.generate(torch.tensor([p], device=DEVICE), max_new_tokens=n, do_sample=False)
        tally(case, target, p, ref[0, len(p):].tolist(), got, method=method, option=option)
    record_property("result", case)
    assert case["cases"] == 3 and case["real"] == 0, case["details"]


# ---- sampling: contract 2 on the device (the output law is the target's) ----

def total_variation(counts: dict, exact: dict, n: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in {**{k: 0.0 for k in counts}, **exact}.items())


@on_device
def test_sampling_one_verify_step_follows_p(record_property):
    """One verification step on a toy vocabulary of 6 (60,000 draws): the first token out follows p."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    torch.manual_seed(0)
    V, B, n = 6, 3, 60000
    p_logits = (torch.randn(1, B, V) * 1.5).expand(n, B, V).to(DEVICE)
    q_logits = (torch.randn(1, B - 1, V) * 1.5).expand(n, B - 1, V).to(DEVICE)
    s = Sampling(temperature=1.0)
    q = probs(q_logits, s)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, B - 1)
    accepted, token = sample_verify(p_logits, drafts, q, s, g)
    first = torch.where(accepted > 0, drafts[:, 0], token)
    emp = torch.bincount(first, minlength=V).float().cpu() / n
    tv = 0.5 * (emp - probs(p_logits[0, 0], s).cpu()).abs().sum().item()
    record_property("result", {"step_tv": tv, "limit": 0.015})
    assert tv < 0.015


@pytest.fixture(scope="module")
def two_token_law():
    """The exact joint law of the first two sampled tokens (top-4 keeps the support at 16)."""
    target, drafter = tiny_pair(DEVICE, torch.float32, block_size=4)
    prompt = random_prompts(1, 256, seed=5)[0]
    sk = Sampling(temperature=1.0, top_k=4)
    exact = {}
    with torch.no_grad():
        p1 = probs(target(torch.tensor([prompt], device=DEVICE)).logits[0, -1], sk)
        for x1 in torch.nonzero(p1).flatten().tolist():
            p2 = probs(target(torch.tensor([prompt + [x1]], device=DEVICE)).logits[0, -1], sk)
            for x2 in torch.nonzero(p2).flatten().tolist():
                exact[(x1, x2)] = (p1[x1] * p2[x2]).item()
    return target, drafter, prompt, exact


@on_device
@pytest.mark.parametrize("method", ["ar", "sync", "async"])
def test_sampling_joint_law_of_two_tokens(method, two_token_law, record_property):
    """3,000 requests in one batch through each loop: total variation against the exact law under
    0.06 (16 outcomes, n = 3,000: noise alone gives about 0.03)."""
    target, drafter, prompt, exact = two_token_law
    n = 3000
    res = SpecGenerator(target, NoText(), None if method == "ar" else drafter,
                        DecodeConfig(method=method, block_size=4, C=3, F=2, temperature=1.0, top_k=4, max_new_tokens=2),
                        eos_token_ids=[], seed=7).generate([prompt] * n)
    counts: dict = {}
    for t in res.token_ids:
        counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    tv = total_variation(counts, exact, n)
    record_property("result", {"joint_tv": tv, "limit": 0.06})
    assert tv < 0.06


# ---- race: async with its tray pass overlapped against async serial, bit for bit ----

def async_run(target, drafter, prompts, overlap: str, C: int, F: int, new_tokens: int, method: str = "async"):
    """async (C x F trays) or async_tree (a tree of C nodes, F trays), its tray pass as `overlap` says."""
    shape = dict(C=C, F=F) if method == "async" else dict(tree_nodes=C, tree_trays=F)
    return generator(target, drafter, method, block_size=6, overlap=overlap, cpu_threads_drafter=1,
                     max_new_tokens=new_tokens, **shape).generate(prompts)


def same_rounds(a, b) -> dict:
    """Bit-for-bit comparison of two async runs: tokens, τ and hits per round."""
    hits = lambda res: [r.hit for r in res.rounds]  # noqa: E731
    return {"tokens_equal": a.token_ids == b.token_ids, "tau_equal": a.taus() == b.taus(),
            "hits_equal": hits(a) == hits(b), "hit_rate": a.hit_rate}


def race(device: str, new_tokens: int) -> list[dict]:
    """Async with its tray pass overlapped (a side stream on CUDA, the worker thread on CPU) against
    async run serially (overlap=none), in bf16, for a batch of 1 and a ragged batch of 3. Both run
    the same ops on the same shapes in the same order, so the only thing that can differ is the
    scheduling: a hand-off that does not wait shows up here. (Not async against sync: their drafter
    passes lay the same keys out differently, which moves bf16 SDPA by an ulp and flips near-tie
    drafts; docs/design.md#losslessness, tests/unit/test_sdpa_gaps.py.)"""
    target, drafter = tiny_pair(device, torch.bfloat16, block_size=6)
    overlapped = "stream" if device.startswith("cuda") else "thread"
    runs = []
    for batch in (1, 3):
        prompts = random_prompts(batch, 256, seed=10 + batch)
        for method, C, F in [("async", 3, 2), ("async", 6, 3), ("async_tree", 8, 6)]:
            serial = async_run(target, drafter, prompts, "none", C, F, new_tokens, method)
            both = async_run(target, drafter, prompts, overlapped, C, F, new_tokens, method)
            runs.append({"method": method, "batch": batch, "C": C, "F": F, "overlap": overlapped,
                         **same_rounds(serial, both)})
    return runs


def race_tokens(device: str) -> int:
    return 24 if TOY or device == "cpu" else 48


@pytest.mark.parametrize("device", AND_CPU)
def test_race_overlapped_equals_serial_in_bf16(device, record_property):
    runs = race(device, race_tokens(device))
    record_property("result", runs)
    # hits must happen, or the trays the hand-off carries were never used and nothing was checked
    assert any((r["hit_rate"] or 0) > 0 for r in runs), runs
    assert all(r["tokens_equal"] and r["tau_equal"] and r["hits_equal"] for r in runs), runs


def break_stream_hand_off(monkeypatch):
    """CUDA: `lend` without its `wait_stream`, and the main stream held back (torch.cuda._sleep,
    ~tens of ms) right before it computes what the side stream reads next (positions, hit flags,
    the prepared block), so the side stream reads them before they are written."""
    from d3d.decoding import passes, schedules

    def lend_without_wait(self, stream, *tensors):
        for t in tensors:
            if stream is not None and t is not None and t.numel():
                t.record_stream(stream)  # memory stays safe; only the ordering is gone

    real_commit = schedules.Async.commit

    def late_commit(self, r, host, most):
        torch.cuda._sleep(100_000_000)  # on the main stream: what follows in this round lands late
        real_commit(self, r, host, most)

    monkeypatch.setattr(passes.Passes, "lend", lend_without_wait)
    monkeypatch.setattr(schedules.Async, "commit", late_commit)


def break_thread_hand_off(monkeypatch):
    """CPU: the worker builds its trays from the previous round's drafts and distributions, as a
    worker that read them before this round's were ready would."""
    from d3d.decoding import schedules

    real = schedules.Async.beside_verify

    def broken(self, r):
        draft, *rest = r.tray_inputs  # sent to the drafter before verification (Async.propose)
        prev, self._prev = getattr(self, "_prev", None), draft
        if self.passes.pool is None or prev is None or prev.tokens.shape != draft.tokens.shape:
            return real(self, r)
        stale = replace(r, tray_inputs=(replace(draft, tokens=prev.tokens, logits=prev.logits), *rest))
        real(self, stale)  # the worker's arguments are taken here
        r.trays = stale.trays

    monkeypatch.setattr(schedules.Async, "beside_verify", broken)


@pytest.mark.parametrize("device", AND_CPU)
def test_race_check_fails_on_a_broken_hand_off(device, monkeypatch, record_property):
    """The race check has teeth. Tokens stay right (verification decides them), so only τ and hits
    show the bug: token equality alone would not be a race check. The CUDA break was written
    before any GPU was lent: it has not run yet."""
    (break_stream_hand_off if device.startswith("cuda") else break_thread_hand_off)(monkeypatch)
    runs = race(device, 24)
    record_property("result", runs)
    assert not all(r["tau_equal"] and r["hits_equal"] for r in runs), runs
    if not device.startswith("cuda"):
        assert all(r["tokens_equal"] for r in runs), runs


class HostSyncs:
    """Counts what makes the host wait for the device in a decoding call, as torch functions
    (a TorchFunctionMode: it sees them on the CPU too, where nothing waits): `reads`, a device
    value read on the host (tolist, item, bool/int/float of a tensor, cpu, nonzero, ...), and
    `uploads`, a tensor made from non-empty host data with an explicit device (on CUDA a copy
    from pageable memory that waits too). On CUDA `warned` also counts what torch's sync debug
    mode reports, which sees the syncs made below the Python API as well."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
             "masked_select", "unique", "argwhere"}

    def __init__(self, cuda: bool):
        from torch.overrides import TorchFunctionMode

        self.cuda, self.reads, self.uploads, self.warned = cuda, [], 0, 0
        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in HostSyncs.READS:
                    counter.reads.append(name)
                elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and host_data(args[0]):
                    counter.uploads += 1
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        import warnings

        self.mode.__enter__()
        if self.cuda:
            self._caught = warnings.catch_warnings(record=True)
            self._warnings = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.warned = sum("synchroniz" in str(w.message) for w in self._warnings)
            self._caught.__exit__(*exc)
        self.mode.__exit__(*exc)


def host_data(x) -> bool:
    """Non-empty Python data (a list of ids): what torch.tensor copies from the host."""
    return not isinstance(x, torch.Tensor) and (not hasattr(x, "__len__") or len(x) > 0)


def retirements(res) -> int:
    """Rounds after which some rows left and others went on (the driver uploads their index)."""
    return sum(len(a.rows) > len(b.rows) for a, b in zip(res.rounds, res.rounds[1:]))


def row_uploads(res, device: str, backend: str) -> int:
    """On a CPU only, eager async drafts just the rows that missed, by an index made from a host
    list (Async._draft_misses); on CUDA or a static backend every row is drafted, with no upload."""
    if device.startswith("cuda") or backend != "eager":
        return 0
    live = [len(r.rows) for r in res.rounds]
    return sum(r.drafted_rows is not None and 0 < r.drafted_rows < n for r, n in zip(res.rounds, live))


def host_syncs(target, drafter, method: str, backend: str, prompts, new_tokens: int, device: str) -> dict:
    """Host syncs of a one-round call and of a long ragged call (HostSyncs), and what the loop
    allows: one read a round (the round's host transfer), one upload when rows retire. Setup
    (prefill, the first tensors) is what the one-round call has beyond its one round."""
    gen = generator(target, drafter, method, block_size=6, C=3, F=2, max_new_tokens=new_tokens, backend=backend)
    # warm-up (a static backend's first allocations) outside the count; then one of row 0's tokens
    # becomes the EOS, so that row stops early and the others go on (a retirement, as AR has none else)
    gen.eos = {gen.generate(prompts, max_new_tokens=new_tokens).token_ids[0][new_tokens // 3]}
    out = {}
    for name, n in (("one", 1), ("many", new_tokens)):
        with HostSyncs(device.startswith("cuda")) as count:
            res = gen.generate(prompts, max_new_tokens=n)
        out[name] = {"rounds": len(res.rounds), "retired": retirements(res), "reads": len(count.reads),
                     "read_kinds": sorted(set(count.reads)), "uploads": count.uploads, "warned": count.warned,
                     "row_uploads": row_uploads(res, device, backend)}
    one, many = out["one"], out["many"]
    out["reads_beyond_rounds"] = (many["reads"] - one["reads"]) - (many["rounds"] - one["rounds"])
    out["uploads_beyond_retirements"] = (many["uploads"] - one["uploads"]) - many["retired"] - many["row_uploads"]
    # CUDA: every sync the driver sees beyond one per round and one per retirement
    out["warned_beyond"] = (many["warned"] - one["warned"]) - (many["rounds"] - one["rounds"]) - many["retired"]
    return out


SYNC_CASES = [(m, b) for m, row in METHODS.items() for b in ("eager", "static") if b in row.backends]


@pytest.mark.parametrize("device", AND_CPU)
@pytest.mark.parametrize("method,backend", SYNC_CASES, ids=[f"{m}_{b}" for m, b in SYNC_CASES])
def test_race_host_syncs_per_round(device, method, backend, record_property):
    """Exactly one host read a round (the host transfer of accept counts, tokens, hits and the path:
    a `.tolist()`), one upload when rows retire, nothing else, for every method on the eager
    backend and the static one (the compiled backend's passes, uncompiled). On CUDA the sync debug
    mode's count must agree: one sync a round and one a retirement (a copy from pageable host
    memory waits). A sync added to a round fails here."""
    target, drafter = tiny_pair(device, torch.bfloat16 if device.startswith("cuda") else torch.float32, block_size=6)
    res = host_syncs(target, drafter, method, backend, random_prompts(3, 256, seed=13), race_tokens(device), device)
    record_property("result", res)
    many = res["many"]
    assert many["rounds"] > 2 and many["retired"] >= 1, res  # a ragged call: rounds and a retirement counted
    assert res["reads_beyond_rounds"] == 0 and set(many["read_kinds"]) == {"tolist"}, res
    assert res["uploads_beyond_retirements"] == 0, res
    if device.startswith("cuda"):
        assert res["warned_beyond"] == 0, res


# ---- async against sync: what survives each dtype (docs/design.md#losslessness) ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", AND_CPU)
def test_async_sync_agree_as_the_dtype_allows(device, dtype, record_property):
    """fp32: tokens and τ bit for bit (a hit serves exactly the block a synchronous draft would).
    bf16: tokens, a difference classified by the target's logit margin (in a ragged batch a
    different τ in one row changes the key layout the others' verify passes see): it fails only on
    a real divergence; τ is recorded, not required."""
    n = 24 if TOY or device == "cpu" else 48
    target, drafter = tiny_pair(device, dtype, block_size=6)
    res = {"runs": 0, "tokens_equal": 0, "tau_equal": 0, **new_tally()}
    for batch in (1, 3):
        prompts = random_prompts(batch, 256, seed=10 + batch)
        sync = generator(target, drafter, "sync", block_size=6, max_new_tokens=n).generate(prompts)
        for C, F in [(3, 2), (6, 3)]:
            got = async_run(target, drafter, prompts, "auto", C, F, n)
            res["runs"] += 1
            res["tokens_equal"] += got.token_ids == sync.token_ids
            res["tau_equal"] += got.taus() == sync.taus()
            for p, ref, toks in zip(prompts, sync.token_ids, got.token_ids):
                tally(res, target, p, ref, toks, batch=batch, C=C, F=F)
    record_property("result", res)
    if dtype == torch.float32:
        assert res["tokens_equal"] == res["tau_equal"] == res["runs"] == 4, res
    else:
        assert res["real"] == 0 and res["runs"] == 4, res["details"]


# ---- engine: what only the device's own kernels show ----

@on_device
def test_engine_every_method_runs_ragged_at_both_temperatures():
    target, drafter = tiny_pair(DEVICE, torch.bfloat16, block_size=6)
    prompts = random_prompts(3, 256, seed=2)
    for method in ("ar", "sync", "async"):
        for temperature in (0.0, 1.0):
            res = generator(target, drafter, method, block_size=6, C=3, F=2, temperature=temperature,
                            max_new_tokens=20).generate(prompts)
            assert [len(t) for t in res.token_ids] == [20, 20, 20]
            assert all(0 <= x < 256 for t in res.token_ids for x in t)


@on_device
@pytest.mark.skipif(not CUDA, reason="host issue time against the device's (CUDA); a CPU runs ops as issued")
def test_engine_tiny_eager_rounds_are_measured_host_bound(record_property):
    """The tiny pair's eager passes are a few µs of device work behind hundreds of host-issued ops:
    the host issues each round while the device waits, and GenerationResult.host_issue_share
    (what d3d.report flags from HOST_BOUND on) must say so."""
    from d3d.report import HOST_BOUND

    target, drafter = tiny_pair(DEVICE, torch.bfloat16, block_size=6)
    res = generator(target, drafter, "sync", block_size=6, max_new_tokens=24).generate(random_prompts(1, 256, seed=3))
    record_property("result", {"host_issue_share": res.host_issue_share, "rounds": len(res.rounds)})
    assert res.host_issue_share is not None and res.host_issue_share >= HOST_BOUND, res.host_issue_share


@on_device
@pytest.mark.skipif(not CUDA, reason="flex_attention's BlockMask path is the CUDA training path")
def test_engine_flex_block_mask_equals_dense_sdpa():
    """The training step under flex_attention (a BlockMask) gives the hidden states and the loss of
    SDPA with the dense bool mask."""
    from d3d.models.drafter_settings import DrafterSettings
    from d3d.objective import Example, ObjectiveConfig, pack
    from d3d.training import D3DTrainingStep

    _, model = tiny_pair(DEVICE, torch.float32, block_size=4)
    s = DrafterSettings.of(model)
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(4, 200, (150 - 7 * i,), generator=g).tolist(), 10) for i in range(2)]
    batch = pack(examples, ObjectiveConfig.shipped(s.block_size, anchors_per_seq=8), s.mask_token_id, 0, g)
    step = D3DTrainingStep(model, s.vocab_size, 1.0)
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        h_sdpa, (l_sdpa, _) = step.hidden(batch), step(batch)
        model.set_attn_implementation("flex_attention")
        h_flex, (l_flex, _) = step.hidden(batch), step(batch)
    real = batch.layout.block.to(DEVICE) != -2  # padding rows differ by design (flex skips empty tiles)
    torch.testing.assert_close(h_flex[real], h_sdpa[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(l_flex, l_sdpa, rtol=1e-4, atol=1e-4)


# ---- placement: a target placed by device_map, a drafter on a device of its own ----
# (d3d.eval's target.device_map and drafter.device). The loop keeps its state on the target's input
# device and copies what the drafter reads and returns explicitly each round (Passes.to_drafter /
# to_target). With one GPU (the lent H200) the target is loaded through from_pretrained's
# device_map={"": <device>} beside its drafter: the placement path and the transfer code run, the
# copies being no-ops on one device; with two or more GPUs the target's layers are split over two
# and the drafter sits on the second, so every copy is real.

PLACEMENT_CASES = [("ar", 1, 1, 0), ("sync", 4, 1, 0), ("async", 4, 3, 2)]


def placed_decoding(tmp_path, target_map: dict, drafter_device: str) -> dict:
    """The tiny pair, its target saved and reloaded with from_pretrained(device_map=target_map) and
    its drafter on `drafter_device`: every method's greedy tokens against transformers' generate on
    the placed target (no real divergence), and a sampled batch that runs to its length."""
    from d3d.models.target import input_device, load_model

    base, drafter = tiny_pair("cpu", torch.float32, block_size=6)
    base.save_pretrained(tmp_path / "target")
    target = load_model(str(tmp_path / "target"), "float32", device_map=target_map)
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, 0
    drafter = drafter.to(drafter_device)
    prompts = random_prompts(3, 256, seed=5)
    n = 12 if TOY else 24
    case = {**new_tally(), "target_devices": sorted({str(p.device) for p in target.parameters()}),
            "drafter_device": str(next(drafter.parameters()).device)}
    for method, B, C, F in PLACEMENT_CASES:
        res = generator(target, drafter, method, block_size=B, C=C, F=F, max_new_tokens=n).generate(prompts)
        for p, got in zip(prompts, res.token_ids):
            ref = target.generate(torch.tensor([p], device=input_device(target)), max_new_tokens=n, do_sample=False)
            tally(case, target, p, ref[0, len(p):].tolist(), got, method=method, batch=len(prompts))
        sampled = generator(target, drafter, method, block_size=B, C=C, F=F, max_new_tokens=n,
                            temperature=1.0).generate(prompts, seed=1)
        assert [len(t) for t in sampled.token_ids] == [n] * len(prompts), method
    return case


@on_device
def test_placement_target_by_device_map_beside_its_drafter(tmp_path, record_property):
    """One device: the target loaded with device_map={"": device}, the drafter on the same device."""
    case = placed_decoding(tmp_path, {"": DEVICE}, DEVICE)
    record_property("result", case)
    assert case["cases"] == 3 * len(PLACEMENT_CASES) and case["real"] == 0, case["details"]


TWO_GPU_MAPS = {  # the tiny target has 2 layers: one per GPU, the head on the second
    "target_split_drafter_on_cuda1": {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                                      "model.layers.1": 1, "model.norm": 1, "lm_head": 1},
    "target_on_cuda0_drafter_on_cuda1": {"": 0},
}


@on_device
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA devices (this machine has {torch.cuda.device_count()})")
@pytest.mark.parametrize("name", list(TWO_GPU_MAPS))
def test_placement_two_gpus_copy_between_target_and_drafter(tmp_path, name, record_property):
    case = placed_decoding(tmp_path, TWO_GPU_MAPS[name], "cuda:1")
    record_property("result", case)
    assert len({*case["target_devices"], case["drafter_device"]}) == 2  # two devices, copies between them
    assert case["cases"] == 3 * len(PLACEMENT_CASES) and case["real"] == 0, case["details"]


# ---- placement, the order of a round's copies: a drafter on a GPU of its own gets the tray pass's
# inputs before verification is queued (a copy between GPUs queued after it waits for it) ----

def copy_order(monkeypatch, target, drafter, method: str) -> list[dict]:
    """Each round of an async loop, in the order the host issued them: the copies to the drafter
    (Passes.to_drafter) and back (Passes.to_target), the target's verify pass and its accept, and
    the tray pass. Per round: whether the tray pass's inputs (the draft, pending tokens, positions)
    were sent before the verify pass, and whether its keys came back before the accept."""
    from d3d.decoding import passes, schedules
    from d3d.decoding.methods import METHODS

    log: list[tuple] = []

    def logged(name, real, returns=False):
        def wrapper(*args, **kw):
            out = real(*args, **kw)
            log.append((name, args[1:], out if returns else None))
            return out
        return wrapper

    drafts = METHODS[method].drafts
    monkeypatch.setattr(passes.Passes, "to_drafter", logged("send", passes.Passes.to_drafter, True))
    monkeypatch.setattr(passes.Passes, "to_target", logged("back", passes.Passes.to_target, True))
    monkeypatch.setattr(drafts, "verify", logged("verify", drafts.verify))
    monkeypatch.setattr(drafts, "accept", logged("accept", drafts.accept))
    monkeypatch.setattr(schedules.Async, "_tray_pass", logged("trays", schedules.Async._tray_pass, True))
    generator(target, drafter, method, block_size=6, C=3, F=2, overlap="none",
              max_new_tokens=16).generate(random_prompts(3, 256, seed=4))
    rounds, at = [], [i for i, (name, *_) in enumerate(log) if name == "verify"]
    for k, v in enumerate(at):
        end = at[k + 1] if k + 1 < len(at) else len(log)
        trays = next(i for i in range(v, end) if log[i][0] == "trays")
        accept = next(i for i in range(v, end) if log[i][0] == "accept")
        inputs = log[trays][1][1:]  # (draft, pending, next_pos); args[0] is the drafter's KV state
        keys = log[trays][2][0]

        def last_made(x, name):  # where the copy that handed over `x` was issued (None: never)
            return max((i for i, (n, _, out) in enumerate(log) if n == name and out is not None and
                        any(o is x for o in out) and i < end), default=None)

        sent = [last_made(x, "send") for x in inputs]
        back = next((i for i in range(trays, end) if log[i][0] == "back" and any(a is keys for a in log[i][1])), None)
        rounds.append({"inputs_sent_before_verify": all(i is not None and i < v for i in sent),
                       "keys_back_before_accept": back is not None and back < accept})
    return rounds


@pytest.mark.parametrize("method", [m for m, row in METHODS.items() if row.trays])
def test_placement_tray_inputs_cross_before_verification(method, monkeypatch, record_property):
    """On the CPU (the copies are no-ops there, the order of their calls is what the host issues on
    two GPUs): in every round the tray pass's inputs go to the drafter before verification is
    queued, and its keys come back before the accept (the target's stream waits for them only in
    settle). Seen failing on the order before: sent in beside_verify, after verification."""
    target, drafter = tiny_pair("cpu", torch.float32, block_size=6)
    rounds = copy_order(monkeypatch, target, drafter, method)
    record_property("result", rounds)
    assert len(rounds) > 2 and all(r["inputs_sent_before_verify"] and r["keys_back_before_accept"] for r in rounds), \
        rounds


@on_device
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2,
                    reason=f"needs 2 CUDA devices (this machine has {torch.cuda.device_count()})")
@pytest.mark.parametrize("method", [m for m, row in METHODS.items() if row.trays])
def test_placement_two_gpus_trays_do_not_wait_for_verification(method, monkeypatch, record_property):
    """The drafter on cuda:1, the target on cuda:0 held back ~50 ms (torch.cuda._sleep) right before
    each verify pass: the tray pass (a tiny model: well under 50 ms) must end on cuda:1 while
    cuda:0 still sleeps, in most rounds. A copy to the drafter queued behind verification, or one
    back that holds cuda:1 until verification ends, makes it end after."""
    from d3d.decoding import schedules
    from d3d.decoding.methods import METHODS

    drafts = METHODS[method].drafts
    real_verify, real_beside = drafts.verify, schedules.Async.beside_verify
    seen = []

    def late_verify(self, passes, tgt, r):
        torch.cuda._sleep(50_000_000)  # on cuda:0's stream, before the verify pass
        out = real_verify(self, passes, tgt, r)
        r.verified = torch.cuda.Event()
        r.verified.record(torch.cuda.current_stream(torch.device("cuda:0")))
        return out

    def beside(self, r):
        real_beside(self, r)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(torch.device("cuda:1")))
        while not (done.query() or r.verified.query()):
            pass
        seen.append(done.query() and not r.verified.query())

    monkeypatch.setattr(drafts, "verify", late_verify)
    monkeypatch.setattr(schedules.Async, "beside_verify", beside)
    target, drafter = tiny_pair("cuda:0", torch.float32, block_size=6)
    drafter = drafter.to("cuda:1")
    generator(target, drafter, method, block_size=6, C=3, F=2, max_new_tokens=16).generate(random_prompts(3, 256, seed=4))
    record_property("result", {"rounds": len(seen), "trays_first": sum(seen)})
    assert len(seen) > 2 and sum(seen) >= 0.8 * len(seen), seen


# ---- compiled_equal: decode.backend=compiled gives the eager loop's greedy tokens ----

# every method of the table through the ordinary entry with decode.backend=compiled (trees: their
# defaults' 15 nodes and 23 trays; C and F are async's)
COMPILED_CASES = [("ar", 1, 1, 0), *[(m, 4, 3, 2) for m, row in METHODS.items() if row.needs_drafter]]


def compiled_cases(toy: bool) -> list[tuple]:
    """Ragged only at full size: rows retiring is where static buffers change shape; batch 1 runs
    the same code (a static pass always takes the mask), and every graph costs a cold compile."""
    return [(m, B, C, F, 1 if toy else 3) for m, B, C, F in (COMPILED_CASES[:1] if toy else COMPILED_CASES)]


def compiled_against_eager(device: str, method: str, B: int, C: int, F: int, batch: int) -> dict:
    target, drafter = tiny_pair(device, torch.float32, block_size=6)
    prompts = random_prompts(batch, 256, seed=20 + batch)
    runs = {backend: generator(target, drafter, method, block_size=B, C=C, F=F, max_new_tokens=24,
                               backend=backend).generate(prompts) for backend in ("eager", "compiled")}
    case = new_tally()
    for p, ref, got in zip(prompts, runs["eager"].token_ids, runs["compiled"].token_ids):
        tally(case, target, p, ref, got, method=method, batch=batch)
    return case


@on_device
@pytest.mark.parametrize("method,B,C,F,batch", compiled_cases(TOY), ids=[c[0] for c in compiled_cases(TOY)])
def test_compiled_equals_eager(method, B, C, F, batch, record_property):
    case = compiled_against_eager(DEVICE, method, B, C, F, batch)
    record_property("result", case)
    assert case["cases"] == batch and case["real"] == 0, case["details"]


@on_device
@pytest.mark.skipif(not CUDA, reason="the side stream's CUDA graphs (kv.SideStreamGraphs)")
def test_compiled_async_trays_replay_graphs_of_their_own_pool(record_property):
    """decode.backend=compiled, async with its tray pass on the side stream: after the warm-up
    (run twice, as d3d.eval does) every drafter pass on that stream is a replay of a graph captured
    in its own pool (the draft and the tray pass: two shapes at least), the timed call captures and
    compiles nothing, and its rounds equal those of async run serially on the same backend (the
    main stream's graph trees), tokens, τ and hits bit for bit in bf16."""
    from torch._dynamo.utils import counters

    target, drafter = tiny_pair(DEVICE, torch.bfloat16, block_size=6)
    prompt = random_prompts(1, 256, seed=21)[0]
    runs, seen = {}, {}
    for overlap in ("none", "stream"):
        gen = generator(target, drafter, "async", block_size=6, C=3, F=2, overlap=overlap, backend="compiled",
                        max_new_tokens=24)
        for _ in range(2):
            gen.warm_up(1, len(prompt) + 24, prompt)
        graphs = gen.passes.side_graphs
        before = (graphs.captures if graphs else None, counters["stats"]["unique_graphs"])
        runs[overlap] = gen.generate([prompt], max_new_tokens=24)
        seen[overlap] = {"side_graphs": graphs is not None, "captured": before[0],
                         "captured_in_timed": graphs.captures - before[0] if graphs else None,
                         "compiled_in_timed": counters["stats"]["unique_graphs"] - before[1]}
    same = same_rounds(runs["none"], runs["stream"])
    record_property("result", {**seen, **same})
    assert not seen["none"]["side_graphs"] and seen["stream"]["side_graphs"], seen
    assert seen["stream"]["captured"] >= 2 and seen["stream"]["captured_in_timed"] == 0, seen
    assert seen["stream"]["compiled_in_timed"] == 0 == seen["none"]["compiled_in_timed"], seen
    assert same["tokens_equal"] and same["tau_equal"] and same["hits_equal"], same
