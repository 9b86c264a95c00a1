"""No file under scripts/ names a decoding method (issue 47): the rows a script times, projects or
evaluates come from the method table (d3d.decoding.methods.METHODS: a row found by what it is, e.g.
the first without a drafter), from a preset (conf/bench/) or from its command line, so a row added,
renamed or removed changes no script.

What counts as naming: a method's name as a word of the code, read with `tokenize`: an identifier
(not an attribute after a dot: `model.generate` is transformers' call) or a word of a string
literal, f-strings included, where a word is a run of letters, digits, `_` and `-` (so a row label
such as `async_12x2` or a flag such as `--tree-nodes`, a decode key's name, is not the method's
name). Comments and docstrings are prose about the code and are not read. The names are the
table's rows and the peers d3d.bench times beside them (d3d.bench.PEERS), less any that is also a
recipe's name (conf/<name>.yaml: `generate` is d3d.generate too, which a script composes)."""

from __future__ import annotations

import io
import re
import tokenize

from d3d.bench import PEERS
from d3d.configdir import config_dir
from d3d.decoding.methods import METHODS
from tests.conftest import ROOT

RECIPES = {p.stem for p in config_dir().glob("*.yaml")}
NAMES = (set(METHODS) | set(PEERS)) - RECIPES
WORD = re.compile(r"[A-Za-z0-9_-]+")


def docstrings(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """Indices of the string tokens that stand alone as a statement (a module's, class's or
    function's docstring, or a bare string): the tokens before them end a line or open a block."""
    skip = (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENCODING)
    out = set()
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.STRING:
            continue
        before = next((t for t in reversed(tokens[:i]) if t.type not in skip), None)
        after = next((t for t in tokens[i + 1:] if t.type not in (tokenize.NL, tokenize.COMMENT)), None)
        starts = before is None or before.type in (tokenize.NEWLINE, tokenize.INDENT) or before.string == ":"
        if starts and (after is None or after.type in (tokenize.NEWLINE, tokenize.ENDMARKER)):
            out.add(i)
    return out


def method_names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) of every method name the code of `source` holds, in order."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    skipped = docstrings(tokens)
    hits = []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in NAMES and not (i and tokens[i - 1].string == "."):
            hits.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and i not in skipped:
            hits += [(tok.start[0], w) for w in WORD.findall(tok.string) if w in NAMES]
    return hits


def test_the_scan_sees_code_and_skips_prose():
    source = ('"""sync and async, in a docstring."""\n'
              '# async in a comment\n'
              'def f(model, ar):\n'
              '    """tree."""\n'
              '    x = ["--tree-nodes", "async_12x2", "tree_nodes", model.generate]\n'
              '    return f"{ar}: eval.methods=[sync,async]", "prompt_lookup"\n')
    assert method_names_in(source) == [(3, "ar"), (6, "ar"), (6, "sync"), (6, "async"), (6, "prompt_lookup")]


def test_no_script_names_a_decoding_method():
    hits = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted((ROOT / "scripts").glob("*.py"))
            for line, name in method_names_in(path.read_text())]
    assert not hits, (f"{len(hits)} method names in scripts/ (take the rows from d3d.decoding.methods.METHODS, a "
                      f"conf/bench preset or the command line):\n" + "\n".join(hits))
