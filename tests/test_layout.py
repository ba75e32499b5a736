"""The package's layout, checked from its source: dependencies point one way (models <- decode <- train / eval /
serve <- cli, with config, paths and prompts below them all), no import cycle, package code imported at module level
outside the CLI, engines and proposers built in decode/ only (experiments/ and recipes/ included), one proposer
interface and one verifier, files beside the package importing through it, the native sources included downward only, and files of one concept each (no source
file, Python or C++, over MAX_LINES; experiments/, recipes/ and csrc/ counted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "blockdraft"
MAX_LINES = 450
# files beside the package and native sources: a new one should be a deliberate choice, not sprawl
MAX_FILES = {"experiments": 16, "recipes": 10, "csrc": 10}
# each room and the rooms it may import from (modules at the package root are shared helpers)
ALLOWED = {
    "root": {"root"},
    "prompts": {"root", "prompts"},
    "models": {"root", "models"},
    "decode": {"root", "models", "decode"},
    "export": {"root", "models", "export"},
    "train": {"root", "prompts", "models", "decode", "train"},
    "eval": {"root", "prompts", "models", "decode", "export", "eval"},
    "serve": {"root", "models", "decode", "serve"},
    "cli": {"root", "prompts", "models", "decode", "export", "train", "eval", "serve", "cli"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _room(module: str) -> str:
    if module == "blockdraft.__main__":  # `python -m blockdraft`: the CLI's entry point
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else "root"


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported blockdraft module, at module level) for every import of package code in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] + [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] == "blockdraft":
                out.append((n, id(node) in top))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for m, path in mods.items():
        targets = set()
        for name, top in _imports(m, path):
            while name and name not in mods:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and top and name != m:
                targets.add(name)
        graph[m] = targets
    return graph


def test_dependencies_point_one_way():
    bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
           if _room(t) not in ALLOWED[_room(m)] and not t == "blockdraft"]
    assert not bad, bad


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in graph.get(m, ()):
            if t.startswith(m + "."):  # a package importing its own submodules is not a cycle
                continue
            if state.get(t) == 1 and not m.startswith(t + "."):
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_package_code_is_imported_at_module_level_outside_the_cli():
    local = [f"{m}: {name}" for m, path in _modules().items() if _room(m) != "cli"
             for name, top in _imports(m, path) if not top]
    assert not local, local


# what builds an engine or a proposer: only decode/ does (the one builder, `decode.spec.build_engine`)
BUILDERS = ("Engine(", "DFlashProposer(", "EagleProposer(", "TreeProposer(", "PromptLookupProposer(")


def _beside() -> list[Path]:
    """The runnable files beside the package: experiments/ and recipes/."""
    return sorted(p for d in ("experiments", "recipes") for p in (ROOT / d).glob("*") if p.is_file())


def test_engines_are_built_in_decode_only():
    calls = []
    for path in list(PKG.rglob("*.py")) + [p for p in _beside() if p.suffix == ".py"]:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("src/blockdraft/decode/"):
            continue
        text = path.read_text(encoding="utf-8")
        for b in BUILDERS:
            if b in text.replace(f"class {b}", ""):
                calls.append(f"{rel}: {b}")
    assert not calls, calls


def test_one_proposer_interface_and_one_verifier():
    """Chains and trees go one way: every proposer's `propose` returns a tree, one verifier module walks it, and the
    engine, its rows and its step functions never ask whether a proposer drafts a chain or a tree."""
    decode = PKG / "decode"
    assert not (decode / "verify_tree.py").exists()
    for name in ("engine.py", "row.py", "step.py"):
        text = (decode / name).read_text(encoding="utf-8")
        for word in ("proposes_trees", "propose_tree", "accept_tree", "verify_chain", "Proposal"):
            assert word not in text, f"decode/{name}: {word}"
    for path in (decode / "proposers").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        methods = {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
                   if isinstance(f, ast.FunctionDef)}
        assert not methods & {"propose_tree", "accept_tree"}, path.name


def test_experiments_and_recipes_import_through_the_package():
    # a file beside the package that imports another by its bare module name works only from its own folder and
    # hides shared code from the package's tests: what two of them share belongs in the package
    siblings = {p.stem for p in _beside() if p.suffix == ".py"}
    bare = []
    for path in [p for p in _beside() if p.suffix == ".py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bare += [f"{path.relative_to(ROOT).as_posix()}: {n}" for n in names if n.split(".")[0] in siblings]
    assert not bare, bare


def test_files_hold_one_concept_each():
    csrc = PKG / "models" / "csrc"
    files = list(PKG.rglob("*.py")) + list(csrc.glob("*.[ch]*")) + _beside()
    long = {p.relative_to(ROOT).as_posix(): n for p in files
            if p.is_file() and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long
    counts = {d: len([p for p in (ROOT / d).glob("*") if p.is_file() and not p.name.startswith(".")])
              for d in ("experiments", "recipes")}
    counts["csrc"] = len(list(csrc.glob("*.[ch]*")))
    assert all(counts[d] <= MAX_FILES[d] for d in counts), (counts, MAX_FILES)


def test_native_sources_include_downward_only():
    # the C++ sources form layers too: headers include only headers below them, and bindings.cpp alone defines the
    # Python module (no .cpp includes a .cpp, and the decoder does not reach back into the bindings)
    csrc = PKG / "models" / "csrc"
    order = ["common.h", "chain.h", "q45.h", "q8.h", "vnni.h", "qlinear.h", "stack_ops.h", "decoder.h", "decoder.cpp",
             "bindings.cpp"]
    assert sorted(p.name for p in csrc.glob("*.[ch]*")) == sorted(order), "a native source is not in the order"
    bad = []
    for path in csrc.glob("*.[ch]*"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith('#include "'):
                inc = line.split('"')[1]
                if inc not in order or order.index(inc) >= order.index(path.name) or inc.endswith(".cpp"):
                    bad.append(f"{path.name} includes {inc}")
    assert not bad, bad
    modules = [p.name for p in csrc.glob("*.cpp") if "PYBIND11_MODULE" in p.read_text(encoding="utf-8")]
    assert modules == ["bindings.cpp"], modules
