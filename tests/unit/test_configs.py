"""Every shipped config composes, every experiment overlays every job, bad keys fail clearly."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from d3d.configdir import config_dir
from d3d.data.benchmarks import iter_specs
from tests.conftest import compose

ROOTS = ["generate", "train", "prune", "eval", "export"]
GROUPS = {  # group -> root configs that use it
    "target": ROOTS, "drafter": ["train", "prune", "eval", "export"], "data": ["generate", "train", "prune", "export"],
    "benchmark": ["eval"], "decode": ["eval"],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def test_config_tree_is_complete():
    for group in ["target", "drafter", "data", "benchmark", "decode", "experiment", "paths", "hydra"]:
        assert options(group), f"conf/{group}/ is empty"
    assert set(options("target")) >= {"smollm2_135m", "qwen25_coder_05b", "qwen25_coder_15b", "qwen3_8b", "qwen3_32b"}
    assert set(options("benchmark")) >= {"gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp",
                                         "livecodebench", "mt_bench", "alpaca", "all"}
    assert set(options("experiment")) >= {"cpu_default", "smoke", "qwen3_8b", "qwen3_32b", "cpu_qwen"}
    assert set(options("decode")) >= {"ar", "sync", "async"}  # at least: a new method adds its file


@pytest.mark.parametrize("root", ROOTS)
def test_root_composes_and_resolves(root, tmp_path):
    cfg = compose(root, tmp_path=tmp_path)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert plain["task_name"] == root
    assert plain["target"]["name"] == "smollm2_135m"


@pytest.mark.parametrize("group,option,root", [
    (g, o, r) for g, roots in GROUPS.items() for o in options(g) for r in roots[:1]
])
def test_every_group_option_composes(group, option, root, tmp_path):
    cfg = compose(root, [f"{group}={option}"], tmp_path)
    OmegaConf.to_container(cfg[group], resolve=True)


@pytest.mark.parametrize("experiment", options("experiment"))
@pytest.mark.parametrize("root", ROOTS)
def test_every_experiment_overlays_every_job(root, experiment, tmp_path):
    cfg = compose(root, [f"+experiment={experiment}"], tmp_path)
    OmegaConf.to_container(cfg, resolve=True)


def test_benchmark_all_is_the_seven_of_the_design():
    cfg = compose("eval", ["benchmark=all"])
    suite = [spec.name for spec in iter_specs(cfg.benchmark)]  # all.yaml names its members once, in defaults
    assert suite == ["gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench"]
    assert {name: cfg.benchmark.specs[name].n for name in suite} == {
        "gsm8k": 128, "math500": 128, "aime25": 30, "humaneval": 164, "mbpp": 128, "livecodebench": 128, "mt_bench": 80}


def test_experiments_change_only_deltas():
    base = OmegaConf.to_container(compose("generate"), resolve=False)
    smoke = OmegaConf.to_container(compose("generate", ["+experiment=smoke"]), resolve=False)
    assert smoke["target"]["name"] == "tiny_random" and base["target"]["name"] == "smollm2_135m"
    assert smoke["paths"] == base["paths"]  # untouched groups stay as they were


def test_unknown_key_fails_with_a_clear_message():
    with pytest.raises(Exception) as err:
        compose("generate", ["generate.batchsize=4"])
    assert "batchsize" in str(err.value)


def test_async_budget_name_tracks_keys():
    cfg = compose("eval", ["decode=async", "decode.C=8", "decode.F=1"])
    assert cfg.decode.name == "async_b16_c8_f1"


# The typed boundary of each recipe (d3d.settings.bind_config -> d3d.specs): every key of every group a
# root composes is a field some code reads (a key no code reads is dead: changing it changes nothing, yet
# resume keys may hold it: binding refuses it), and every field without a default is in the YAML (a
# missing one fails binding). The sections each root composes (experiment overlays may add other
# recipes' sections on top): a group a recipe never reads (generate has no drafter) is not composed.
SECTIONS = {
    "generate": {"paths", "target", "data", "task_name", "run_name", "seed", "generate"},
    "train": {"paths", "target", "drafter", "data", "task_name", "run_name", "seed", "train", "logger", "dist"},
    "prune": {"paths", "target", "drafter", "data", "task_name", "run_name", "seed", "train", "prune", "dist"},
    "eval": {"paths", "target", "drafter", "data", "benchmark", "decode", "methods", "task_name", "run_name",
             "seed", "eval", "dist"},
    "export": {"paths", "target", "drafter", "data", "task_name", "run_name", "seed", "train", "export"},
}
# overrides a group option needs before it binds (data=local reads a file nobody ships: `???` in the YAML)
NEEDS = {("data", "local"): ["data.local_file=prompts.jsonl"]}


def restated_defaults(typed, raw, where: str) -> list[str]:
    """Dotted keys the YAML (`raw`, the resolved config) sets to the very value the dataclass
    default (`typed`'s field) holds: a default with two homes, which drift apart (ObjectiveKnobs once
    said 32 anchors where the YAML said 16)."""
    import dataclasses

    out = []
    if dataclasses.is_dataclass(typed) and isinstance(raw, dict):
        for f in dataclasses.fields(typed):
            if f.name not in raw:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            if default is not dataclasses.MISSING and raw[f.name] == default:
                out.append(f"{where}{f.name}")
            out += restated_defaults(getattr(typed, f.name), raw[f.name], f"{where}{f.name}.")
    elif isinstance(typed, dict) and isinstance(raw, dict):
        for k in typed.keys() & raw.keys():
            out += restated_defaults(typed[k], raw[k], f"{where}{k}.")
    return out


def bind_and_check(root: str, overrides: list[str], tmp_path):
    """Bind `root` as its run_* does and check that no default is restated by the YAML."""
    from d3d.settings import bind_config

    cfg = compose(root, overrides, tmp_path)
    typed = bind_config(cfg, root)
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert restated_defaults(typed, raw, "") == [], f"{root} {overrides}: defaults restated by the YAML"
    return cfg, typed


@pytest.mark.parametrize("experiment", [None, *options("experiment")])
@pytest.mark.parametrize("root", ROOTS)
def test_every_group_binds_for_every_root_and_experiment(root, experiment, tmp_path):
    cfg, typed = bind_and_check(root, [f"+experiment={experiment}"] if experiment else [], tmp_path)
    if experiment is None:
        assert set(cfg) == SECTIONS[root]


@pytest.mark.parametrize("group,option,root", [
    (g, o, r) for g, roots in GROUPS.items() if g != "decode" for o in options(g) for r in roots
])
def test_every_group_option_binds_for_every_root_using_it(group, option, root, tmp_path):
    bind_and_check(root, [f"{group}={option}", *NEEDS.get((group, option), [])], tmp_path)


@pytest.mark.parametrize("key,where", [
    ("target.dtyp", "TargetSpec"), ("target.tiny.hiden_size", "TinySpec"), ("drafter.blocksize", "DrafterSpec"),
    ("data.limt", "PromptSetSpec"), ("paths.cache", "PathsSpec"), ("logger.projct", "LoggerSpec"),
    ("train.anchors", "TrainSettings"),
])
def test_a_misspelt_key_in_any_group_fails_with_its_dotted_name(key, where, tmp_path):
    from d3d.errors import ConfigError
    from d3d.settings import bind_config

    overrides = ["target=tiny_random"] if ".tiny." in key else []
    with pytest.raises(ConfigError, match=rf"^{key}: Key '{key.rsplit('.', 1)[1]}' not in '{where}'"):
        bind_config(compose("train", [*overrides, f"+{key}=1"], tmp_path), "train")
    with pytest.raises(ConfigError, match=r"^benchmark\.specs\.gsm8k\.nn: Key 'nn' not in 'BenchmarkSpec'"):
        bind_config(compose("eval", ["+benchmark.specs.gsm8k.nn=1"], tmp_path), "eval")
    with pytest.raises(ConfigError, match=r"^sede: no d3d recipe has this top-level key"):
        bind_config(compose("train", ["+sede=1"], tmp_path), "train")


def test_a_restated_default_is_found(tmp_path):
    """The check above can fail: a default equal to the YAML's value is reported by its key."""
    from d3d.settings import bind_config
    from d3d.specs import HubSource

    cfg = compose("eval", ["benchmark=gsm8k", "+benchmark.specs.gsm8k.hub.where=null"], tmp_path)
    typed, raw = bind_config(cfg, "eval"), OmegaConf.to_container(cfg, resolve=True)
    assert HubSource.__dataclass_fields__["where"].default is None
    assert restated_defaults(typed, raw, "") == ["benchmark.specs.gsm8k.hub.where"]


