"""Stored outputs that another CPU could change, found without running a kernel.

nbval compares a chapter's fresh outputs with its stored ones, after the
regex/replace pairs of tests/nbval_sanitize.cfg. MKL, oneDNN and ATen pick
their kernels by instruction set, so the last bits of a matmul, a LayerNorm or
a softmax differ from one x86-64 CPU to the next (issue 34); an output that
shows those bits matches its stored copy on one machine only. This module
reads the stored notebooks, sanitizes each output as nbval does and reports
what such bits would show through:

- a float printed with more than SIGNIFICANT significant digits (a float32's
  or float64's repr, an f-string with too many decimals), in text or in a
  figure's data;
- a count of things equal bit for bit ("67 of 68 parameters bit for bit"):
  which of them match hinges on the last bit, unlike a verdict ("all 15 ...
  bitwise equal", asserted in the cell).

It cannot see everything a CPU changes (a rounded value that sits on a
rounding boundary, a routing decision after 300 steps printed as "9%"):
`make test-portable` runs every chapter under other instruction sets for that.
Used by tests/test_cpu_outputs.py.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbval.plugin import get_sanitize_patterns

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"

# How many significant digits a printed float may show. Two CPUs' float32
# results differ by about 1e-7 of the value after a few kernels (chapter 10's
# loss: 20.0917282 here, 20.0917244 with ATen's unvectorized kernels): shown
# with 6 digits, about 1 such value in 25 rounds the other way; with 5, 1 in
# 250; with 4, 1 in 2,500. An exact value (a ratio of byte counts, a formula
# on given constants) may show more, with a reason in ALLOWED.
SIGNIFICANT = 5
# Outputs nbval does not compare (its own skip list, plus the figure JSON
# that conftest.py adds; the same figure is compared inside text/html).
NOT_COMPARED = {"image/png", "image/jpeg", "application/vnd.plotly.v1+json",
                "application/vnd.jupyter.widget-view+json"}

# A decimal number: 38.16792297363281, 1.6516e+38, 6e-05; not part of a
# version (2.13.0), an address (127.0.0.1), a word or a hex digest.
FLOAT = re.compile(r"(?<![\w.])[-+]?(\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)"
                   r"(?![\w.])")
# Equality bit for bit, in the words the book uses.
BITWISE = re.compile(r"bit[- ]?for[- ]?bit|bit-?identical|bitwise|bit-exact",
                     re.I)
# A count of some of a whole ("67 of 68", "65/68") or a number of things
# next to the bitwise words ("65 parameters bit-identical"), except "all N"
# and "every N", which are verdicts.
COUNT = re.compile(r"\b\d+\s*(?:of|/)\s*\d+\b"
                   r"|(?<!\ball )(?<!\bevery )\b\d+(?:\s+[A-Za-z-]+){0,3}\s+"
                   r"(?:are |were )?(?:bit[- ]?for[- ]?bit|bit-?identical|bitwise"
                   r"|bit-exact)", re.I)
FIGURE = re.compile(r'Plotly\.newPlot\("[^"]*", (\{.*\})\);\s*</script>', re.S)


@dataclass(frozen=True)
class Finding:
    notebook: str  # the file's stem, e.g. 10_checkpoints_and_failures
    cell: int      # index of the cell in the notebook (all cells, from 0)
    where: str     # "stdout", "text/plain", "figure 'title' data[0].y[3]", ...
    text: str      # the offending value or line
    why: str       # "8 significant digits" or "a count of bitwise-equal things"

    def __str__(self):
        return (f"{self.notebook} cell {self.cell} {self.where}: {self.why}: "
                f"{self.text}")


def significant_digits(number: str) -> int:
    """Digits printed, leading zeros left out: '0.0025' 2, '38.167927' 8."""
    mantissa = re.split(r"[eE]", number.lstrip("+-"))[0]
    return len(mantissa.replace(".", "").lstrip("0")) or 1


def sanitizer(path: Path = SANITIZE):
    """nbval's own reading of the sanitize file, as one function on strings."""
    patterns = get_sanitize_patterns(path.read_text())

    def sanitize(text: str) -> str:
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text
    return sanitize


def compared_texts(cell):
    """(where, text) of every output string of a code cell that nbval compares."""
    tags = cell.metadata.get("tags", [])
    if "nbval-skip" in tags or "nbval-ignore-output" in tags:
        return
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            yield out.name, out.text
        elif out.output_type == "error":
            yield "error", f"{out.ename}: {out.evalue}"
        else:
            for mime, value in out.get("data", {}).items():
                if mime not in NOT_COMPARED and isinstance(value, str):
                    yield mime, value


# Keys of a trace that place or colour it from the trace's own layout (a
# colour scale's stops at k/6), never data a computation produced.
LAYOUT_KEYS = {"colorscale"}


def _walk(value, path):
    """(path, float) of every non-integral float in a figure's traces."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in LAYOUT_KEYS:
                yield from _walk(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")
    elif isinstance(value, float) and not value.is_integer():
        yield path, value


def figure_findings(fig: dict):
    """(where, value) of each float in a figure's data with too many digits.

    The layout (axis domains at 0.2933..., annotations) is plotly's and the
    plot helper's arithmetic on given sizes, the same on every CPU.
    """
    title = (fig.get("layout") or {}).get("title")
    title = title.get("text") if isinstance(title, dict) else title
    for path, value in _walk({"data": fig.get("data", [])}, ""):
        text = repr(value)
        if significant_digits(text) > SIGNIFICANT:
            yield f"figure {title!r} {path}", text


def text_findings(text: str):
    """(text, why) of each float with too many digits and each bitwise count."""
    for line in text.splitlines():
        for m in FLOAT.finditer(line):
            digits = significant_digits(m.group(0))
            if digits > SIGNIFICANT:
                start = max(m.start() - 40, 0)
                yield line[start:m.end() + 20], f"{digits} significant digits"
        if BITWISE.search(line) and COUNT.search(line):
            yield line[:200], "a count of bitwise-equal things"


def notebook_findings(nb, name: str, sanitize) -> list[Finding]:
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for where, raw in compared_texts(cell):
            text = sanitize(raw)
            rest = text
            if where == "text/html":
                for m in FIGURE.finditer(text):
                    for path, value in figure_findings(json.loads(m.group(1))):
                        found.append(Finding(name, index, path, value,
                                             f"more than {SIGNIFICANT} significant digits"))
                rest = FIGURE.sub("", text)
            for snippet, why in text_findings(rest):
                found.append(Finding(name, index, where, snippet, why))
    return found


def findings(path: Path, sanitize=None) -> list[Finding]:
    """Every output of the stored notebook at path that a CPU could change."""
    nb = nbformat.read(path, as_version=4)
    return notebook_findings(nb, path.stem, sanitize or sanitizer())
