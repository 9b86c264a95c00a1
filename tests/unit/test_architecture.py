"""The house rules (docs/design.md#recipes-and-components, #floors): recipes stand side by side on one
floor and import only components; what two recipes share is a component below them. Every unit
stands on a floor and imports from no floor above its own, and no imports go round a circle.

Parsed with `ast`, lazy imports inside functions included, so a rule broken in a function body
fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "d3d"

# The job entry points (`python -m d3d.<name>`). d3d.report is a component with a CLI of its own:
# eval writes its report through it.
RECIPES = {"d3d.generate", "d3d.train", "d3d.prune", "d3d.eval", "d3d.export", "d3d.bench", "d3d.pipeline"}
# d3d.pipeline is the launcher of the other four: it may call each one's `run_<stage>` entry
# point, and nothing else of theirs (it does not reach into their internals).
LAUNCHER = "d3d.pipeline"
STAGE_ENTRY = {"d3d.generate": "run_generate", "d3d.train": "run_train", "d3d.prune": "run_prune",
               "d3d.eval": "run_eval"}


def module_name(path: Path, src: Path) -> str:
    if path.is_relative_to(src):
        return ".".join(("d3d", *path.relative_to(src).with_suffix("").parts)).removesuffix(".__init__")
    return f"scripts.{path.stem}"


def unit(module: str) -> str:
    """What may share private names: a subpackage (d3d.decoding's modules share helpers), or one
    top-level module (d3d.prune and d3d.report are strangers)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every import in the file, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def violations(files: list[Path], root: Path = ROOT, src: Path = SRC) -> list[str]:
    bad = []
    for path in files:
        me = module_name(path, src)
        for module, names, line in imports(path):
            if module == "d3d":  # `from d3d import train` names a recipe as an attribute
                module, names = next(((f"d3d.{n}", []) for n in names if f"d3d.{n}" in RECIPES), (module, names))
            target = next((r for r in RECIPES if module == r or module.startswith(r + ".")), None)
            if target is None or target == me:
                continue
            if me == LAUNCHER and names == [STAGE_ENTRY.get(target)]:
                continue
            bad.append(f"{path.relative_to(root)}:{line} {me} imports {module} {names}")
        for module, names, line in imports(path):  # private names crossing modules
            if module.startswith("d3d") and unit(module) != unit(me):
                bad += [f"{path.relative_to(root)}:{line} {me} takes private {module}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    return bad


def code_files() -> list[Path]:
    return sorted(SRC.rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))


def test_no_recipe_imports_another_and_no_component_imports_a_recipe():
    assert violations(code_files()) == []


def test_the_rule_sees_a_recipe_import_a_recipe(tmp_path):
    # the check itself must fail on what it forbids: a lazy recipe import inside a function,
    # a script importing a recipe, a private name crossing modules, and the launcher reaching past run_*
    fake = tmp_path / "src" / "d3d"
    fake.mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (fake / "train.py").write_text("def f():\n    from d3d.generate import read_responses\n")
    (fake / "pipeline.py").write_text("from d3d.train import run_train\nfrom d3d.prune import recover\n")
    (tmp_path / "scripts" / "bench.py").write_text("from d3d import train\nfrom d3d.report import _save\n")
    found = violations(sorted(fake.glob("*.py")) + [tmp_path / "scripts" / "bench.py"], tmp_path, fake)
    assert len(found) == 4, found
    assert any("d3d.train imports d3d.generate" in f for f in found)
    assert any("d3d.pipeline imports d3d.prune ['recover']" in f for f in found)
    assert any("scripts.bench imports d3d.train" in f for f in found)
    assert any("private d3d.report._save" in f for f in found)


def test_the_held_out_split_is_made_in_one_place():
    """d3d.examples.held_out splits the responses from every train.* setting that decides the split; a
    job or a script that called split_examples itself left one out (train.drop_looping) and measured
    its held-out τ on responses d3d.train had trained on."""
    def names(tree):
        for n in ast.walk(tree):
            yield n, (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                      else n.name if isinstance(n, ast.alias) else None)

    found = [f"{path.relative_to(ROOT)}:{n.lineno}" for path in code_files() if path != SRC / "examples.py"
             for n, name in names(ast.parse(path.read_text())) if name == "split_examples"]
    assert found == [], f"split_examples outside d3d.examples (call d3d.examples.held_out): {found}"


def defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, in if/try blocks
    too), not the ones it imports."""
    out, body = set(), list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def borrowed_names(files: list[Path], src: Path = SRC) -> list[str]:
    """Every `from d3d.x import name` (lazy ones too) where d3d.x is a module that does not define
    `name`, and every module `__getattr__`: a name with two homes. A package's __init__ is its API and
    may gather its modules' names."""
    modules = {module_name(p, src): p for p in sorted(src.rglob("*.py")) if p.name != "__init__.py"}
    defs = {m: defined(ast.parse(p.read_text())) for m, p in modules.items()}
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        found += [f"{path.name}:{n.lineno} module __getattr__" for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
        for module, names, line in imports(path):
            if module in defs:
                found += [f"{path.name}:{line} {module}.{n}" for n in names
                          if n not in defs[module] and f"{module}.{n}" not in modules]
    return found


def test_every_name_is_imported_from_its_home():
    """ConfigError and resolve_path were importable from d3d.config, load_examples from d3d.training
    and d3d.train, check_decode_cost from d3d.settings (by a module __getattr__): kept for tests and
    old callers, each a second home to keep in step. Each name is taken from the module that defines it."""
    files = code_files() + sorted((ROOT / "tests").rglob("*.py"))
    assert borrowed_names(files) == []


# Programs that are not recipes (no Hydra job), run as `python -m d3d.<name>`: entry points too.
PROGRAMS = {"d3d.benchmarks"}

# The floors of d3d, top down (docs/design.md#floors). A module imports from its own floor and those
# below it, never from one above: such an import is an upward arrow. A unit (a subpackage, or a
# top-level module) stands on one floor; the entry points (the recipes and the programs, which
# nothing imports) stand on the top one. A package's `__main__` stands on its package's floor: a
# program that needs a higher floor lives up there (d3d.data's listing is d3d.benchmarks).
FLOORS = (
    RECIPES | PROGRAMS,
    {"d3d.settings"},  # the boundary: OmegaConf -> d3d.specs, once
    {"d3d.report", "d3d.acceptance", "d3d.figures", "d3d.grading", "d3d.layer_scores", "d3d.estimator", "d3d.training", "d3d.examples", "d3d.objective",
     "d3d.decoding", "d3d.serving", "d3d.bench_engines"},
    {"d3d.models"},
    {"d3d.data"},
    {"d3d", "d3d.fetch", "d3d.utils", "d3d.config", "d3d.configdir", "d3d.specs", "d3d.errors"},
)


def floor(module: str) -> int:
    """0 for the top floor; a unit on no floor fails, naming itself."""
    if module in RECIPES or module in PROGRAMS:
        return 0
    found = [i for i, units in enumerate(FLOORS) if unit(module) in units]
    assert found, f"{unit(module)} stands on no floor: put it on one in FLOORS (tests/unit/test_architecture.py)"
    return found[0]


Graph = dict[str, dict[str, str]]  # module -> {module it imports: "file:line" of the first such import}


def module_graph(src: Path = SRC) -> Graph:
    """Every d3d module -> the d3d modules it imports, lazy imports included. `from d3d.x import y` is an
    arrow to d3d.x.y where that is a module, else to d3d.x (whose __init__ runs)."""
    paths = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    graph: Graph = {}
    for me, path in paths.items():
        arrows = graph.setdefault(me, {})
        for module, names, line in imports(path):
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in paths] or [module]:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != me:
                    arrows.setdefault(target, f"{path.relative_to(src.parents[1])}:{line}")
    return graph


