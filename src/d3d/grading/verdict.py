"""The verdict on an answer: its tests run against it in the sandbox (d3d.grading.sandbox), and
`grade`, the one entry point for every benchmark kind.

Pass means the tests ran and passed. The answer must parse alone (a dangling decorator cannot swallow
the tests); answer and tests reach the harness over stdin, never as a file; the verdict goes out on a
pipe of its own, as a line carrying a per-run nonce. How the tests' checks meet the answer depends on
their shape (docs/reliability.md, Round 8):
- apart, for tests that use the answer's names only to call them (the `assert candidate(args) ==
  expected` of HumanEval and MBPP, loops over such calls included): the harness forks before the
  answer runs. The parent is a twin the answer never runs in (no process of the tree may read or
  write its memory: PR_SET_DUMPABLE 0 and the seccomp filter); it runs the tests with each call into
  the answer replaced by a request to the child: the call's source and the tests' values it uses, as
  plain data (ints, floats, complex, str, bytes, bool, None, Fractions, Decimals, and lists, tuples,
  dicts and sets of them). The child, which ran the answer, makes the call and sends the value back as
  plain data; the twin rebuilds it as the runtime's own types. The expected values never enter the
  answer's interpreter, and no object of the answer's, nor any patch it made, takes part in a
  comparison;
- together, for tests of any other shape (the answer's function passed as a value, tests that define
  classes, a call made for what it does to its arguments): the tests run in the answer's interpreter,
  with builtins and modules restored as they were before the answer ran and no value of a class the
  answer wrote let into a compare. What an answer can still forge there is in docs/reliability.md; each row says which way it
  was graded (`compared_apart`).
"""

from __future__ import annotations

import ast
import builtins
import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from d3d.errors import ConfigError
from d3d.data.benchmarks import Record
from d3d.grading.answers import PROGRAMS, math_correct
from d3d.grading.sandbox import Limits, run_program
from d3d.specs import BenchmarkSpec

