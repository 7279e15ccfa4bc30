"""Sentence lengths of the book's prose: what a learner reads, measured.

Only the running text counts: markdown cells of a chapter (or a book page),
without code blocks, display math, tables, headings, HTML and link targets.
Inline math and inline code count as one word each. A sentence ends at '.',
'!' or '?' followed by a space and a capital letter (or a paragraph's end),
at a colon that ends a line before a list, and at every paragraph break, so
that a list item is a sentence of its own.

Run: .venv/bin/python tests/prose.py   (a table of every chapter and page)
"""
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG = 40  # words: a sentence longer than this is "long"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
INLINE_MATH = re.compile(r"\$[^$\n]+\$")
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
ROLE = re.compile(r"\{[a-z]+\}`([^`]*)`")  # {doc}`...`, {ref}`...`
HTML = re.compile(r"<[^>\n]+>")
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9*_])")
WORD = re.compile(r"[\w\u00C0-\u024F\u0370-\u03FF][\w'’.,/×·\-\u00C0-\u024F\u0370-\u03FF]*")


def paragraphs(markdown: str) -> list[str]:
    """The running text of one markdown source, a paragraph or list item each."""
    text = FENCE.sub("\n\n", markdown)
    text = DISPLAY_MATH.sub(" ", text)
    text = ROLE.sub(r"\1", text)
    text = INLINE_MATH.sub("X", INLINE_CODE.sub("X", text))
    text = LINK.sub(r"\1", HTML.sub(" ", text))
    out, current = [], []
    for line in text.splitlines():
        stripped = line.strip()
        starts_item = re.match(r"^([-*+]|\d+\.)\s+", stripped)
        if not stripped or stripped.startswith(("#", "|", ":::", "```", ">")) or starts_item:
            if current:
                out.append(" ".join(current))
            current = [stripped[starts_item.end():]] if starts_item else []
            continue
        current.append(stripped)
    if current:
        out.append(" ".join(current))
    return [p for p in out if p.strip()]


def sentences(markdown: str) -> list[int]:
    """The word count of each sentence of the running text."""
    counts = []
    for paragraph in paragraphs(markdown):
        for sentence in SENTENCE_END.split(paragraph):
            words = len(WORD.findall(sentence))
            if words:
                counts.append(words)
    return counts


def markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


def measure(path: Path) -> dict:
    counts = sentences(markdown_of(path))
    long = sum(n > LONG for n in counts)
    return {"sentences": len(counts), "mean": statistics.fmean(counts) if counts else 0.0,
            "long_share": long / len(counts) if counts else 0.0, "longest": max(counts, default=0)}


def chapters() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def pages() -> list[Path]:
    return sorted((ROOT / "book").glob("*.md"))


def table(paths) -> str:
    rows = [f"| {'text':40} | sentences | mean words | over {LONG} words | longest |",
            f"|{'-' * 42}|-----------|------------|---------------|---------|"]
    for path in paths:
        m = measure(path)
        rows.append(f"| {str(path.relative_to(ROOT)):40} | {m['sentences']:9} | "
                    f"{m['mean']:10.1f} | {m['long_share']:13.0%} | {m['longest']:7} |")
    return "\n".join(rows)


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or chapters() + pages()
    print(table(paths))
