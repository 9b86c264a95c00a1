"""The small helpers every job uses to compose and read the Hydra config tree (where the tree lives:
d3d.configdir), and the resume check they share.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import sys
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from d3d.configdir import config_dir
from d3d.errors import ConfigError, UserError
from d3d.utils.io import resolve_path


# Shown by the Hydra jobs as one `error: ...` line with exit status 2 (HYDRA_FULL_ERROR=1 or
# D3D_VERBOSE=1 keeps the traceback). Other exceptions are bugs and keep theirs.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, UserError)


def verbose() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in ("HYDRA_FULL_ERROR", "D3D_VERBOSE"))


def benchmark_names() -> list[str]:
    """Every benchmark shipped under conf/benchmark/, in file-name order: each file with `specs`
    (suite files such as all.yaml only compose others). The training prompt sets exclude all of
    them (`exclude_eval: ${d3d.benchmarks:}` in conf/data/), so a new benchmark file keeps its items
    out of the training data with no other edit."""
    names: list[str] = []
    for path in sorted((config_dir() / "benchmark").glob("*.yaml")):
        node = OmegaConf.load(path)
        names += list(node.specs) if "specs" in node else []
    return names


def slug(value: object, limit: int = 120) -> str:
    """A folder-safe name for a value. A multirun names each job's folder after its overrides, and a
    long sweep's overrides pass the file systems' 255-byte name limit: past `limit` the name keeps its
    head and a hash of the whole, so two arms never share a folder."""
    name = str(value).replace("/", "_").replace("=", "-").replace(" ", "")
    if len(name.encode()) <= limit:
        return name
    import hashlib

    head = name.encode()[: limit - 13].decode(errors="ignore")
    return f"{head}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def checkpoint_settings(checkpoint: str | None) -> dict:
    """The settings a trained drafter was saved with: its config.json's `d3d` section (block_size,
    block_attention, draft_vocab, mask_token_id, ...; written by d3d.train and d3d.prune), causal
    blocks for a PARD-format folder (d3d.utils.checkpoints.saved_defaults), or {} with no checkpoint or
    a folder that holds neither (refused, with its fix, where it loads). Every read of a checkpoint's
    settings at config time goes through here, torch-free and before any model loads: they are the
    defaults of every job that loads the drafter (`${d3d.from_checkpoint:...}` in conf/drafter/), and
    d3d.settings.check_checkpoint_settings refuses a value set against them."""
    if not checkpoint:
        return {}
    config = resolve_path(checkpoint) / "config.json"
    try:
        stat = config.stat()
    except OSError:
        return {}
    return copy.deepcopy(_settings_of(str(config.parent), stat.st_mtime_ns, stat.st_size))  # the caller's own


@functools.lru_cache(maxsize=64)
def _settings_of(folder: str, mtime_ns: int, size: int) -> dict:
    """One parse of a folder's settings per version of its config.json (OmegaConf resolves each
    ${d3d.from_checkpoint:...} key every time it is read, and a composed config reads several): the
    file's mtime and size are in the key, so a checkpoint saved again is read again."""
    from d3d.utils.checkpoints import saved_defaults

    return dict(saved_defaults(folder) or {})


def from_checkpoint(checkpoint: str | None, key: str, default: object) -> object:
    """`key` of the checkpoint's saved settings (checkpoint_settings), else `default`, the value a
    drafter still to be built or trained gets. conf/drafter/'s default of each key a drafter saves, so
    a trained drafter decodes, prunes and exports as it was trained unless a value is set."""
    return checkpoint_settings(checkpoint).get(key, default)


def _register_resolvers() -> None:
    # Resolved lazily inside configs: ${d3d.slug:...} turns a value into a folder-safe name;
    # ${d3d.benchmarks:} is the list of every shipped benchmark (benchmark_names);
    # ${d3d.from_checkpoint:<checkpoint>,<key>,<default>} a trained drafter's saved setting (from_checkpoint);
    # ${d3d.or:<value>,<word>} the value, or the word where it is null (a run's name: c${d3d.or:${.C},auto}).
    if not OmegaConf.has_resolver("d3d.or"):
        OmegaConf.register_new_resolver("d3d.or", lambda value, word: word if value is None else value)
    if not OmegaConf.has_resolver("d3d.from_checkpoint"):
        OmegaConf.register_new_resolver("d3d.from_checkpoint", from_checkpoint)
    if not OmegaConf.has_resolver("d3d.slug"):
        OmegaConf.register_new_resolver("d3d.slug", slug)
    if not OmegaConf.has_resolver("d3d.benchmarks"):
        OmegaConf.register_new_resolver("d3d.benchmarks", benchmark_names)


_register_resolvers()