# The harness: the only code started in the sandbox. Its stdin: two sizes (8 hex digits each), the job
# {answer, verdict, nproc, ...}, then (apart) the twin's part {nonce, tests}, which only the twin reads.
# It writes its verdict on fd `verdict` as "<nonce> pass" or "<nonce> fail <why>" and leaves by
# os._exit: the answer's atexit hooks and threads never run after the verdict.
_HARNESS = r"""
import builtins, json, os, resource, sys
def read(fd, n):
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
def no_stdin():
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
def reporter(fd, nonce):
    def say(line):
        os.write(fd, (nonce + " " + line.replace("\n", " ")[:500] + "\n").encode())
        os._exit(0)
    return say
def why(err):
    try:
        return type(err).__name__ + ": " + str(err)
    except BaseException:
        return type(err).__name__
def plain(v, depth=0):
    # The answer's value as tagged JSON. Whatever the answer patched, what leaves is data the twin rebuilds.
    if depth > 200:
        raise ValueError("a value nested over 200 deep")
    d = depth + 1
    if v is None:
        return ["n"]
    if type(v) is bool:
        return ["t", v]
    if isinstance(v, int):
        return ["i", hex(int.__int__(v))]
    if isinstance(v, float):
        return ["f", float.__float__(v)]
    if isinstance(v, complex):
        return ["c", float(v.real), float(v.imag)]
    if isinstance(v, str):
        return ["s", str.__str__(v)]
    if isinstance(v, (bytes, bytearray)):
        return ["b", bytes(v).hex()]
    if isinstance(v, list):
        return ["l", [plain(x, d) for x in list.__iter__(v)]]
    if isinstance(v, tuple):
        return ["u", [plain(x, d) for x in tuple.__iter__(v)]]
    if isinstance(v, dict):
        return ["d", [[plain(k, d), plain(x, d)] for k, x in dict.items(v)]]
    if isinstance(v, (set, frozenset)):
        return ["z" if isinstance(v, frozenset) else "e", [plain(x, d) for x in v]]
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and isinstance(v, fractions.Fraction):
        return ["q", hex(v.numerator), hex(v.denominator)]
    if decimal is not None and isinstance(v, decimal.Decimal):
        return ["m", str(v)]
    raise TypeError("a " + repr(type(v).__qualname__) + " object is not plain data")
def post(fd, message):
    data = json.dumps(message).encode()
    view = memoryview(b"%016x" % len(data) + data)
    while view:
        view = view[os.write(fd, view):]
def fetch(fd):
    # One message, or None where the other side is gone.
    size = read(fd, 16)
    if len(size) < 16:
        return None
    size = int(size, 16)
    if size > 64 << 20:
        raise ValueError("a message over 64 MB")
    data = read(fd, size)
    return None if len(data) < size else json.loads(data)
def values(job, asked, answer_to):
    # The child: the answer, then each call the twin asks for, with the tests' values it names; each
    # value goes back as plain data. It ends when the twin closes `asked`.
    def leave(message):
        post(answer_to, message)
        os._exit(0)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(job["answer"], "<answer>", "exec"), namespace)
    except SystemExit:
        leave(["exited"])
    except BaseException as err:
        leave(["raised", why(err)])
    scope = dict(namespace)
    try:
        exec(compile(job["imports"], "<tests>", "exec"), scope)
        for param, name in job["bind"].items():
            if name not in namespace:
                raise NameError("name " + repr(name) + " is not defined")
            scope[param] = namespace[name]
        calls = [compile(source, "<tests>", "eval") for source in job["atoms"]]
    except BaseException as err:
        leave(["raised", why(err)])
    post(answer_to, ["ready"])
    while True:
        request = fetch(asked)
        if request is None:
            os._exit(0)
        try:
            env = dict(scope)
            env.update((name, rebuild(value)) for name, value in request[1])
            reply = plain(eval(calls[request[0]], env))
        except BaseException as err:
            reply = ["x", type(err).__name__, why(err)]
        post(answer_to, reply)
class Raised(Exception):
    pass
def rebuild(e):
    # Tagged JSON back to values of the runtime's own types, in an interpreter the answer never ran in.
    def want(x, t):
        if type(x) is not t:
            raise ValueError("malformed")
        return x
    tag = want(e, list)[0]
    if tag == "n":
        return None
    if tag == "t":
        return want(e[1], bool)
    if tag == "i":
        return int(want(e[1], str), 16)
    if tag == "f":
        return float(e[1]) if type(e[1]) in (int, float) else want(e[1], float)
    if tag == "c":
        return complex(float(e[1]), float(e[2]))
    if tag == "s":
        return want(e[1], str)
    if tag == "b":
        return bytes.fromhex(want(e[1], str))
    if tag in ("l", "u", "e", "z"):
        items = [rebuild(x) for x in want(e[1], list)]
        return {"l": list, "u": tuple, "e": set, "z": frozenset}[tag](items)
    if tag == "d":
        return {rebuild(want(p, list)[0]): rebuild(p[1]) for p in want(e[1], list)}
    if tag == "q":
        import fractions
        return fractions.Fraction(int(want(e[1], str), 16), int(want(e[2], str), 16))
    if tag == "m":
        import decimal
        return decimal.Decimal(want(e[1], str))
    raise ValueError("malformed")
class Unsendable(Exception):
    pass
def apart(job, size):
    import ctypes
    # PR_SET_DUMPABLE 0, before the fork: no process of the tree may read or write the twin's memory
    # or descriptors through /proc (ptrace and process_vm_* are refused by the seccomp filter).
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_DUMPABLE) failed")
    answers, answer_to = os.pipe()
    asked, ask = os.pipe()
    if os.fork() == 0:
        os.close(answers)
        os.close(ask)
        os.close(job["verdict"])
        no_stdin()
        values(job, asked, answer_to)
    os.close(answer_to)
    os.close(asked)
    twin = json.loads(read(0, size))
    no_stdin()
    say = reporter(job["verdict"], twin["nonce"])
    try:
        started = fetch(answers)
    except Exception as err:
        started = ["malformed", why(err)]
    if started is None:
        say("fail the answer exited before its tests ran (no values came back)")
    if type(started) is not list or not started or started[0] not in ("ready", "exited", "raised"):
        say("fail the answer's process sent no well-formed reply")
    if started[0] == "exited":
        say("fail the answer exited before its tests ran")
    if started[0] == "raised":
        say("fail " + str(started[1:2] and started[1]))
    def atom(i, env):
        # Call i, made in the answer's process with the tests' values `env`; its value, rebuilt here.
        try:
            sent = [[name, plain(value)] for name, value in env.items()]
        except Exception as err:
            raise Unsendable(why(err))
        post(ask, [i, sent])
        reply = fetch(answers)
        if reply is None:
            raise Raised("the answer's process ended before it answered a call of the tests")
        if reply[:1] == ["x"]:
            kind, err = getattr(builtins, str(reply[1]), None), Raised(str(reply[2]))
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    err = kind(str(reply[2]).split(": ", 1)[-1])
                except Exception:  # a builtin whose constructor wants more (UnicodeDecodeError)
                    pass
            raise err
        return rebuild(reply)
    scope = {"__name__": "__main__", "__builtins__": builtins, "__d3d_atom": atom}
    try:
        exec(compile(twin["tests"], "<tests>", "exec"), scope)
    except Raised as err:
        say("fail " + str(err))
    except Unsendable as err:
        say("fail the tests give the answer a value that is not plain data (" + str(err) + ")")
    except BaseException as err:
        say("fail " + why(err))
    say("pass")
def together(job):
    say = reporter(job.pop("verdict"), job.pop("nonce"))
    tests = job.pop("tests")
    pristine = dict(builtins.__dict__)
    before = {name: (m, dict(m.__dict__)) for name, m in list(sys.modules.items()) if type(m) is type(sys)}
    type_, id_, isinstance_, dict_, len_, repr_ = type, id, isinstance, dict, len, repr
    plain = {bool, int, float, complex, str, bytes, type(None)}
    nested = {list, tuple, set, frozenset}
    flags, module_of, name_of = (type.__dict__[k] for k in ("__flags__", "__module__", "__qualname__"))
    modules = sys.modules
    theirs = set()  # ids of the classes the tests define (__d3d_trust after each class statement)
    def trust(cls):
        theirs.add(id_(cls))
    def trusted(t):
        # A class written in C, or one a module of the runtime defines under its own name (random.Random):
        # the answer can write a class with any __module__ and name, but not put it in that module's place.
        if id_(t) in theirs:
            return True
        meta = type_(t)
        if meta is not type and not trusted(meta):
            return False
        if not flags.__get__(t) & (1 << 9):  # Py_TPFLAGS_HEAPTYPE: written in Python
            return True
        where, name = module_of.__get__(t), name_of.__get__(t)
        module = modules.get(where) if isinstance_(where, str) else None
        return (where != "__main__" and module is not None and isinstance_(getattr(module, "__file__", None), str)
                and dict_.get(module.__dict__, name) is t)
    def vet(value):
        # Any other class can define ==, - or bool to say yes to anything.
        stack, seen = [value], set()
        while stack and len_(seen) < 1000000:
            v = stack.pop()
            t = type_(v)
            if t in plain:
                continue
            if id_(v) in seen:
                continue
            seen.add(id_(v))
            if t in nested:
                stack.extend(v)
            elif t is dict_:
                stack.extend(dict_.keys(v))
                stack.extend(dict_.values(v))
            elif not trusted(t):
                raise AssertionError("the answer gave a " + repr_(name_of.__get__(t)) + " object, a class it wrote, "
                                     "whose == cannot be trusted: a plain value is expected")
        return value
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(job.pop("answer"), "<answer>", "exec"), namespace)
    except SystemExit:
        say("fail the answer exited before its tests ran")
    except BaseException as err:
        say("fail " + type_(err).__name__ + ": " + str(err))
    sys.settrace(None)
    sys.setprofile(None)
    for name in [n for n in sys.modules if n not in before]:
        del sys.modules[name]  # a module the answer imported is imported afresh by the tests
    for name, (module, saved) in before.items():
        sys.modules[name] = module
        for key in [k for k in module.__dict__ if k not in saved]:
            del module.__dict__[key]
        module.__dict__.update(saved)
    scope = {**namespace, "__builtins__": pristine, "__d3d_vet": vet, "__d3d_trust": trust}
    try:
        exec(compile(tests, "<tests>", "exec"), scope)
    except BaseException as err:
        say("fail " + type_(err).__name__ + ": " + str(err))
    say("pass")
def main():
    sizes = read(0, 16)
    job = json.loads(read(0, int(sizes[:8], 16)))
    resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"],) * 2)  # in its user namespace: the tree alone
    if int(sizes[8:], 16):
        apart(job, int(sizes[8:], 16))
    no_stdin()
    together(job)
main()
"""