def test_drafter_model_attention_reaches_the_drafters_load(tmp_path):
    """drafter.model.attn_implementation is read (it was dead: no config could select the drafter's
    attention): an init=pretrained drafter whose model asks for eager loads with eager."""
    from d3d.models.drafter import build_drafter
    from d3d.settings import bind_config

    def override(value) -> str:  # Hydra's override grammar for a nested value
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{override(v)}" for k, v in value.items()) + "}"
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    target = OmegaConf.to_container(compose("train", ["+experiment=smoke"]).target, resolve=True)
    target.pop("device_map")  # the target's placement: a drafter's own device is drafter.device
    for attn in ("eager", "sdpa"):
        model = override({**target, "attn_implementation": attn})
        cfg = bind_config(compose("train", ["+experiment=smoke", "drafter.init=pretrained", f"drafter.model={model}"],
                                  tmp_path), "train")
        drafter, _ = build_drafter(cfg.drafter, cfg.target, cfg.paths.cache_dir, dtype="float32")
        assert drafter.config._attn_implementation == attn


@pytest.mark.parametrize("experiment", [None, *options("experiment")])
def test_every_decode_key_is_one_its_method_reads(experiment, tmp_path):
    """conf/decode/<name>.yaml holds exactly the keys its method reads (d3d.settings.decode_keys) and
    its name: no tray budget in sync or ar, no max_new_tokens (eval.max_new_tokens is the one read)."""
    from d3d.settings import decode_keys

    cfg = compose("eval", [f"+experiment={experiment}"] if experiment else [], tmp_path)
    for where, node in [("decode", cfg.decode), *((f"methods.{n}", cfg.methods[n]) for n in cfg.methods)]:
        assert set(node) - {"name"} == set(decode_keys(node.method)), where