def unit_graph(graph: Graph) -> Graph:
    """The same arrows between units (subpackages and top-level modules), entry points left out."""
    out: Graph = {}
    for me, arrows in graph.items():
        if floor(me) == 0:
            continue
        for target, where in arrows.items():
            if unit(target) != unit(me):
                out.setdefault(unit(me), {}).setdefault(unit(target), where)
    return out


def circles(graph: Graph) -> list[str]:
    """The shortest circle through each module not on one found before, as `a -> b -> ... -> a (the
    imports at file:line, ...)`; [] when the graph has none."""
    found, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        ways, frontier, ring = {start: [start]}, [start], None
        while frontier and ring is None:  # breadth first: the shortest way back to start
            step = []
            for n in frontier:
                for t in sorted(graph.get(n, {})):
                    if t == start:
                        ring = ring or ways[n] + [start]
                    elif t not in ways:
                        ways[t] = ways[n] + [t]
                        step.append(t)
            frontier = step
        if ring:
            seen.update(ring)
            found.append(" -> ".join(ring) + " (the imports at "
                         + ", ".join(graph[x][y] for x, y in zip(ring, ring[1:])) + ")")
    return found


def upward_arrows(graph: Graph) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as `file:line a (floor) imports b (floor)`."""
    return [f"{where} {me} (floor {floor(me)}) imports {target} (floor {floor(target)})"
            for me, arrows in sorted(graph.items()) for target, where in sorted(arrows.items())
            if floor(target) < floor(me)]


def test_no_import_circle_anywhere_in_d3d():
    """No circle between d3d's modules, lazy imports included, nor between its units. A circle
    works only by import order (or by an import hidden in a function body): before, d3d.decoding's
    engine and methods imported each other; d3d.models' drafter, target and random_models did."""
    graph = module_graph()
    for found in (circles(graph), circles(unit_graph(graph))):
        assert found == [], "\n".join(found)


