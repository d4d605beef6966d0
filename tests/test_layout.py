"""The house rules of the code's layout: imports run one way between rooms, packages meet at public modules,
modules stay small, functions that are not kernels stay short, and every package says its public names in
``__all__``.

Rooms, from the top: ``engram_engines`` (the serving engines' plugins) -> ``engram_model`` -> ``engram_store.compat`` -> ``engram_store.tables`` ->
``engram_store.client`` -> ``engram_store.segment`` and ``engram_store.master`` -> ``engram_store.raw`` (the raw read channel's
both ends and its frame: the client and segment rooms use it) -> ``engram_store.wire`` and ``engram_store.disk``
-> ``engram_store.kernels`` -> the ground modules (errors, units, config, metrics, pages,
progress: kernels raise the project's errors). A module may import its own room and rooms below it, never one
above, and only through the room's door: its package or its public modules, not its private ones.
"""
from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Each room's level: imports go to rooms of a lower level (or the same room).
LEVELS = {"engines": 9, "model": 8, "compat": 7, "tables": 6, "client": 5, "segment": 4, "master": 4, "raw": 3,
          "wire": 2, "disk": 2, "kernels": 1, "ground": 0}
#: Modules that tie rooms together on purpose: the package surface, the test and warm-up helpers.
JOINERS = {"engram_store", "engram_store.testing", "engram_store.warmup", "engram_model.warmup"}
MAX_LINES = 550
#: A function longer than this (a Numba kernel aside) is split into named steps.
MAX_FUNCTION_LINES = 60
#: ``EngramStore`` checks arguments and hands the rest on: its work lives in the rooms behind it.
MAX_FACADE_LINES = 300


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "engram_model":
        return "model"
    if parts[0] == "engram_engines":
        return "engines"
    if parts[0] != "engram_store":
        return None
    if len(parts) > 1 and parts[1] in LEVELS:
        return parts[1]
    return "ground"


