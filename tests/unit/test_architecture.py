"""The house rule (docs/design.md#recipes-and-components): recipes stand side by side on one floor and
import only components; what two recipes share is a component below them.

Parsed with `ast`, lazy imports inside functions included, so a rule broken in a function body
fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "d3d"

# The job entry points (`python -m d3d.<name>`). d3d.report is a component with a CLI of its own:
# eval writes its report through it.
RECIPES = {"d3d.generate", "d3d.train", "d3d.prune", "d3d.eval", "d3d.pipeline"}
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


def decoding_imports(src: Path = SRC) -> dict[str, set[str]]:
    """d3d.decoding's modules -> the d3d.decoding modules each imports (lazy imports included)."""
    modules = {module_name(p, src): p for p in sorted((src / "decoding").glob("*.py"))}
    return {me: {m for m, _, _ in imports(p) if m in modules and m != me} for me, p in modules.items()}


def test_the_decoding_seam_has_no_import_circle_and_the_driver_names_no_method():
    """The methods and their passes do not import the driver (d3d.decoding.engine): before, the engine
    imported the methods lazily and the methods the engine, a circle that only worked by import order.
    And no method's name is a string in the driver: what it needs, it asks the method's class."""
    import subprocess
    import sys

    from d3d.decoding.methods import METHODS

    graph = decoding_imports()

    def reaches(start: str, goal: str, seen=()) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m)], graph
    for order in ("engine, methods", "methods, engine"):  # either module first, in a fresh interpreter
        code = "; ".join(f"import d3d.decoding.{m}" for m in order.split(", "))
        subprocess.run([sys.executable, "-c", code], check=True)
    driver = ast.parse((SRC / "decoding" / "engine.py").read_text())
    named = {n.value for n in ast.walk(driver) if isinstance(n, ast.Constant) and n.value in METHODS}
    assert not named, f"d3d.decoding.engine names methods {sorted(named)}"


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
