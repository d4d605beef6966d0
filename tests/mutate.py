#!/usr/bin/env python3
"""Mutation testing of the guards that keep the store's contract: break one guard at a time and see a test fail.

A guard (a bound check, a busy bit, a generation compared, a put fenced) can be deleted without any test noticing
when every test that reaches it passes through another check too, or never meets the case it exists for. This
tool finds such guards. It applies one small change at a time (a comparison's operator, a constant off by one, an
operand dropped from an ``and``, a call removed, a guarding ``if`` disabled, an arithmetic operator swapped) to
the named functions of the modules that guard the contract (:data:`TARGETS`), runs the tests that cover that
module, and reports each mutant as killed (a test failed, or the run outlived its timeout) or survived. A survivor
is a change no test looks at: a missing test (write it), a redundant guard (say so in a comment beside it), or an
equivalent change (list it in :data:`EQUIVALENT` with the reason; it is then not run).

Why a script of our own and not mutmut: mutmut rewrites every function of a module into trampolines, which Numba
cannot compile, and runs from a ``mutants/`` copy it builds itself, which the tests' worker processes (segments,
masters, writers started as ``python -m``) would not import. Here each mutant is one text change in a scratch
copy of the tracked files (the worktree is never touched), imported through ``PYTHONPATH`` by every process a
test starts, with Python's bytecode cache off (a mutant of the same size written in the same second would
otherwise load the previous one's bytecode) and a Numba cache of its own: a copy of one warmed on the unchanged
code, less the kernels of the mutated module and of every module that imports it (a kernel's cache holds the
code of the kernels it calls, so a caller compiled against the unchanged callee would hide the mutant).

On demand, not in CI: a full pass runs one mutant at a time for about an hour on 2 cores. See tests/README.md.
"""
from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutate_targets import EQUIVALENT, HAND, TARGETS, Target  # noqa: E402

#: A mutant's run may take this many times its module's unmutated run, plus COMPILE_S (its kernels recompile).
TIMEOUT_FACTOR = 3.0
COMPILE_S = 90.0
CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
            ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
            ast.Mod: ast.FloorDiv, ast.BitXor: ast.BitOr}
JUMPS = (ast.Raise, ast.Return, ast.Continue, ast.Break)


@dataclass
class Mutant:
    path: str          # the module, relative to the repository
    function: str      # as named in TARGETS ("Class.method" or "function")
    line: int
    old: str           # the source changed ...
    new: str           # ... and what it became
    kind: str
    context: str = ""  # the code of the line the change starts on (tells apart equal changes of one function)
    text: str = field(repr=False, default="")  # the whole mutated module
    status: str = ""   # killed, timeout, survived, equivalent, broken (did not run: a syntax error)
    seconds: float = 0.0
    detail: str = ""   # the first failing test, or why it is equivalent

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.path, self.function, self.old, self.new

    def describe(self) -> str:
        return f"{self.path}:{self.line} {self.function}: `{self.old}` -> `{self.new}` ({self.kind})"


# ---- making mutants ------------------------------------------------------------------------------------------

def _skipped(node: ast.AST) -> bool:
    """Nodes whose insides are not guards: messages, log calls (and ``if``s that only log), assertions."""
    if isinstance(node, (ast.JoinedStr, ast.Raise, ast.Assert)):
        return True
    if isinstance(node, ast.If) and not node.orelse and all(_skipped(stmt) for stmt in node.body):
        return True
    if isinstance(node, ast.BinOp) and any(isinstance(n, ast.JoinedStr) or isinstance(n, ast.Constant)
                                           and isinstance(n.value, str) for n in (node.left, node.right)):
        return True  # a message put together
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True  # a docstring
    call = node.value if isinstance(node, ast.Expr) else node
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "log":
        return True
    return False