def _modules():
    for package in ("engram_store", "engram_model", "engram_engines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            yield name.removesuffix(".__init__"), path


def _imports(name: str, path: Path):
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(package, node)
            # ``from .. import kernels`` names a room by the imported name
            yield from ([f"{target}.{alias.name}" for alias in node.names] if not node.module else [target])
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _absolute(package: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``package`` imports from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_imports_run_one_way_between_rooms():
    upward = []
    for name, path in _modules():
        if name in JOINERS:
            continue
        room = _room(name)
        for target in _imports(name, path):
            other = _room(target)
            if other is not None and other != room and LEVELS[other] >= LEVELS[room]:
                upward.append(f"{name} ({room}) imports {target} ({other})")
    assert not upward, "imports against the direction of the rooms:\n" + "\n".join(upward)


def test_rooms_meet_at_their_doors():
    """A module imports another room's names from that room's package or its public modules (no underscore), never
    from its private modules or by a private name: what a room keeps private may change without the others knowing.
    The ground modules (errors, units, config, ...) are everyone's."""
    private = []
    for name, path in _modules():
        if name in JOINERS:
            continue
        room = _room(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _absolute(package, node)
            other = _room(target)
            if other in (None, room, "ground"):
                continue
            inner = [part for part in target.split(".") if part.startswith("_")]
            names = [alias.name for alias in node.names if alias.name.startswith("_")]
            if inner or names:
                private.append(f"{name} ({room}) imports {', '.join(a.name for a in node.names)} from {target} ({other})")
    assert not private, "imports through another room's private modules or names:\n" + "\n".join(private)


#: The top packages: each reaches another only through its public modules.
TOP_PACKAGES = {"engram_store", "engram_model", "engram_engines"}


def _private_reaches(name: str, path: Path):
    """(line, dotted path) of each import in ``name`` of another top package's private module: a dotted path with a
    part that starts with ``_`` (``from engram_store import _peers`` reaches ``engram_store._peers``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    others = TOP_PACKAGES - {name.split(".")[0]}

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] in others and any(part.startswith("_") and part != "__future__" for part in parts)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(package, node)
            paths = [target] if private(target) else [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            paths = [alias.name for alias in node.names]
        else:
            continue
        yield from ((node.lineno, dotted) for dotted in paths if private(dotted))


def test_packages_import_one_way():
    """``engram_engines`` -> ``engram_model`` -> ``engram_store``, joiners included: the store (its master, segments
    and embedded cluster among it) never imports a model family or an engine plugin, and a model never an engine."""
    above = {"engram_store": ("engram_model", "engram_engines"), "engram_model": ("engram_engines",),
             "engram_engines": ()}
    back = [f"{path.relative_to(ROOT)} imports {target}" for name, path in _modules()
            for target in _imports(name, path) if target.split(".")[0] in above[name.split(".")[0]]]
    assert not back, "imports that run back up between packages:\n" + "\n".join(back)
    assert not (ROOT / "master").exists(), "the master is a room of engram_store (engram_store/master), not a package"


def test_packages_meet_at_public_modules():
    """``engram_model`` and ``engram_engines`` use what ``engram_store`` (and ``engram_model``) give them
    through public modules (``engram_store.errors``, ``.cli``, ``.units``, ...): the underscore marks what may change
    inside a package without the others knowing."""
    reaches = [f"{path.relative_to(ROOT)}:{line}: imports {dotted}"
               for name, path in _modules() if name.split(".")[0] in ("engram_model", "engram_engines")
               for line, dotted in _private_reaches(name, path)]
    assert not reaches, "imports of another package's private modules:\n" + "\n".join(reaches)


def test_modules_stay_small():
    large = [f"{path.relative_to(ROOT)}: {n} lines" for _, path in _modules()
             if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not large, "modules over the house limit of ~500 lines:\n" + "\n".join(large)


def _is_kernel(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``njit`` (bare, called, or as an attribute): a Numba kernel, whose loops read as one."""
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) == "njit":
            return True
    return False


def _long_functions(node: ast.AST, path: Path, prefix: str = ""):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = child.end_lineno - child.lineno + 1
            if lines > MAX_FUNCTION_LINES and not _is_kernel(child):
                yield f"{path.relative_to(ROOT)}:{child.lineno}: {prefix}{child.name} is {lines} lines"
            yield from _long_functions(child, path, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _long_functions(child, path, f"{prefix}{child.name}.")
        else:
            yield from _long_functions(child, path, prefix)


def test_functions_stay_short():
    """A function that is not a kernel fits a screen: a longer one is split into steps with names."""
    long = [line for _, path in _modules() for line in _long_functions(ast.parse(path.read_text()), path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (not kernels):\n" + "\n".join(long)


def test_the_engram_store_facade_stays_a_facade():
    path = ROOT / "engram_store" / "tables" / "_store.py"
    (cls,) = [node for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.ClassDef) and node.name == "EngramStore"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < MAX_FACADE_LINES, (f"EngramStore is {lines} lines (under {MAX_FACADE_LINES}): move its work into "
                                      "the tables room's modules behind it")


@pytest.mark.parametrize("package", ["engram_store", "engram_store.wire", "engram_store.raw", "engram_store.segment",
                                     "engram_store.client", "engram_store.tables", "engram_store.compat",
                                     "engram_store.disk", "engram_store.kernels", "engram_store.master", "engram_model",
                                     "engram_model.demo", "engram_model.v41", "engram_model.ple", "engram_engines",
                                     "engram_engines.v41"])
def test_every_package_names_its_public_surface(package):
    module = importlib.import_module(package)
    assert isinstance(getattr(module, "__all__", None), list) and module.__all__, f"{package} has no __all__"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


#: The raw read channel's kernels, which stay with the other kernels (the raw room hands them its frame's kinds).
RAW_KERNELS = {"engram_store.kernels.raw_io", "engram_store.kernels._raw_twins"}


def test_the_raw_channel_lives_in_one_room():
    """Both ends of the raw read channel and the one description of its frame are ``engram_store.raw``; its kernels
    are ``kernels.raw_io`` (and their twins). A module elsewhere named for the channel, or one that spells the
    frame's magic itself, is a piece of the channel outside its room."""
    def in_room(name: str) -> bool:
        return name.split(".")[:2] == ["engram_store", "raw"] or name in RAW_KERNELS

    named = [name for name, _ in _modules() if not in_room(name)
             and any(part.lstrip("_").startswith("raw") for part in name.split(".")[1:])]
    magic = [name for name, path in _modules() if not in_room(name) and 'b"ENGR"' in path.read_text()]
    assert not named and not magic, ("the raw channel outside engram_store.raw:\n"
                                     + "\n".join(named + [f"{name} spells the frame's magic" for name in magic]))


#: Every model family (a package under ``engram_model``) names its modules by role, the same name for the same role:
#: these it has all, each package's ``warmup()`` behind ``_warmup``.
FAMILY_ROLES = ("_config", "_hasher", "_kernels", "_checkpoint", "_layer", "_warmup")
#: Other names for the roles above, which a family does not use.
ROLE_SYNONYMS = {"_engram": "_layer", "_layers": "_layer", "_hashing": "_hasher", "_hash": "_hasher",
                 "_model": "_layer", "_ckpt": "_checkpoint", "_cfg": "_config", "_warm": "_warmup"}


def _families() -> list[str]:
    return sorted(path.parent.name for path in (ROOT / "engram_model").glob("*/__init__.py"))


def test_model_families_share_one_inner_layout():
    """Each family (``demo``, ``v41``, ``ple``, ...) holds the same role modules under the same names, says its
    public surface in ``__all__`` and compiles its kernels behind ``warmup()``: a newcomer who knows one family
    finds their way in the others."""
    families = _families()
    assert {"demo", "v41", "ple"} <= set(families), families
    problems = []
    for family in families:
        names = {path.stem for path in (ROOT / "engram_model" / family).glob("*.py")}
        problems += [f"engram_model/{family} has no {role}.py" for role in FAMILY_ROLES if role not in names]
        problems += [f"engram_model/{family}/{name}.py: the role's name is {ROLE_SYNONYMS[name]}.py"
                     for name in sorted(names & set(ROLE_SYNONYMS))]
        module = importlib.import_module(f"engram_model.{family}")
        if "warmup" not in getattr(module, "__all__", ()):
            problems.append(f"engram_model.{family} exports no warmup()")
    assert not problems, "model families out of the shared layout:\n" + "\n".join(problems)


def test_the_shared_ground_has_no_twins_in_the_families():
    """The private modules at ``engram_model``'s top are the ground every family shares (row formats and gathers,
    checkpoint files, the tokenizer, ...): none has a family module's name. (The console scripts there are the
    families' doors: ``engram-load`` reads the family from config.json and runs its ``load``.)"""
    top = {path.stem for path in (ROOT / "engram_model").glob("_*.py")} - {"__init__"}
    twins = [f"engram_model/{name}.py and engram_model/{family}/{name}.py" for family in _families()
             for name in sorted(top & {path.stem for path in (ROOT / "engram_model" / family).glob("*.py")})]
    assert not twins, "a shared module and a family module of one name:\n" + "\n".join(twins)


def _family_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engram_model" and parts[1] in _families() else None


def test_families_meet_at_their_doors():
    """No module of ``engram_model`` reaches into a family's private modules from outside that family: another
    family, the shared ground and the console scripts (``warmup``, ``stats``, ``load``) use its package or its
    public modules. What two families share lives in the shared ground, not in one of them."""
    reaches = []
    for name, path in _modules():
        if not name.startswith("engram_model"):
            continue
        home = _family_of(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _absolute(package, node)
            for dotted in [target] if _reaches(target, home) else [f"{target}.{alias.name}" for alias in node.names]:
                if _reaches(dotted, home):
                    reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {dotted}")
    assert not reaches, "imports of another family's private modules:\n" + "\n".join(reaches)


def _reaches(dotted: str, home: str | None) -> bool:
    """Whether ``dotted`` is a private part of a family other than ``home``."""
    family = _family_of(dotted)
    return family not in (None, home) and any(part.startswith("_") for part in dotted.split(".")[2:])


#: The one module that imports ``prometheus_client`` (an engine's dependency, not engram's).
PROMETHEUS_MODULES = {"engram_engines._prometheus"}


def test_only_the_engines_collector_imports_prometheus_client():
    """engram renders its own exposition where no engine runs; only the collector the engines' ``/metrics`` include
    imports ``prometheus_client``, so installing engram needs no Prometheus library."""
    found = [f"{path.relative_to(ROOT)} imports {target}" for name, path in _modules() if name not in PROMETHEUS_MODULES
             for target in _imports(name, path) if target.split(".")[0] == "prometheus_client"]
    assert not found, "prometheus_client imported outside engram_engines._prometheus:\n" + "\n".join(found)


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth of the file: an import inside a function that
    closes a circle is still a circle)."""
    names = {name for name, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in _modules():
        targets = set()
        for target in _imports(name, path):
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + ".") and target + "." not in name:
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_circles():
    """No module imports, through others, a module that imports it (package __init__ files, which only hand names
    on, are not part of a circle)."""
    graph = {n: {t for t in ts if not _is_package(t)} for n, ts in _graph().items() if not _is_package(n)}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def _is_package(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").exists()


def test_the_run_keeps_its_temporary_files_in_its_own_directory(tmp_path_factory, pytestconfig):
    """What tests and their processes write through tempfile lands under the run's base directory, which pytest
    removes when the run passes: nothing is left in the system's temporary directory."""
    import tempfile

    base = tmp_path_factory.getbasetemp()
    assert Path(tempfile.gettempdir()).is_relative_to(base)
    assert Path(os.environ["TMPDIR"]).is_relative_to(base)
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
