# Run: .venv/bin/python -m pytest tests/test_layout.py   (~3 s, no ranks)
"""labsupport's layout by chapter topic: imports run from later layers to earlier ones only.

Layers, lowest first (labsupport/README.md draws them):
  base         launch/, _patch, _aliases, plots: running ranks, and the book's renderer
  instruments  flat modules used by many chapters (calls, timeline, traffic, overlap,
               models, ...) and the grading core (checks, diagnosis, deadlock)
  topics       one folder per chapter, in the book's order: a topic imports only
               itself, the layers below and earlier chapters' topics
  top          the assignment graders, the benchmarks' CLI, the package's __init__
The imports are read from the source (every ``import`` statement, those inside
functions too), so a lazy import cannot hide a cycle.
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
GRADING_CORE = {"labsupport.grading", "labsupport.grading.checks",
                "labsupport.grading.diagnosis", "labsupport.grading.deadlock"}


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
    if name in GRADING_CORE or len(parts) == 2 and head != "__main__":
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


def test_the_checks_find_what_they_look_for():
    """The walker, the layer rule and the cycle finder on made-up input (they can fail)."""
    mods = {"labsupport.models", "labsupport.ring.ring", "labsupport.zero.zero",
            "labsupport.zero"}
    src = "def f():\n    from labsupport.zero import zero\nimport labsupport.ring.ring\n"
    assert imports_of(src, mods) == {"labsupport.zero.zero", "labsupport.ring.ring"}
    assert layer("labsupport.models")[0] < layer("labsupport.ring.ring")[0] \
        < layer("labsupport.zero.zero")[0] < layer("labsupport.grading.zero2_overlap")[0]
    assert layer("labsupport.launch.strict_p2p")[0] == 0
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
                                 "labsupport.tp_gpt"])
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
             "planner = ls.planner\n", namespace)
    assert namespace["moe"].__name__ == "labsupport.expert_parallel.moe"
    assert namespace["zero_bubble"].__name__ == "labsupport.pipeline.zero_bubble"
    assert namespace["lse_merge"].__module__ == "labsupport.context_parallel.ring_attention"
    assert namespace["planner"].__name__ == "labsupport.device_mesh.planner"