# ---------------------------------------------------------------------------- the tests' shape


@dataclass(frozen=True)
class Apart:
    """Tests split so that their checks run out of the answer's reach (see the module's docstring)."""

    calls: tuple[str, ...]  # each call into the answer (source): made in the answer's interpreter when asked
    imports: str  # the tests' top-level imports, run there first (a call's arguments may use them)
    bind: dict[str, str]  # a check function's parameter -> the answer's name it is called with (HumanEval)
    tests: str  # the tests with call i replaced by `__d3d_atom(i, {the tests' values it uses})`: run in the twin


BUILTINS = frozenset(dir(builtins))
# `list(f(x))` and its like run with the call, in the answer's interpreter: a right answer may return an
# iterator the tests collect. One argument and nothing else, so no value of the tests' goes with it.
COLLECTING = frozenset({"list", "tuple", "set", "frozenset", "sorted", "dict"})


def _bound(node: ast.AST) -> set[str]:
    """Every name `node` binds anywhere in it."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((alias.asname or alias.name).split(".")[0] for alias in n.names)
        elif isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name:
            out.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            out.add(n.rest)
    return out


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _inline_check(body: list[ast.stmt]) -> tuple[list[ast.stmt], dict[str, str]] | None:
    """HumanEval's `def check(candidate): ...` called once as `check(entry_point)`: its body in place of
    the call, `candidate` bound to the answer's function; other tests as they are."""
    defs = {s.name: s for s in body if isinstance(s, ast.FunctionDef)}
    calls = [s for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
             and isinstance(s.value.func, ast.Name) and s.value.func.id in defs]
    if not calls:
        return body, {}
    if len(calls) != 1:
        return None
    call, f = calls[0].value, defs[calls[0].value.func.id]
    a = f.args
    if (a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or f.decorator_list or call.keywords
            or len(call.args) != len(a.args) or not all(isinstance(x, ast.Name) for x in call.args)
            or any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom)) for n in ast.walk(f))):
        return None
    rest = [s for s in body if s is not f and s is not calls[0]]
    if any(f.name in _loads(s) for s in rest + f.body) or any(x.id in _bound(ast.Module(rest + f.body, [])) for x in call.args):
        return None
    flat = []
    for s in body:
        if s is calls[0]:
            flat.extend(f.body)
        elif s is not f:
            flat.append(s)
    return flat, {p.arg: x.id for p, x in zip(a.args, call.args)}