def test_no_arrow_runs_up_a_floor():
    found = upward_arrows(module_graph())
    assert found == [], "\n".join(found)


def test_the_graph_sees_a_lazy_circle_and_an_upward_arrow(tmp_path):
    # the checks must fail on what they forbid: the old circle of d3d.models (two of its imports lazy),
    # and utils reaching up into models, which with models importing utils is a circle between units
    fake = tmp_path / "src" / "d3d"
    (fake / "models").mkdir(parents=True)
    (fake / "utils").mkdir()
    (fake / "models" / "drafter.py").write_text("from d3d.models import target\n")
    (fake / "models" / "target.py").write_text("def f():\n    from d3d.models.random_models import g\n")
    (fake / "models" / "random_models.py").write_text("def g():\n    import d3d.models.drafter\n")
    (fake / "utils" / "checkpoints.py").write_text("def h():\n    from d3d.models.drafter import x\n")
    (fake / "models" / "generation.py").write_text("from d3d.utils.checkpoints import h\n")
    graph = module_graph(fake)
    assert circles(graph) == ["d3d.models.drafter -> d3d.models.target -> d3d.models.random_models -> "
                              "d3d.models.drafter (the imports at src/d3d/models/drafter.py:1, "
                              "src/d3d/models/target.py:2, src/d3d/models/random_models.py:2)"]
    assert circles(unit_graph(graph)) == ["d3d.models -> d3d.utils -> d3d.models (the imports at "
                                          "src/d3d/models/generation.py:1, src/d3d/utils/checkpoints.py:2)"]
    assert upward_arrows(graph) == ["src/d3d/utils/checkpoints.py:2 d3d.utils.checkpoints (floor 5) imports "
                                    "d3d.models.drafter (floor 3)"]