def test_an_unread_key_and_a_wrong_type_fail_at_the_boundary(tmp_path):
    from d3d.errors import ConfigError
    from d3d.settings import bind_config

    with pytest.raises(ConfigError, match=r"eval\.max_new_token: Key 'max_new_token' not in 'EvalSettings'"):
        bind_config(compose("eval", ["+eval.max_new_token=8"], tmp_path), "eval")
    with pytest.raises(ConfigError, match=r"generate\.batch_size: Value 'many'"):
        bind_config(compose("generate", ["generate.batch_size=many"], tmp_path), "generate")


def test_an_unknown_key_fails_in_prunes_train_and_in_a_decode_file(tmp_path):
    """prune skips d3d.train's own keys an overlay put in `train` by name, nothing else; a decode file's
    key that its method does not read fails instead of being dropped: a misspelling, or a field of
    DecodeConfig another method reads (sync has no tray budget)."""
    from d3d.errors import ConfigError
    from d3d.settings import bind_config, method_configs

    assert bind_config(compose("prune", ["+train.max_steps=8"], tmp_path), "prune").train.lr == 3e-5
    with pytest.raises(ConfigError, match=r"train\.lrr: Key 'lrr' not in 'StepSettings'"):
        bind_config(compose("prune", ["+train.lrr=1"], tmp_path), "prune")
    for key in ("Cc", "C"):
        cfg = compose("eval", [f"+methods.sync.{key}=3"], tmp_path)
        with pytest.raises(ConfigError, match=rf"methods\.sync\.{key}: method sync does not read it \(it reads method,"):
            method_configs(cfg, bind_config(cfg, "eval").eval)


def test_every_decode_file_is_a_method_eval_can_name(tmp_path):
    """eval.methods picks from `methods`, which Hydra composes from conf/decode/ (conf/eval.yaml's
    defaults): a decode file without its defaults line would be a method no run can name."""
    from d3d.settings import bind_decode

    cfg = compose("eval", [], tmp_path)
    assert set(cfg.methods) == set(options("decode"))
    for name in cfg.methods:
        assert bind_decode(cfg.methods[name], f"methods.{name}").method == cfg.methods[name].method


# The list every training prompt set typed by hand before it was derived (resume keys written then hold it).
HAND_TYPED_EXCLUDE_EVAL = ["gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench",
                           "alpaca"]


