"""The package's import rules, read from the source (ast):

* imports flow one way: server -> engine -> model -> layers -> ops -> kernels / twins -> formats;
* the serving path never imports the oracle (``dsv4.reference``): only the twins (``dsv4.twins``),
  ``dsv4.tools`` and the tests do; the kernels import neither the twins nor the reference;
* model/ and layers/ call ops only through the op table: they import neither kernels/ nor twins/,
  and only ops/ (and the tools) import them;
* no module imports another module's ``_private`` name (``from m import _x`` or ``m._x``);
* twins/ mirrors kernels/ file by file, and every op of the registry names a kernel and a twin with
  the same arguments.
"""
from __future__ import annotations

import ast
import functools
import inspect
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "dsv4"

# a module may import modules of its own or a lower rank
RANK = {"config": 0, "formats": 0, "parallel": 0, "kernels": 1, "twins": 1, "checkpoint": 1, "tokenizer": 1,
        "ops": 2, "layers": 3, "model": 4, "engine": 5, "models": 5, "server": 6}
NOT_SERVING = {"reference", "tools", "cli", "__init__", "__main__"}    # the oracle, tools, entry points


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), f


@functools.lru_cache(maxsize=None)
def _tree(f: pathlib.Path) -> ast.Module:
    return ast.parse(f.read_text())


def _parents(tree):
    parents = {}
    for node in ast.walk(tree):
        for ch in ast.iter_child_nodes(node):
            parents[ch] = node
    return parents