def test_a_package_main_stands_on_its_package_floor(tmp_path):
    # `python -m d3d.data` imported d3d.settings, which imports d3d.grading, which imports d3d.data:
    # an arrow back up that the floors did not see while a `__main__` stood on the top one
    fake = tmp_path / "src" / "d3d"
    (fake / "data").mkdir(parents=True)
    (fake / "data" / "__main__.py").write_text("from d3d.settings import bind_config\n")
    (fake / "settings.py").write_text("")
    assert upward_arrows(module_graph(fake)) == ["src/d3d/data/__main__.py:1 d3d.data.__main__ (floor 4) imports "
                                                 "d3d.settings (floor 1)"]


def test_the_decoding_seam_imports_in_either_order_and_the_driver_names_no_method():
    """Either of the driver (d3d.decoding.engine) and the methods imports first (the whole-package
    test above keeps them out of a circle). And no method's name is a string in the driver: what it
    needs, it asks the method's class."""
    import subprocess
    import sys

    from d3d.decoding.methods import METHODS

    for order in ("engine, methods", "methods, engine"):  # either module first, in a fresh interpreter
        code = "; ".join(f"import d3d.decoding.{m}" for m in order.split(", "))
        subprocess.run([sys.executable, "-c", code], check=True)
    driver = ast.parse((SRC / "decoding" / "engine.py").read_text())
    named = {n.value for n in ast.walk(driver) if isinstance(n, ast.Constant) and n.value in METHODS}
    assert not named, f"d3d.decoding.engine names methods {sorted(named)}"


# where a speculative method's name may be written: the table (and what prune.tree_nodes scores by,
# the `tree` row's drafts), DecodeConfig's default method, and the prune records' labels (tree15)
MAY_NAME_A_METHOD = {"decoding/methods.py", "decoding/config.py", "prune.py"}


def test_no_module_branches_on_a_speculative_method_name():
    """A new shape of drafts or schedule is one class and one row: no module outside the table asks
    which speculative method it serves (the estimator used to map tree_nodes to `tree`, cost.py to
    test a method's keys for F and tree_nodes, eval to take C x F budgets for rows reading C and F).
    The AR baseline may be named (eval's and report's reference row, the budget's greedy text)."""
    from d3d.decoding.methods import METHODS

    speculative = {name for name, row in METHODS.items() if row.needs_drafter}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if str(path.relative_to(SRC)) in MAY_NAME_A_METHOD:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and n.value in speculative:
                found.append(f"{path.relative_to(SRC)}:{n.lineno} {n.value!r}")
    assert not found, f"modules name speculative methods: {found}"


