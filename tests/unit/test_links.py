"""Every relative link resolves: Markdown links in the repository's .md files, and the
`docs/….md#anchor` references in docstrings, comments and YAML. A file must exist; an anchor must be
a heading's slug (GitHub's rule) or an explicit `<a id=…>` in the file it names. docs/design.md is the
one design reference, so nothing cites a design document by section number."""

import re
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The folders whose files are the project's: the rest of the tree is caches and outputs.
PROJECT_DIRS = ("src", "conf", "tests", "scripts", "docs", "data", "notebooks", "examples")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".cfg", ".ipynb", ".sh"}


def project_files() -> list[Path]:
    """The files git tracks (so a local cache never counts); a tree without git falls back to the
    project's folders and top-level files."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        return [ROOT / p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.iterdir() if p.is_file()]
        for d in PROJECT_DIRS:
            files += [p for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        return files


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, every character that is not a
    letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).lower()                # tags render as nothing
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """The anchors a Markdown file offers: its headings' slugs (a repeated slug gets -1, -2, …) and
    its explicit `<a id="…">` / `<a name="…">`."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        m = re.match(r"\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return frozenset(found)


def broken(target: Path, anchor: str | None) -> str | None:
    """Why a link to target#anchor does not resolve, or None."""
    if not target.exists():
        return "no such file"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no anchor #{anchor}"
    return None


MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_REF = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs|conf|src|scripts|tests)/[\w./-]*\.md)(?:#([\w-]+))?")


def markdown_problems(path: Path) -> list[str]:
    out = []
    in_fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        for link in MD_LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            file, _, anchor = link.partition("#")
            target = (path.parent / file).resolve() if file else path
            why = broken(target, anchor or None)
            if why:
                out.append(f"{path.relative_to(ROOT)}:{n}: {link}: {why}")
    return out


def code_problems(path: Path) -> list[str]:
    """References to Markdown files from code and config, read from the repository's root (as
    `docs/design.md#floors` is written), or from the file's folder when it starts with ../."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for file, anchor in CODE_REF.findall(line):
            target = (path.parent / file) if file.startswith("../") else ROOT / file
            if "*" in file or "<" in file:
                continue
            why = broken(target.resolve(), anchor or None)
            if why:
                out.append(f"{path.relative_to(ROOT)}:{n}: {file}{'#' + anchor if anchor else ''}: {why}")
    return out


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for path in project_files():
        if path.suffix == ".md":
            problems += markdown_problems(path)
        elif path.suffix in CODE_SUFFIXES:
            problems += code_problems(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_no_citation_of_a_design_document_by_section_number():
    # Built from parts, so this file does not cite what it looks for; a citation broken over two
    # lines of a comment or docstring counts too.
    pattern = re.compile("DESIGN" + r"[\s#*>\"]*" + "\u00a7")
    hits = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for p in project_files()
            if p.suffix in CODE_SUFFIXES | {".md"}
            for text in [p.read_text(encoding="utf-8", errors="replace")] for m in pattern.finditer(text)]
    assert not hits, "cite a section of docs/design.md instead: " + ", ".join(hits)


def test_the_slug_rule_on_headings_with_modules_and_punctuation():
    assert slug("Models [d3d.models]") == "models-d3dmodels"
    assert slug("Evaluation [eval.py, grading.py, report.py]") == "evaluation-evalpy-gradingpy-reportpy"
    assert slug("Changes a researcher makes, and the files each touches") == \
        "changes-a-researcher-makes-and-the-files-each-touches"
    assert slug("1. What each GPU class fits") == "1-what-each-gpu-class-fits"