@pytest.mark.parametrize("data", options("data"))
def test_training_prompts_exclude_every_benchmark_file(data, tmp_path):
    """exclude_eval is derived from conf/benchmark/: every spec there, suites (all, all_plus) aside."""
    shipped = {name for option in options("benchmark")
               for name in OmegaConf.load(config_dir() / "benchmark" / f"{option}.yaml").get("specs") or []}
    assert shipped >= set(HAND_TYPED_EXCLUDE_EVAL)  # at least: a new benchmark file adds to it
    excluded = compose("generate", [f"data={data}"], tmp_path).data.exclude_eval
    assert list(excluded) == sorted(shipped)
    # an explicit list still wins
    assert list(compose("generate", [f"data={data}", "data.exclude_eval=[gsm8k]"], tmp_path).data.exclude_eval) == ["gsm8k"]


def test_a_new_benchmark_file_is_excluded_from_training_data(tmp_path, monkeypatch):
    from tests.conftest import conf_with_benchmark

    conf_with_benchmark(tmp_path, monkeypatch, "gsm_hard")
    assert "gsm_hard" in compose("train", [], tmp_path).data.exclude_eval


def test_the_derived_exclusion_keeps_resume_keys_of_the_hand_typed_list(tmp_path):
    """exclude_eval is a set in train's resume key (d3d.training.GROWING_TRAIN_KEYS): a checkpoint
    written with the hand-typed list (another order) or with fewer names resumes; one written with a
    name the run no longer excludes does not, and the message names it."""
    import copy

    from d3d.config import differing_keys
    from d3d.settings import bind_config
    from d3d.training import GROWING_TRAIN_KEYS, train_resume_key

    key = train_resume_key(bind_config(compose("train", [], tmp_path), "train"))
    old = copy.deepcopy(key)
    old["data"]["exclude_eval"] = HAND_TYPED_EXCLUDE_EVAL
    assert differing_keys(old, key, grows=GROWING_TRAIN_KEYS) == []
    old["data"]["exclude_eval"] = HAND_TYPED_EXCLUDE_EVAL[:-1]  # a benchmark added since: resumes
    assert differing_keys(old, key, grows=GROWING_TRAIN_KEYS) == []
    old["data"]["exclude_eval"] = [*HAND_TYPED_EXCLUDE_EVAL, "gsm_hard"]  # one it would now train on
    assert differing_keys(old, key, grows=GROWING_TRAIN_KEYS) == ["data.exclude_eval (without gsm_hard)"]


@pytest.mark.parametrize("experiment", [None, "cpu_qwen", "qwen3_8b"])
def test_resume_keys_written_from_the_raw_config_still_match(experiment, tmp_path):
    """Folders made before the groups were typed hold keys built from the resolved YAML (no None
    for the optional fields a file leaves out): the typed keys add such fields, which differing_keys
    skips (one side only), so those folders still resume. Train's key, and eval's benchmark specs."""
    from dataclasses import asdict

    from d3d.config import differing_keys, to_plain
    from d3d.settings import bind_config
    from d3d.training import GROWING_TRAIN_KEYS, RESUMABLE_TRAIN_KEYS, train_resume_key

    cfg = compose("train", [f"+experiment={experiment}"] if experiment else [], tmp_path)
    key = train_resume_key(bind_config(cfg, "train"))
    plain = to_plain(cfg)  # the key as train_resume_key built it before (its precision aside)
    old = {"target": {k: v for k, v in plain["target"].items() if k not in ("device", "dtype", "attn_implementation")},
           "drafter": plain["drafter"], "data": plain["data"], "seed": plain["seed"], "precision": key["precision"],
           "train": {k: v for k, v in plain["train"].items() if k not in RESUMABLE_TRAIN_KEYS}}
    del old["drafter"]["seed"]  # conf/drafter/ gained `seed` (it was a second default in the code)
    assert differing_keys(old, key, grows=GROWING_TRAIN_KEYS) == []
    ev = compose("eval", ["benchmark=all_plus"], tmp_path)  # eval's key holds asdict of each spec
    typed = {s.name: asdict(s) for s in bind_config(ev, "eval").benchmark.specs.values()}
    assert differing_keys(to_plain(ev)["benchmark"]["specs"], typed) == []


def test_a_long_multirun_folder_name_stays_within_the_file_system_limit():
    """A sweep's folder is named after its overrides; past 255 bytes a job would crash on mkdir."""
    from d3d.config import slug

    many = ",".join(f"train.some_long_key_{i}=/scratch/checkpoints/run_{i}/final" for i in range(12))
    a, b = slug(many), slug(many.replace("run_11", "run_12"))
    assert len(a.encode()) <= 120 and a != b  # two arms never share a folder
    assert slug("+experiment=smoke") == "+experiment-smoke"  # short names as before