def test_typed_components_import_no_omegaconf():
    """Binding (OmegaConf -> d3d.specs) happens once, in d3d.settings; the modules below the recipes
    take typed specs and import no OmegaConf, so scripts/gpu_train_check.py runs them on a bare GPU
    image. Run with omegaconf made unimportable: an import of it anywhere on these paths fails."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['omegaconf'] = None\n"
            "import d3d.specs, d3d.objective, d3d.training, d3d.models.target, d3d.models.drafter, d3d.models.random_models\n"
            "from d3d.objective import ObjectiveConfig; ObjectiveConfig.shipped(4)\n"
            "import d3d.data.benchmarks, d3d.data.prompts")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]


# The one room where a drafter's saved facts are read (docs/design.md, Models): its settings
# (DrafterSettings.of, .of_folder), its draft map (draft_map) and the one loader of a trained drafter
# (SavedDrafter); the parse of its config.json (saved_config, saved_settings) a floor below, in
# utils/checkpoints.py, where config-time code may import it. Outside it a raw read worked until a key was
# misspelt: a probe `getattr(head, "d2t", None)` then silently meant "a full head", `config.d3d[...]` a KeyError.
DRAFTER_ROOM = {"src/d3d/models/drafter.py", "src/d3d/models/drafter_settings.py", "src/d3d/utils/checkpoints.py"}
# lines outside the room that read some config.json and are not a drafter's, each with its reason
OTHER_CONFIGS = {
    ("src/d3d/models/target.py", ""): "the target's folder (its fingerprint, its download, its conversion)",
    ("src/d3d/prune.py", 'Path(spec.path).expanduser() / "config.json"'): "a model spec's folder (the target's)",
    ("scripts/memory_plan.py", 'Path(spec.path).expanduser() / "config.json"'): "a model spec's folder",
}
READS = (".read_text(", ".read_bytes(", "json.load(", "open(")


def _named(node) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def drafter_reads(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every raw read of a drafter's saved facts outside DRAFTER_ROOM, as `file:line what`: `.d3d` on a
    config, getattr/hasattr of "d3d", a config dict's "d3d" section, the string "d2t", a config.json read,
    and the loader's inner function `load_drafter`."""
    found = []
    for path in files:
        rel = str(path.relative_to(root))
        if rel in DRAFTER_ROOM:
            continue
        text = path.read_text()
        lines = text.splitlines()

        def allowed(line: int) -> bool:
            return any(f == rel and s in lines[line - 1] for f, s in OTHER_CONFIGS)

        for n in ast.walk(ast.parse(text, rel)):
            what = None
            if isinstance(n, ast.Attribute) and n.attr == "d3d":
                what = "config.d3d"
            elif isinstance(n, ast.Call) and _named(n.func) in ("getattr", "hasattr", "setattr", "get") and any(
                    isinstance(a, ast.Constant) and a.value == "d3d" for a in n.args):
                what = f'{_named(n.func)}(.., "d3d")'
            elif (isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and n.left.value == "d3d"
                  and isinstance(n.ops[0], (ast.In, ast.NotIn))):
                what = '"d3d" in a config'
            elif (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "d3d"
                  and (isinstance(n.value, ast.Call) or any(w in _named(n.value) for w in ("config", "data", "raw")))):
                what = 'a config\'s ["d3d"]'
            elif isinstance(n, ast.Constant) and n.value == "d2t":
                what = '"d2t"'
            elif (isinstance(n, ast.Constant) and n.value == "config.json"
                  and any(r in lines[n.lineno - 1] for r in READS)):
                what = "a config.json read"
            elif (isinstance(n, ast.Name) and n.id == "load_drafter") or (
                    isinstance(n, ast.alias) and n.name == "load_drafter"):
                what = "load_drafter (SavedDrafter.load is the loader)"
            if what and not allowed(n.lineno):
                found.append(f"{rel}:{n.lineno} {what}")
    return sorted(set(found))


def test_a_drafters_saved_facts_are_read_in_one_room():
    found = drafter_reads(code_files())
    assert found == [], "raw reads of a drafter's facts outside d3d.models.drafter(_settings):\n" + "\n".join(found)


def test_the_room_rule_sees_each_raw_read(tmp_path):
    fake = tmp_path / "src" / "d3d"
    fake.mkdir(parents=True)
    (fake / "eval.py").write_text(
        "import json\nfrom d3d.models.drafter import load_drafter\n"
        "def f(model, folder, head):\n"
        "    a = model.config.d3d['block_size']\n"
        "    b = getattr(model.config, 'd3d', None)\n"
        "    c = json.loads((folder / 'config.json').read_text())['d3d']\n"
        "    d = getattr(head, 'd2t', None)\n"
        "    heads = {'d3d': head}\n"
        "    return heads['d3d'], 'd3d' in c\n")
    found = drafter_reads([fake / "eval.py"], tmp_path)
    assert [f.split(" ", 1)[0] for f in found] == ["src/d3d/eval.py:2", "src/d3d/eval.py:4", "src/d3d/eval.py:5",
                                                   "src/d3d/eval.py:6", "src/d3d/eval.py:6", "src/d3d/eval.py:7",
                                                   "src/d3d/eval.py:9"], found