def _walk(node: ast.AST, quiet: bool = False):
    """Every node under ``node`` (a function's body statements) outside the skipped ones, and whether it is a
    constant not worth mutating: an operand of a comparison (``x < 1`` is ``x <= 0``, a comparison's mutant), of
    arithmetic (``x + 1`` has its off-by-one mutant; ``2 * k`` and ``1 << way`` garble everything), an index
    (a column: ``pairs[k, 0]``) or an increment (its statement's removal)."""
    if _skipped(node):
        return
    yield node, quiet
    for name, value in ast.iter_fields(node):
        if name in ("annotation", "returns", "decorator_list"):
            continue
        inner = isinstance(node, (ast.Compare, ast.BinOp, ast.AugAssign)) or name == "slice"
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield from _walk(child, inner or quiet and isinstance(node, (ast.Tuple, ast.UnaryOp, ast.Slice)))


def _node_mutants(node: ast.AST, wide: bool = False):
    """``(node whose source is replaced, its replacement, kind)`` for one node. ``wide`` adds the swaps of
    arithmetic and bitwise operators (``*`` for ``//``, ``&`` for ``|``, ...), which in index arithmetic nearly
    always crash or garble every row at once (killed by any test), at a test run each."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMP_SWAP:
                new = copy.deepcopy(node)
                new.ops[i] = CMP_SWAP[type(op)]()
                yield node, ast.unparse(new), "comparison"
    elif isinstance(node, ast.BinOp):
        if isinstance(node.op, (ast.Add, ast.Sub)) and _is_one(node.right):
            yield node, ast.unparse(node.left), "off by one"
        elif isinstance(node.op, ast.Add) and _is_one(node.left):
            yield node, ast.unparse(node.right), "off by one"
        elif type(node.op) in BIN_SWAP and (wide or isinstance(node.op, (ast.Add, ast.Sub))):
            new = copy.deepcopy(node)
            new.op = BIN_SWAP[type(node.op)]()
            yield node, ast.unparse(new), "operator"
    elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        value = (not node.value) if isinstance(node.value, bool) else node.value + 1
        yield node, repr(value), "constant"
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield node, ast.unparse(new), "and/or"
        for i in range(len(node.values)):
            rest = node.values[:i] + node.values[i + 1:]
            kept = rest[0] if len(rest) == 1 else ast.BoolOp(op=node.op, values=rest)
            yield node, ast.unparse(kept), "condition dropped"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node, ast.unparse(node.operand), "not dropped"
    elif isinstance(node, ast.If) and isinstance(node.body[-1], JUMPS):
        yield node.test, "False", "guard disabled"
    elif isinstance(node, ast.AugAssign) or isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield node, "pass", "statement removed"


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 1


def _functions(tree: ast.Module):
    """``(qualified name, node)`` of every function and method at the module's top level."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


class Source:
    """A module's text, and replacements of node spans in it that keep every other line where it was."""

    def __init__(self, path: str, text: str):
        self.path, self.text = path, text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def code(self, lineno: int) -> str:
        """Line ``lineno`` without its indentation and its trailing comment."""
        return re.sub(r"\s+#.*$", "", self.lines[lineno - 1]).strip()

    def offset(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col_bytes].decode())

    def replace(self, node: ast.AST, new: str) -> tuple[str, str]:
        """``(old source, mutated module)``; an expression's replacement is parenthesised (the precedence of
        what it becomes may be lower), and spans of several lines keep their line count."""
        lo = self.offset(node.lineno, node.col_offset)
        hi = self.offset(node.end_lineno, node.end_col_offset)
        old = self.text[lo:hi]
        extra = "\n" * (node.end_lineno - node.lineno)
        if isinstance(node, ast.stmt):
            body = new + extra
        else:
            body = f"({new}{extra})"
        return " ".join(old.replace("\\\n", " ").split()), self.text[:lo] + body + self.text[hi:]


def mutants_of(root: Path, path: str, functions: tuple[str, ...], wide: bool = False) -> list[Mutant]:
    """Every mutant of the named functions of ``path`` (relative to ``root``), in source order."""
    source = Source(path, (root / path).read_text())
    found = dict(_functions(ast.parse(source.text)))
    missing = [f for f in functions if f not in found]
    if missing:
        raise SystemExit(f"mutate: {path} has no function {', '.join(missing)} (update tests/mutate_targets.py)")
    out, seen = [], set()
    for name in functions:
        for stmt in found[name].body:
            for node, quiet in _walk(stmt):
                if quiet and isinstance(node, ast.Constant) and type(node.value) is int:
                    continue
                for target, new, kind in _node_mutants(node, wide):
                    old, text = source.replace(target, new)
                    if (target.lineno, old, new) in seen or " ".join(new.split()) == old:
                        continue
                    seen.add((target.lineno, old, new))
                    out.append(Mutant(path, name, target.lineno, old, " ".join(new.split()), kind,
                                      source.code(target.lineno), text))
    return out


