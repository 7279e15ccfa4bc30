# Run: .venv/bin/python -m pytest tests/test_layout.py   (~3 s, no ranks)
"""labsupport's layout by chapter topic: imports run from later layers to earlier ones only.

Layers, lowest first (labsupport/README.md draws them):
  base         launch/, _patch, _aliases, plots: running ranks, and the book's renderer
  instruments  flat modules used by many chapters (calls, timeline, traffic, overlap,
               models, ...) and the checking core (checking/: collective_checks,
               diagnosis, deadlock, held)
  topics       one folder per chapter, in the book's order: a topic imports only
               itself, the layers below and earlier chapters' topics
  top          the assignment graders, the benchmarks' CLI, the package's __init__
The imports are read from the source (every ``import`` statement, those inside
functions too), so a lazy import cannot hide a cycle. No exception is listed:
0 imports run upward and 0 folders import each other in a loop.
"""
import ast
import pathlib
import warnings

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "labsupport"
TOPICS = ["memory", "collectives", "ring", "data_parallel", "tensor_parallel", "pipeline",
          "context_parallel", "zero", "device_mesh", "expert_parallel", "checkpoints",
          "capstone", "debugging"]
BASE = {"launch", "_patch", "_aliases", "plots"}
INSTRUMENT_FOLDERS = {"checking"}       # folders among the flat instruments


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(source, modules=MODULES):
    """The package's modules that ``source`` imports (``from pkg import sub`` -> pkg.sub)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found


def layer(name):
    """(rank, label): a module may import only modules of a lower or equal rank."""
    parts = name.split(".")
    head = parts[1] if len(parts) > 1 else ""
    if head in BASE:
        return 0, "base"
    if head in TOPICS:
        return 2 + TOPICS.index(head), f"topic {head} (chapter {TOPICS.index(head)})"
    if head in INSTRUMENT_FOLDERS or len(parts) == 2 and head != "__main__":
        return 1, "instruments"
    return 99, "top"


def graph():
    return {name: imports_of(path.read_text()) - {name} for name, path in MODULES.items()}


def test_every_import_runs_from_a_later_layer_to_an_earlier_one():
    upward = [f"{m} ({layer(m)[1]}) imports {x} ({layer(x)[1]})"
              for m, targets in graph().items() for x in sorted(targets)
              if layer(x)[0] > layer(m)[0]
              # a package's __init__ re-exports its own modules
              and not x.startswith(m + ".")]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_module_imports_the_package_itself():
    """``import labsupport`` from inside would import every layer at once (the README's rule)."""
    offenders = [m for m, targets in graph().items() if "labsupport" in targets
                 and m != "labsupport"]
    assert not offenders, offenders


def find_cycle(edges):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_there_is_no_import_cycle():
    # a package's __init__ importing its own modules is not a cycle of ideas: drop those
    edges = {m: {x for x in t if not x.startswith(m + ".") and not m.startswith(x + ".")}
             for m, t in graph().items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def folder_of(name):
    """The room a module stands in: its folder under labsupport/, or the flat module itself."""
    return ".".join(name.split(".")[:2])


def folder_graph(modules_graph):
    """Folder -> the folders its modules import (a folder's imports of itself left out)."""
    edges = {}
    for m, targets in modules_graph.items():
        edges.setdefault(folder_of(m), set()).update(
            folder_of(x) for x in targets if folder_of(x) != folder_of(m))
    return edges


def test_no_two_folders_import_each_other():
    """A loop of folders (pipeline/ -> grading/ -> pipeline/) puts one chapter on both
    sides of another, even when no two modules import each other."""
    edges = folder_graph(graph())
    edges.pop("labsupport", None)          # the package's face imports every folder
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_the_checks_find_what_they_look_for():
    """The walker, the layer rule and the cycle finder on made-up input (they can fail)."""
    mods = {"labsupport.models", "labsupport.ring.ring", "labsupport.zero.zero",
            "labsupport.zero"}
    src = "def f():\n    from labsupport.zero import zero\nimport labsupport.ring.ring\n"
    assert imports_of(src, mods) == {"labsupport.zero.zero", "labsupport.ring.ring"}
    assert layer("labsupport.models")[0] < layer("labsupport.ring.ring")[0] \
        < layer("labsupport.zero.zero")[0] < layer("labsupport.grading.zero2_overlap")[0]
    assert layer("labsupport.launch.strict_p2p")[0] == 0
    assert layer("labsupport.checking.diagnosis")[0] < layer("labsupport.collectives.checks")[0]
    assert folder_graph({"labsupport.pipeline.checks": {"labsupport.grading.diagnosis"},
                         "labsupport.grading.zb": {"labsupport.pipeline.sim"},
                         "labsupport.grading": {"labsupport.grading.zb"}}) == {
        "labsupport.pipeline": {"labsupport.grading"},
        "labsupport.grading": {"labsupport.pipeline"}}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_each_chapter_topic_is_one_folder_with_its_kinds_of_file():
    kinds = {"crossing.py", "checks.py", "bench.py"}
    for topic in TOPICS:
        folder = PACKAGE / topic
        assert (folder / "__init__.py").is_file(), topic
        assert (folder / "checks.py").is_file(), f"{topic}: its your-turn checks"
        assert {p.name for p in folder.glob("*.py")} - kinds - {"__init__.py"} \
            or topic == "collectives", f"{topic}: no lesson or helper module"
    # the kind folders of the old layout are gone
    assert not list((PACKAGE / "crossings").glob("*.py"))
    assert not list((PACKAGE / "grading" / "chapters").glob("*.py"))


@pytest.mark.parametrize("old", ["labsupport.moe", "labsupport.ring_attention",
                                 "labsupport.zero_bubble", "labsupport.sharded_checkpoint",
                                 "labsupport.tp_gpt", "labsupport.grading.checks",
                                 "labsupport.grading.diagnosis", "labsupport.grading.held"])
def test_released_assignments_old_paths_still_import_for_one_term(old):
    import importlib

    from labsupport import _aliases
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(_aliases.OLD_PATHS[old])
    assert any("moved to" in str(w.message) for w in caught) or old in _seen_before(old)


def _seen_before(old):
    """An alias imported earlier in this process warns only at its first import."""
    import sys
    return {old} if sys.modules.get(old) is not None else set()


def test_old_attribute_and_from_imports_of_the_released_notebooks_work():
    """The exact lines of the assignment notebooks released before the move."""
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from labsupport import moe\n"
             "from labsupport import zero_bubble\n"
             "from labsupport.ring_attention import block_attention, lse_merge\n"
             "from labsupport.ring import ring_allreduce\n"
             "import labsupport as ls\n"
             "planner = ls.planner\n"
             "from labsupport.grading import checks, held\n"
             "from labsupport.grading.diagnosis import TIMEOUT, name_of\n"
             "timeout, run = ls.grading.TIMEOUT, ls.grading.run\n", namespace)
    assert namespace["moe"].__name__ == "labsupport.expert_parallel.moe"
    assert namespace["zero_bubble"].__name__ == "labsupport.pipeline.zero_bubble"
    assert namespace["lse_merge"].__module__ == "labsupport.context_parallel.ring_attention"
    assert namespace["planner"].__name__ == "labsupport.device_mesh.planner"
    assert namespace["checks"].__name__ == "labsupport.checking.collective_checks"
    assert namespace["held"].__name__ == "labsupport.checking.held"
    assert namespace["TIMEOUT"] == namespace["timeout"]
    assert namespace["run"] is namespace["checks"].run


def test_every_folder_and_module_resolves_as_an_attribute_of_the_package():
    """``ls.<topic>`` for every topic folder (``ls.capstone`` once raised AttributeError:
    a hand-written list had forgotten it), and every grader as ``ls.grading.<name>``."""
    import importlib

    import labsupport as ls
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert set(TOPICS) <= set(folders)
    for name in folders:
        assert getattr(ls, name) is importlib.import_module(f"labsupport.{name}"), name
    graders = {p.stem if p.name != "__init__.py" else p.parent.name
               for p in [*(PACKAGE / "grading").glob("*.py"),
                         *(PACKAGE / "grading").glob("*/__init__.py")]} - {"__init__", "grading"}
    for name in graders:
        assert getattr(ls.grading, name).__name__ == f"labsupport.grading.{name}"


def test_no_registry_names_a_missing_module():
    """The tables that name modules by string: the package's and the graders' lazy
    attributes, the old paths of ``_aliases`` and the benchmarks' names."""
    import importlib.util

    import labsupport as ls
    from labsupport import _aliases
    from labsupport.bench.__main__ import BENCHMARKS
    named = ([f"labsupport.{n}" for n in ls._SUBMODULES]
             + [f"labsupport.grading.{n}" for n in ls.grading._GRADERS]
             + list(_aliases.OLD_PATHS.values()) + list(BENCHMARKS.values()))
    missing = [n for n in named if importlib.util.find_spec(n) is None]
    assert not missing, missing
    # an old path is only an alias where no module of that name exists any more
    assert not [old for old in _aliases.OLD_PATHS if old in MODULES]
    # and an attribute that names nothing says so
    with pytest.raises(AttributeError, match="chapters"):
        _ = ls.grading.chapters
