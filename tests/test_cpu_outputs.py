# Run: .venv/bin/python -m pytest tests/test_cpu_outputs.py   (~5 s, no kernel)
"""No chapter stores an output that another CPU would print differently (issue 34).

nbval compares every chapter's outputs with the stored ones; on another x86-64
CPU the last bits of a matmul or a LayerNorm differ, so a loss printed with 8
digits or a count of parameters equal bit for bit fails there. This reads the
stored notebooks (tests/cpu_outputs.py says what it looks for) and fails on
each such output that tests/nbval_sanitize.cfg does not mask and ALLOWED does
not explain. The slow, complete check is `make test-portable` (nbval under
three instruction-set settings); this one is cheap enough for every run.
"""
import importlib.util
import os
from dataclasses import dataclass

import nbformat
import pytest
import torch

from cpu_outputs import ROOT, findings, notebook_findings, sanitizer, significant_digits
from labsupport import plots
from nbtools import chapter_notebooks


@dataclass(frozen=True)
class Allowed:
    notebook: str   # the file's stem
    matches: str    # a substring of the finding, as str(Finding) writes it
    reason: str     # why no CPU can change it


ALLOWED = [
    Allowed("00_how_this_book_runs", "figure 'α-β model: time to send one message'",
            "α + S/β for given α, β and integer sizes S in float64, rounded to "
            "4 decimals by NumPy: one division and one addition per point, "
            "each correctly rounded by IEEE 754 on every CPU (no reduction, "
            "no transcendental function, no torch kernel)"),
    Allowed("00_memory", "figure '7B, s=4096, b=1, N=8: GB per device'",
            "labsupport.memory.calc's byte counts (integer formulas) over "
            "1e9: one IEEE division per bar, the same on every CPU"),
    Allowed("08_device_mesh", "figure \"Llama-2 7B shape, 64 H100s: the fastest "
            "layouts' step time\"",
            "labsupport.device_mesh.planner's cost model on the given hardware constants, "
            "in Python floats (+, -, ×, ÷, math.ceil, sum in list order): no "
            "torch or BLAS kernel, so the same bits on every CPU"),
    Allowed("00_memory", "= 16.0012 B/param",
            "a ratio of two byte counts (integers: 1,929,360 B over Ψ), exact "
            "in float64 before it is rounded to 4 decimals"),
    Allowed("07_zero_fsdp", "GB per GPU (paper:",
            "the ZeRO paper's formula on given Ψ and N (Python floats, no "
            "torch kernel), the same on every CPU"),
]


def unexplained(found, allowed=ALLOWED):
    return [f for f in found if not any(
        a.notebook == f.notebook and a.matches in str(f) for a in allowed)]


@pytest.mark.parametrize("path", chapter_notebooks(),
                         ids=[p.stem for p in chapter_notebooks()])
def test_stored_outputs_show_nothing_a_cpu_changes(path):
    bad = unexplained(findings(path))
    assert not bad, (
        "outputs nbval compares that another CPU would print differently: print "
        "what the claim needs (rounded, or a verdict), assert the claim with a "
        "tolerance, mask a true measurement in tests/nbval_sanitize.cfg:\n"
        + "\n".join(map(str, bad[:20])))


def test_every_allowance_explains_a_stored_output():
    found = [f for p in chapter_notebooks() for f in findings(p)]
    for a in ALLOWED:
        assert a.reason.strip()
        assert any(f.notebook == a.notebook and a.matches in str(f)
                   for f in found), f"stale allowance (matches nothing): {a}"


# -- the check itself, on outputs made up here ----------------------------------

def stream_cell(text, tags=()):
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    cell.metadata["tags"] = list(tags)
    return cell


def figure_cell(ys, measured=False, title="losses"):
    bundle = plots.figure_bundle(
        {"data": [{"type": "scatter", "y": ys, "colorscale": [[1 / 6, "#000"]]}],
         "layout": {"title": {"text": title}}}, measured=measured)
    cell = nbformat.v4.new_code_cell("plots.show(fig)")
    cell.outputs = [nbformat.v4.new_output("display_data", data=bundle)]
    return cell


def check(*cells):
    nb = nbformat.v4.new_notebook(cells=list(cells))
    return notebook_findings(nb, "99_made_up", sanitizer())


def test_significant_digits():
    assert significant_digits("38.167927") == 8
    assert significant_digits("0.0025") == 2
    assert significant_digits("1.0000") == 5
    assert significant_digits("4.5e-02") == 2
    assert significant_digits("-1.6516e+38") == 5