def hydra_job(config_name: str) -> Callable:
    """Decorator: `@hydra_job("generate")` == `@hydra.main` on the packaged config tree."""
    import hydra

    def wrap(fn: Callable[[DictConfig], object]) -> Callable:
        @functools.wraps(fn)
        def guarded(cfg: DictConfig):
            try:
                return fn(cfg)
            except USER_ERRORS as err:
                if verbose():
                    raise
                # what went wrong, where and the fix are in the message; the traceback would bury it
                print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
                sys.exit(2)

        @functools.wraps(fn)
        def main():
            return hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(guarded)()

        return main

    return wrap


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose a root config outside a Hydra app (tests, notebooks, scripts)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


# A value of only these characters, with a `/` (so not a number, a bool or null), is a path Hydra's
# override grammar reads as it is: left bare, so printed commands stay readable.
_BARE_PATH = re.compile(r"[A-Za-z0-9_/.+%@-]*/[A-Za-z0-9_/.+%@-]*")


def quoted(value: str, key: str = "the path") -> str:
    """`value` as a value of Hydra's override grammar that the config reads back as exactly `value`: a
    path may hold `,` `=` quotes, brackets, spaces or `${` that the grammar would otherwise take as a
    sweep, a key, a list or an interpolation. Two layers read it: OmegaConf, where `${` is escaped as
    `\\${` (and backslashes right before it doubled), then Hydra's quoted value, where a backslash is
    literal except before a quote or at the end (there it is doubled) and a quote is escaped. The
    result is read back once to prove it; a value that does not come back is one line naming `key`."""
    if _BARE_PATH.fullmatch(value):
        return value
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)  # OmegaConf's layer
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)  # Hydra's layer
    text = "'" + text.replace("'", "\\'") + "'"
    if _read_back(text) != value:
        raise ConfigError(f"{key}={value!r} cannot be written as a Hydra override (it does not read back as "
                          f"itself). Fix: use a folder whose path holds no control characters.")
    return text


def _read_back(text: str) -> object:
    """What a job's config holds for an override value `text` (None where the grammar refuses it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.create({"k": OverridesParser.create().parse_override(f"k={text}").value()}).k
    except (HydraException, OmegaConfBaseException):
        return None


def literal(node: object) -> object:
    """Plain config data with every `${` in its strings escaped: a resolved value (a root from D3D_ROOT
    holding `${`) stays the text it is when merged into a typed config, not an interpolation again."""
    if isinstance(node, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", node)
    if isinstance(node, dict):
        return {k: literal(v) for k, v in node.items()}
    if isinstance(node, list):
        return [literal(v) for v in node]
    return node


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config as plain Python (for result files)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]


def differing_keys(old: dict, new: dict, prefix: str = "", grows: frozenset[str] = frozenset()) -> list[str]:
    """Dotted keys whose values differ between two nested settings dicts. Keys only one side has
    are skipped: a result written before a key existed still resumes. A key in `grows` holds a set
    (a list whose order means nothing) that may gain members but not lose them: it differs only
    when something the old run held is gone, and says what."""
    out = []
    for k in sorted(set(old) & set(new)):
        a, b, key = old[k], new[k], f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differing_keys(a, b, f"{key}.", grows)
        elif key in grows and isinstance(a, list) and isinstance(b, list):
            lost = sorted(set(a) - set(b), key=str)
            if lost:
                out.append(f"{key} (without {' '.join(map(str, lost))})")
        elif a != b:
            out.append(key)
    return out


def refuse_mixed_run(folder, old_key: dict | None, new_key: dict, made: str, fix: str,
                     also: list[str] | None = None, grows: frozenset[str] = frozenset()) -> None:
    """The one resume check of every job: a folder resumes only work made with the same settings,
    since a run resumed with others would be half one experiment and half another. `old_key` None
    (a folder from before resume keys existed) resumes as it did; `also` adds differences the
    keys cannot show; `grows` names set-valued keys that may gain members (differing_keys). The
    message names each differing key and the fix."""
    differ = differing_keys(old_key or {}, new_key, grows=grows) + list(also or [])
    if differ:
        raise ConfigError(f"{folder} {made} with other settings ({', '.join(differ)} differ); resuming "
                          f"would mix two runs. Fix: {fix}")


def stage_overrides(config_name: str, overrides: list[str]) -> list[str]:
    """The overrides that apply to one root config (`prune.num_layers=2` does not go to generate);
    the pipeline and the sweeps pass one override list to several jobs. An override goes where its
    top-level key is one of the root's own and, for a dotted key, where the root has that key:
    `train.max_steps` goes to d3d.train, not to d3d.prune, which composes only the training step's
    train.* keys (conf/training/default.yaml)."""
    base = compose(config_name)  # the root's own sections (experiment overlays may add other roots' keys)
    experiments = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "experiment"]
    with_experiment = compose(config_name, experiments) if experiments else base  # an overlay may add keys
    missing = object()
    keep = []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        top = key.split(".", 1)[0]
        if top in ("experiment", "hydra"):
            keep.append(o)
        elif top in base and (o.startswith(("+", "~")) or "." not in key or OmegaConf.select(
                with_experiment, key, default=missing, throw_on_resolution_failure=False) is not missing):
            keep.append(o)
    return keep
