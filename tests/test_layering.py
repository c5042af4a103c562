"""The package's import rule, read from the source (ast): imports flow one way,
server -> engine -> model -> layers -> ops -> kernels -> formats, and the serving path never
imports the oracle (``dsv4.reference``): only its twins (``dsv4.ops.twins``, the ``*_torch``
functions beside the kernels), ``dsv4.tools`` and the tests do."""
from __future__ import annotations

import ast
import functools
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "dsv4"

# a module may import modules of its own or a lower rank
RANK = {"config": 0, "formats": 0, "parallel": 0, "kernels": 1, "checkpoint": 1, "tokenizer": 1, "ops": 2, "layers": 3,
        "model": 4, "engine": 5, "models": 5, "server": 6}
NOT_SERVING = {"reference", "tools", "cli", "__init__", "__main__"}    # the oracle, tools, entry points
TWIN_MODULES = {"dsv4.ops.twins"}


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), f


@functools.lru_cache(maxsize=None)
def _tree(f: pathlib.Path) -> ast.Module:
    return ast.parse(f.read_text())


def _imports(mod: str, f: pathlib.Path):
    """(imported dsv4 module, enclosing function name or None) for every import in ``f``."""
    base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
    tree = _tree(f)
    parents = {}
    for node in ast.walk(tree):
        for ch in ast.iter_child_nodes(node):
            parents[ch] = node

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
            names = [target + "." + a.name for a in node.names] if not node.module else [target]
            for t in names:
                if t.startswith("dsv4."):
                    yield t, func_of(node)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv4."):
                    yield a.name, func_of(node)


def _top(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else "__init__"


def test_serving_path_never_imports_the_reference():
    bad = []
    for mod, f in _modules():
        if _top(mod) in NOT_SERVING or mod in TWIN_MODULES:
            continue
        for t, fn in _imports(mod, f):
            if _top(t) == "reference" and not (fn or "").endswith("_torch"):
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


def test_the_rule_sees_a_violation(tmp_path):
    """The reader finds relative imports inside functions (what the rules above are made of)."""
    f = tmp_path / "mod.py"
    f.write_text("def g():\n    from ..reference.model import ReferenceModel\n")
    assert list(_imports("dsv4.engine.mod", f)) == [("dsv4.reference.model", "g")]


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