def hand_mutants(root: Path) -> list[Mutant]:
    """The mutants written by hand (:data:`HAND`): each replaces one exact text inside its function."""
    out = []
    for path, function, old, new, kind in HAND:
        source = Source(path, (root / path).read_text())
        node = dict(_functions(ast.parse(source.text))).get(function)
        if node is None:
            raise SystemExit(f"mutate: {path} has no function {function}")
        lo, hi = source.offset(node.lineno, node.col_offset), source.offset(node.end_lineno, node.end_col_offset)
        body = source.text[lo:hi]
        if body.count(old) != 1:
            raise SystemExit(f"mutate: {path} {function}: expected {old!r} once, found it {body.count(old)} times")
        line = source.text[:lo + body.index(old)].count("\n") + 1
        text = source.text[:lo] + body.replace(old, new) + source.text[hi:]
        out.append(Mutant(path, function, line, old, new, f"by hand: {kind}", source.code(line), text))
    return out


# ---- running mutants -------------------------------------------------------------------------------------------

def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def _importers(root: Path, path: str) -> set[str]:
    """``path`` and every project module that imports it, directly or through others (paths, relative)."""
    modules = {}
    for package in ("engram_store", "engram_model", "master"):
        for file in (root / package).rglob("*.py"):
            modules[_module_name(str(file.relative_to(root)))] = str(file.relative_to(root))
    imports: dict[str, set[str]] = {}
    for name, rel in modules.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        imports[name] = {t for t in targets if t in modules}
    found, todo = {_module_name(path)}, [_module_name(path)]
    while todo:
        name = todo.pop()
        for other, targets in imports.items():
            if name in targets and other not in found:
                found.add(other)
                todo.append(other)
    return {modules[name] for name in found}