def _imports(mod: str, f: pathlib.Path, names: bool = False):
    """(imported dsv4 module, enclosing function name or None) for every import in ``f``; with
    ``names`` (module, imported name) for every ``from m import name``."""
    base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
    tree = _tree(f)
    parents = _parents(tree)

    def func_of(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                b = base[:len(base) - (node.level - 1)]
                target = ".".join(b + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("dsv4"):
                continue
            if names:
                for a in node.names:
                    yield target, a.name
                continue
            for t in ([target + "." + a.name for a in node.names] if not node.module else [target]):
                yield t, func_of(node)
        elif isinstance(node, ast.Import) and not names:
            for a in node.names:
                if a.name.startswith("dsv4."):
                    yield a.name, func_of(node)


def _top(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else "__init__"


def test_serving_path_never_imports_the_reference():
    bad = []
    for mod, f in _modules():
        if _top(mod) in NOT_SERVING | {"twins"}:
            continue
        for t, fn in _imports(mod, f):
            if _top(t) == "reference":
                bad.append(f"{mod} imports {t}" + (f" in {fn}()" if fn else ""))
    assert not bad, "\n".join(bad)


def test_imports_flow_one_way():
    bad = []
    for mod, f in _modules():
        src = _top(mod)
        if src not in RANK:
            continue
        for t, _fn in _imports(mod, f):
            dst = _top(t)
            if dst in NOT_SERVING - {"reference"}:
                bad.append(f"{mod} imports {t} (a tool / entry point)")
            elif dst in RANK and RANK[dst] > RANK[src]:
                bad.append(f"{mod} ({src}) imports {t} ({dst}, a layer above)")
    assert not bad, "\n".join(bad)


def test_kernels_and_twins_are_reached_only_through_the_op_table():
    """model/ and layers/ (and everything but ops/ and the tools) import neither kernels/ nor
    twins/; kernels/ and twins/ do not import each other."""
    bad = []
    for mod, f in _modules():
        src = _top(mod)
        for t, _fn in _imports(mod, f):
            dst = _top(t)
            if dst in ("kernels", "twins") and src not in ("ops", "tools", dst):
                bad.append(f"{mod} imports {t}")
    assert not bad, "\n".join(bad)


# left to the checkpoint package's own refactor (one V4 tensor tree in checkpoint/schema.py)
KNOWN_PRIVATE = {"dsv4.checkpoint.synthetic imports dsv4.checkpoint.writer._to_nvfp4"}


def test_no_module_imports_another_modules_private_name():
    bad = []
    modules = {m for m, _ in _modules()}
    for mod, f in _modules():
        for src, name in _imports(mod, f, names=True):
            if name.startswith("_") and not name.startswith("__") and src + "." + name not in modules:
                bad.append(f"{mod} imports {src}.{name}")
        tree = ast.parse(f.read_text())
        imported = {}                     # local name -> dsv4 module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
                pkg = ".".join(base[:len(base) - (node.level - 1)] + [node.module]) if node.level else node.module
                for a in node.names:
                    if pkg + "." + a.name in modules:
                        imported[a.asname or a.name] = pkg + "." + a.name
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
                pkg = ".".join(base[:len(base) - (node.level - 1)])
                for a in node.names:
                    imported[a.asname or a.name] = pkg + "." + a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{mod} reads {imported[node.value.id]}.{node.attr}")
    bad = [b for b in bad if b not in KNOWN_PRIVATE]
    assert not bad, "\n".join(bad)


def test_twins_mirror_kernels_file_by_file():
    twins = {p.stem for p in (PKG / "twins").glob("*.py")} - {"__init__", "lib"}
    kernels = {p.stem for p in (PKG / "kernels").glob("*.py")} | {p.name for p in (PKG / "kernels").iterdir()
                                                                   if p.is_dir() and (p / "__init__.py").exists()}
    assert twins <= kernels, f"twins without a kernel file: {sorted(twins - kernels)}"
    from dsv4.ops.registry import OPS
    for spec in OPS.values():
        kmod, kfn = spec.kernel.split(":")
        tmod, tfn = spec.twin.split(":")
        assert kmod.split(".", 1)[1] == tmod.split(".", 1)[1] and kfn == tfn, spec


def _required(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_registry_kernels_and_twins_take_the_same_arguments():
    """Every op's twin takes the kernel's required arguments, in order and by name, and every keyword
    the kernel has; the portable form takes the same arguments, the ``takes`` predicate accepts them."""
    import pytest
    pytest.importorskip("triton")
    from dsv4.ops.registry import OPS
    for spec in OPS.values():
        k, t = spec.load("kernel"), spec.load("twin")
        assert _required(k) == _required(t), (spec.name, _required(k), _required(t))
        twin_params = inspect.signature(t).parameters
        has_var_kw = any(p.kind == p.VAR_KEYWORD for p in twin_params.values())
        for name in inspect.signature(k).parameters:       # every kernel keyword the twin accepts
            assert name in twin_params or has_var_kw, (spec.name, name)
        if spec.portable:
            assert _required(spec.load("portable")) == _required(k), spec.name
        if spec.takes:     # the predicate is called with the op's arguments
            inspect.signature(spec.load("takes")).bind(*_required(k))


def test_the_rules_see_a_violation(tmp_path):
    """The reader finds relative imports inside functions and imported private names (what the rules
    above are made of)."""
    f = tmp_path / "mod.py"
    f.write_text("def g():\n    from ..reference.model import ReferenceModel\nfrom .lib import _x\n")
    assert sorted(_imports("dsv4.engine.mod", f), key=str) == [("dsv4.engine.lib", None),
                                                                ("dsv4.reference.model", "g")]
    assert sorted(_imports("dsv4.engine.mod", f, names=True)) == [("dsv4.engine.lib", "_x"),
                                                                   ("dsv4.reference.model", "ReferenceModel")]


# third-party modules dsv4 may import without declaring them: the GPU kernels' triton comes with
# the CUDA builds of torch (and the test extra), and the ops table imports the kernels only on a GPU
UNDECLARED_OK = {"triton": "the GPU kernels (CUDA builds of torch bring it)"}


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level third-party module -> the dsv4 modules that import it, except imports inside a
    ``try`` that handles ImportError (optional features, e.g. matplotlib for ``bench --plot``)."""
    import sys
    out: dict[str, list[str]] = {}
    for mod, f in _modules():
        tree = _tree(f)
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    "ImportError" in ast.dump(h.type or ast.Name("ImportError")) for h in node.handlers):
                guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                top = name.split(".")[0]
                if top != "dsv4" and top not in sys.stdlib_module_names:
                    out.setdefault(top, []).append(mod)
    return out


def test_every_third_party_import_is_an_install_dependency():
    """What ``pip install -e .`` installs covers every module dsv4 imports: each is a base
    dependency in pyproject.toml or required by one (``dsv4 bench serve``'s httpx, the chat
    template's jinja2, the Hub's huggingface_hub included)."""
    import importlib.metadata as md
    import re
    import tomllib

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()
    deps = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    installed, todo = set(), [norm(Requirement(d).name) for d in deps]
    while todo:                       # the base dependencies and what they require (no extras)
        d = todo.pop()
        if d in installed:
            continue
        installed.add(d)
        for r in md.requires(d) or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    dists = md.packages_distributions()
    bad = [f"{top} (imported by {', '.join(sorted(set(mods)))}) comes from {dists.get(top)}"
           for top, mods in _third_party_imports().items()
           if top not in UNDECLARED_OK and not any(norm(d) in installed for d in dists.get(top, []))]
    assert not bad, "\n".join(bad)
    assert {"httpx", "jinja2", "huggingface_hub"} <= set(_third_party_imports())