@pytest.mark.parametrize("text", [
    "loss 38.167927\n",                      # a float32 loss with all its digits
    "loss 0.460099, 20 parameter tensors\n",  # 6 digits: 1 in ~25 rounds otherwise
    "tensor([0.1234567, 2.0])\n",
    "grad norm 8.142035e-01\n",
    "ZeRO-1: 67 of 68 parameters bit for bit\n",
    "65/68 tensors bit-identical to one process\n",
    "65 parameters bitwise equal\n",
])
def test_flags_what_a_cpu_changes(text):
    found = check(stream_cell(text))
    assert len(found) == 1 and found[0].cell == 0, found


@pytest.mark.parametrize("text", [
    "loss 38.17; lr 0.0025; ratio 1.0047\n",  # rounded to what the claim needs
    "all 15 flat tensors bitwise equal\n",   # a verdict, asserted in the cell
    "every parameter bitwise equal at N = 4\n",
    "torch 2.13.0 on 127.0.0.1, rng 3cfd9cfe\n",
    "1,929,360 B = 16.001 B/param\n",
    "step took 12.3456789 ms\n",             # masked by the sanitizer
])
def test_passes_what_holds_on_every_cpu(text):
    assert check(stream_cell(text)) == []


def test_an_output_nbval_does_not_compare_is_not_checked():
    assert check(stream_cell("loss 38.167927\n", tags=["nbval-ignore-output"])) == []


def test_flags_a_figure_of_full_precision_losses_and_not_a_rounded_one():
    found = check(figure_cell([38.06825637817383, 35.105995178222656]))
    assert [f.where for f in found] == ["figure 'losses' data[0].y[0]",
                                        "figure 'losses' data[0].y[1]"]
    assert check(figure_cell([38.07, 35.11, 12.0])) == []


def test_a_measured_figure_is_masked_so_not_flagged():
    assert check(figure_cell([0.012345678], measured=True)) == []


def test_an_allowance_explains_only_its_own_notebook():
    found = check(stream_cell("loss 38.167927\n"))
    mine = Allowed("99_made_up", "loss 38.167927", "a reason")
    other = Allowed("98_other", "loss 38.167927", "a reason")
    assert unexplained(found, [mine]) == []
    assert unexplained(found, [other]) == found


# -- make test-portable (scripts/test_portable.py) ---------------------------------

def portable_script():
    spec = importlib.util.spec_from_file_location(
        "test_portable", ROOT / "scripts" / "test_portable.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_setting_sets_its_own_instruction_sets(monkeypatch):
    portable = portable_script()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")   # set outside: ignored
    assert "ATEN_CPU_CAPABILITY" not in portable.environment("native")
    assert portable.environment("default")["ATEN_CPU_CAPABILITY"] == "default"
    avx2 = portable.environment("avx2")
    assert (avx2["ATEN_CPU_CAPABILITY"], avx2["ONEDNN_MAX_CPU_ISA"],
            avx2["MKL_ENABLE_INSTRUCTIONS"]) == ("avx2", "AVX2", "AVX2")
    assert str(ROOT) in portable.environment("native")["PYTHONPATH"].split(os.pathsep)


@pytest.mark.slow
def test_the_setting_reaches_the_kernel_and_its_ranks(tmp_path):
    # A notebook whose stored output is what ATen runs at on the "default"
    # setting, in the kernel and in a rank: it passes there and nowhere else.
    start = nbformat.v4.new_code_cell(      # its output says which backend
        "import torch, labsupport as ls\n"
        "ranks = ls.run(lambda: __import__('torch').backends.cpu"
        ".get_cpu_capability(), world_size=1)", execution_count=1)
    start.metadata["tags"] = ["nbval-ignore-output"]
    cell = nbformat.v4.new_code_cell(
        "print(torch.backends.cpu.get_cpu_capability(), ranks)",
        execution_count=2)
    cell.outputs = [nbformat.v4.new_output(
        "stream", name="stdout", text="DEFAULT ['DEFAULT']\n")]
    path = tmp_path / "99_capability.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[start, cell]), path)
    portable = portable_script()
    failed = portable.run("default", [path], tmp_path / "logs")
    log = (tmp_path / "logs" / "default.log").read_text()
    assert failed == [] and "2 passed" in log, log[-3000:]
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert portable.run("native", [path], tmp_path / "logs") == [
            ("99_capability.ipynb", "Cell 1")]