class Workspace:
    """A scratch copy of the tracked files, its warmed Numba cache, and the runs of mutants in it."""

    def __init__(self, at: str | None = None, keep: bool = False):
        """The files of the worktree as they are (tracked and new), or those of commit ``at``."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"engram-mutate-{os.getpid()}-"))
        self.repo, self.base_cache = self.dir / "repo", self.dir / "numba-base"
        self.keep = keep
        self.repo.mkdir()
        self.base_cache.mkdir()
        if at is not None:
            archive = subprocess.run(["git", "archive", at], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(self.repo)], input=archive, check=True)
            return
        files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        for rel in filter(None, files):
            if (ROOT / rel).is_file():
                (self.repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, self.repo / rel)

    def warm(self) -> None:
        """Compile every kernel of the unchanged code into the base cache (as CI does before its tests): the first
        run of a path must not spend a test's timeout compiling."""
        subprocess.run(["nice", "-n", "10", sys.executable, "-m", "engram_model.warmup"], cwd=self.repo,
                       env=self.env(self.base_cache), check=True, capture_output=True, timeout=1800)

    def env(self, cache: Path) -> dict:
        # Kernels index with bounds checks on: a mutant that reads past an array (which unchecked code does
        # silently, often finding the right bytes just beyond) raises instead.
        return {**os.environ, "PYTHONPATH": str(self.repo), "PYTHONDONTWRITEBYTECODE": "1",
                "NUMBA_CACHE_DIR": str(cache), "PYTHONHASHSEED": "0", "NUMBA_BOUNDSCHECK": "1"}

    def run_tests(self, tests: tuple[str, ...], cache: Path, timeout_s: float) -> tuple[str, float, str]:
        """``(outcome, seconds, first failure)``: outcome "passed", "failed" or "timeout"."""
        args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
                "-o", "addopts=", *tests]
        start = time.monotonic()
        proc = subprocess.Popen(["nice", "-n", "10", *args], cwd=self.repo, env=self.env(cache),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return "timeout", time.monotonic() - start, ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        failed = next((line[7:] for line in out.splitlines() if line.startswith("FAILED ")), "")
        if proc.returncode == 0:
            return "passed", time.monotonic() - start, ""
        if proc.returncode in (1, 3) and not failed:
            failed = (out.strip().splitlines() or ["?"])[-1]
        if proc.returncode not in (1, 3):  # 2: interrupted (a collection error), 4: usage, 5: no tests
            failed = f"pytest exit {proc.returncode}: " + " | ".join(out.strip().splitlines()[-3:])
        return "failed", time.monotonic() - start, failed

    def mutant_cache(self, path: str) -> Path:
        """A Numba cache for a mutant of ``path``: the warmed one less the kernels that may hold its code."""
        cache = self.dir / "numba-mutant"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(self.base_cache, cache)
        for rel in _importers(self.repo, path):
            source = self.repo / rel
            sub = os.path.dirname(os.path.abspath(source))
            where = cache / f"{os.path.basename(sub)}_{hashlib.sha1(sub.encode()).hexdigest()}"
            for entry in where.glob(f"{source.stem}.*") if where.is_dir() else ():
                entry.unlink()
        return cache

    def run_mutant(self, mutant: Mutant, tests: tuple[str, ...], timeout_s: float) -> None:
        """Run ``tests`` against ``mutant`` and record the outcome in it; the module is restored after."""
        target = self.repo / mutant.path
        original, stat = target.read_text(), target.stat()
        try:
            compile(mutant.text, mutant.path, "exec")
        except SyntaxError as exc:
            mutant.status, mutant.detail = "broken", f"not valid Python: {exc}"
            return
        try:
            target.write_text(mutant.text)
            outcome, mutant.seconds, mutant.detail = self.run_tests(tests, self.mutant_cache(mutant.path),
                                                                    timeout_s)
        finally:
            target.write_text(original)
            os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the warmed cache stays valid for it
        mutant.status = {"passed": "survived", "failed": "killed"}.get(outcome, outcome)

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


# ---- the command -----------------------------------------------------------------------------------------------

def _selected(args, root: Path) -> list[tuple[Target, list[Mutant]]]:
    """The targets and their mutants the arguments pick, with what is known of them already: equivalent, or the
    outcome an earlier run found (``--rerun``: unless it survived; ``--resume``: any)."""
    chosen, previous = [], _previous(args.rerun or args.resume)
    hand = hand_mutants(root) if not args.no_hand else []
    for target in TARGETS:
        if args.module and not any(m in target.path for m in args.module):
            continue
        mutants = [] if args.hand_only else mutants_of(root, target.path, target.functions, args.wide)
        mutants += [m for m in hand if m.path == target.path]
        if args.function:
            mutants = [m for m in mutants if any(f in m.function for f in args.function)]
        if args.line:
            mutants = [m for m in mutants if m.line in args.line]
        for m in mutants:
            known = previous.get(m.key, [])
            why = EQUIVALENT.get(m.key + (m.context,)) or EQUIVALENT.get(m.key)
            if why:
                m.status, m.detail = "equivalent", why
            elif known and (args.resume or "survived" not in known):
                m.status, m.detail = known[0], "in the earlier run"
        chosen.append((target, mutants))
    return chosen


def _previous(path: str | None) -> dict[tuple, list[str]]:
    """The outcomes of an earlier run's JSON, by mutant."""
    if not path:
        return {}
    outcomes: dict[tuple, list[str]] = {}
    for entry in json.loads(Path(path).read_text()):
        outcomes.setdefault((entry["path"], entry["function"], entry["old"], entry["new"]), []).append(entry["status"])
    return outcomes


def _save(path: str | None, results: list[Mutant]) -> None:
    """Every outcome so far, as JSON (written after each mutant: a run stopped half-way keeps what it found)."""
    if path:
        Path(path).write_text(json.dumps([{k: v for k, v in asdict(m).items() if k != "text"} for m in results],
                                         indent=1))


def _summary(results: list[Mutant]) -> str:
    lines = [f"{'module':<44} {'mutants':>7} {'killed':>7} {'timeout':>7} {'survived':>8} {'equiv':>5} "
             f"{'kill rate':>9}"]
    for path in dict.fromkeys(m.path for m in results):
        lines.append(_row(path, [m for m in results if m.path == path]))
    lines.append(_row("all", results))
    return "\n".join(lines)


def _row(name: str, mutants: list[Mutant]) -> str:
    count = {s: sum(m.status == s for m in mutants) for s in ("killed", "timeout", "survived", "equivalent")}
    ran = count["killed"] + count["timeout"] + count["survived"]
    rate = f"{100 * (count['killed'] + count['timeout']) / ran:.1f}%" if ran else "-"
    return (f"{name:<44} {len(mutants):>7} {count['killed']:>7} {count['timeout']:>7} {count['survived']:>8} "
            f"{count['equivalent']:>5} {rate:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", action="append", help="only targets whose path contains this (repeatable)")
    parser.add_argument("--function", action="append", help="only functions whose name contains this")
    parser.add_argument("--line", action="append", type=int, help="only mutants on this line (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests; run nothing")
    parser.add_argument("--hand-only", action="store_true", help="only the mutants written by hand")
    parser.add_argument("--no-hand", action="store_true", help="leave out the mutants written by hand")
    parser.add_argument("--wide", action="store_true", help="swap arithmetic and bitwise operators too")
    parser.add_argument("--json", help="write every mutant's outcome to this file")
    parser.add_argument("--rerun", metavar="JSON", help="run only what an earlier run's JSON lists as survived, or "
                        "does not list (a mutant of changed code); count the rest as it found them")
    parser.add_argument("--resume", metavar="JSON", help="run only what an earlier (stopped) run's JSON does not list")
    parser.add_argument("--at", metavar="REV", help="mutate the code and run the tests of this commit (the tool and "
                        "its targets stay the worktree's; tests it does not have are left out), e.g. the kill rate "
                        "before a branch's tests: --at $(git merge-base main HEAD)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = parser.parse_args(argv)
    if args.list:
        for target, mutants in _selected(args, ROOT):
            print(f"{target.path}: {len(mutants)} mutants; tests: {' '.join(target.tests)}")
            for m in mutants:
                print(f"  {m.describe()}" + (f"  [{m.status}: {m.detail}]" if m.status else ""))
        return 0
    work = Workspace(at=args.at, keep=args.keep)
    try:
        return _run(work, _selected(args, work.repo), args)
    finally:
        work.close()


def _run(work: Workspace, chosen, args) -> int:
    results: list[Mutant] = []
    total = sum(len(ms) for _, ms in chosen)
    print(f"mutate: {total} mutants in {len(chosen)} modules; scratch copy {work.dir}", flush=True)
    work.warm()
    try:
        done = 0
        for target, mutants in chosen:
            tests = tuple(t for t in target.tests if (work.repo / t.split("::")[0]).exists())
            for attempt in range(2):  # once more after a failure: a test may have met a busy machine
                outcome, seconds, failed = work.run_tests(tests, work.base_cache, 1800)
                print(f"== {target.path}: unmutated tests {outcome} in {seconds:.1f} s", flush=True)
                if outcome == "passed":
                    break
                print(f"   {failed}", flush=True)
            else:
                print("   skipped: the tests fail without a mutant", flush=True)
                continue
            timeout_s = TIMEOUT_FACTOR * seconds + COMPILE_S
            for m in mutants:
                done += 1
                if not m.status:
                    work.run_mutant(m, tests, timeout_s)
                results.append(m)
                _save(args.json, results)
                print(f"[{done:>4}/{total}] {m.status:<10} {m.describe()}  {m.seconds:.1f} s"
                      + (f"  {m.detail}" if m.detail else ""), flush=True)
    except KeyboardInterrupt:
        print("mutate: stopped; what ran so far is below (and in --json)", flush=True)
    print("\n" + _summary(results))
    survivors = [m for m in results if m.status == "survived"]
    if survivors:
        print("\nsurvivors:\n" + "\n".join(f"  {m.describe()}" for m in survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