def split_tests(tests: str) -> Apart | None:
    """`tests` split into the calls they make into the answer and everything else, where the answer's
    names appear only as called functions and each call's arguments use constants, builtins, the tests'
    top-level imports and the tests' own variables (sent as plain data when the call is made); else None
    (the tests run together with the answer). Decided from the tests alone: no answer chooses how it
    is graded."""
    try:
        inlined = _inline_check(ast.parse(tests).body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if inlined is None:
        return None
    body, bind = inlined
    module = ast.Module(body, [])
    if any(isinstance(n, (ast.ClassDef, ast.Global, ast.Nonlocal)) for n in ast.walk(module)):
        return None  # tests that build their own classes, or rebind names across scopes
    bound = _bound(module)
    if set(bind) & bound:
        return None
    answer = (_loads(module) - bound - BUILTINS) | set(bind)  # names only the answer (or the check's call) binds
    top_imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
    if any(alias.name == "*" for s in top_imports for alias in s.names):
        return None
    imported = _bound(ast.Module(top_imports, [])) - _bound(ast.Module([s for s in body if s not in top_imports], []))
    usable = answer | imported | (BUILTINS - bound)  # what the answer's interpreter has itself
    unsendable = {n.name for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    unsendable |= _bound(ast.Module([n for n in ast.walk(module) if isinstance(n, (ast.Import, ast.ImportFrom))], []))
    calls: list[ast.Call] = []

    class Cut(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            wraps = (isinstance(node.func, ast.Name) and node.func.id in COLLECTING and node.func.id not in bound
                     and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Call)
                     and _loads(node.args[0].func) & answer)
            if not wraps and not _loads(node.func) & answer:
                return self.generic_visit(node)
            calls.append(node)
            sent = sorted(_loads(node) - usable - _bound(node))
            env = ast.Dict([ast.Constant(n) for n in sent], [ast.Name(n, ast.Load()) for n in sent])
            return ast.copy_location(ast.Call(ast.Name("__d3d_atom", ast.Load()), [ast.Constant(len(calls) - 1), env], []), node)

    for s in body:  # a call whose value is dropped is made for what it does to its arguments: they stay here
        if isinstance(s, ast.Expr) and _loads(s) & answer:
            return None
    cut = Cut().visit(module)
    if not calls or _loads(cut) & answer:
        return None  # no call, or the answer's names used otherwise (passed, compared, subscripted)
    for call in calls:
        if any(isinstance(n, ast.NamedExpr) for n in ast.walk(call)) or (_loads(call) - usable - _bound(call)) & unsendable:
            return None  # it binds a name, or takes a function or module of the tests'
    return Apart(tuple(ast.unparse(c) for c in calls), "\n".join(ast.unparse(s) for s in top_imports), bind,
                 ast.unparse(ast.fix_missing_locations(cut)))


class _Vetted(ast.NodeTransformer):
    """The tests with each call's result and each compared operand passed through the harness's `vet`,
    and each class they define trusted by it (its objects are the tests', not the answer's)."""

    def visit_ClassDef(self, node: ast.ClassDef) -> list[ast.stmt]:
        trust = ast.Expr(ast.Call(ast.Name("__d3d_trust", ast.Load()), [ast.Name(node.name, ast.Load())], []))
        return [self.generic_visit(node), ast.copy_location(trust, node)]

    @staticmethod
    def wrap(node: ast.expr) -> ast.expr:
        return ast.copy_location(ast.Call(ast.Name("__d3d_vet", ast.Load()), [node], []), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        return self.wrap(self.generic_visit(node))

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        node.left = self.wrap(node.left)
        node.comparators = [self.wrap(c) for c in node.comparators]
        return node


def vetted_tests(tests: str) -> str:
    return ast.unparse(ast.fix_missing_locations(_Vetted().visit(ast.parse(tests))))


def unparsable(answer: str) -> str | None:
    """Why the answer alone is not a complete program, or None."""
    try:
        ast.parse(answer)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return f"the answer is not a complete program on its own ({type(err).__name__}: {err})"
    return None


# ---------------------------------------------------------------------------- running them


def run_tests(answer: str, tests: str, timeout_s: float, limits: Limits | None = None,
              sandbox: str = "bwrap") -> tuple[bool, str]:
    """Run the answer, then the tests, in `sandbox`; (passed, why it failed)."""
    limits = limits or Limits()
    why = unparsable(answer)
    if why:
        return False, why
    nonce = secrets.token_hex(16)
    split = split_tests(tests)
    if split:
        first = {"answer": answer, "atoms": list(split.calls), "imports": split.imports, "bind": split.bind}
        second = json.dumps({"nonce": nonce, "tests": split.tests}).encode()
    else:
        first, second = {"answer": answer, "tests": vetted_tests(tests), "nonce": nonce}, b""

    def job(verdict_fd: int, nproc: int) -> bytes:
        head = json.dumps(first | {"verdict": verdict_fd, "nproc": nproc}).encode()
        return b"%08x%08x" % (len(head), len(second)) + head + second

    ran = run_program(_HARNESS, job, timeout_s, limits, sandbox)
    if ran.timed_out:
        return False, "timeout"
    if ran.flooded:  # Python ignores SIGXFSZ and raises "File too large" instead
        return False, f"output or a file over {limits.file_mb} MB"
    lines = ran.said.splitlines()
    mine = [line[len(nonce) + 1:] for line in lines if line.startswith(nonce + " ")]
    if not lines:  # the harness never got to its verdict: the sandbox's or the interpreter's own words
        return False, (ran.stderr.strip().splitlines() or [f"no verdict from the tests (exit status {ran.code})"])[-1]
    if len(lines) != 1 or len(mine) != 1:  # anything else on the verdict pipe is the answer's
        return False, "the verdict pipe held lines the tests did not write"
    if mine[0] == "pass" and ran.code == 0:
        return True, ""
    return False, mine[0].removeprefix("fail ") or f"exit status {ran.code}"


# ---------------------------------------------------------------------------- one entry point

UNCHECKED = {"answer": None, "correct": None}


def grade_math(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float, sandbox: str) -> dict[str, Any]:
    answer, ok = math_correct(text, record.reference)
    return {"answer": answer, "correct": ok}


def grade_code(spec: BenchmarkSpec, record: Record, text: str, timeout_s: float,
               sandbox: str = "bwrap") -> dict[str, Any]:
    """The verdict, and whether the tests' checks ran apart from the answer's interpreter (`compared_apart`)."""
    program = PROGRAMS.get(spec.loader)
    if program is None:
        return dict(UNCHECKED)
    answer, tests = program(record, text)
    ok, err = run_tests(answer, tests, timeout_s, sandbox=sandbox)
    return {"answer": None, "correct": ok, "compared_apart": split_tests(tests) is not None,
            **({} if ok else {"error": err.strip().splitlines()[-1:]})}


# Graders by `spec.kind` (conf/benchmark/<name>.yaml): a new benchmark of a known kind is graded with
# no code change; a new kind is one function here.
GRADERS: dict[str, Callable[..., dict[str, Any]] | None] = {"math": grade_math, "code": grade_code, "chat": None}


def grade(spec: BenchmarkSpec, record: Record, text: str, turn: int = 0,
          timeout_s: float = 10.0, sandbox: str = "bwrap") -> dict[str, Any]:
    """{"answer": ..., "correct": True/False/None} for one reply (None: not checkable); code runs in
    `sandbox` (eval.sandbox)."""
    if spec.kind not in GRADERS:
        raise ConfigError(f"benchmark.specs.{spec.name}.kind={spec.kind!r}: use {', '.join(GRADERS)}")
    grader = GRADERS[spec.kind]
    if grader is None or turn > 0 or record.reference is None:
        return dict(UNCHECKED)
    return grader(spec, record, text, timeout_s, sandbox)
