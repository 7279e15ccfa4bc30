# Run: .venv/bin/python -m pytest tests/test_prose.py -s   (~1 s; -s prints the table)
"""The prose a learner reads stays short enough to read at speed.

Every chapter and the learner's pages (the intro, "Start here", conventions,
the assignments) are measured by tests/prose.py. The ceilings sit just above
the longest chapter when they were set (chapter 8: a mean of 29.8 words, 23%
of its sentences over 40 words), so no text may read slower than the slowest
chapter did; the chapters' mean was then 24.6 words, near the 25 aimed for.
Chapter 11 (33.3 words, 27%) was rewritten to pass. The
instructors' pages (the hub, grading, running at scale, testing) are reference
manuals: they are printed in the table, not held to the ceilings.
"""
import pytest

import prose

MAX_MEAN = 30.0        # words per sentence, per text
MAX_LONG_SHARE = 0.25  # of its sentences over prose.LONG (40) words
LEARNER_PAGES = ["intro.md", "start_here.md", "conventions.md", "assignments.md"]
TEXTS = prose.chapters() + [prose.ROOT / "book" / name for name in LEARNER_PAGES]


def test_print_the_table():
    print("\n" + prose.table(prose.chapters() + prose.pages()))


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_sentences_are_short_enough(path):
    m = prose.measure(path)
    assert m["sentences"] > 0, f"{path.name}: no running text found"
    assert m["mean"] <= MAX_MEAN and m["long_share"] <= MAX_LONG_SHARE, (
        f"{path.name}: a mean of {m['mean']:.1f} words a sentence (at most {MAX_MEAN}) and "
        f"{m['long_share']:.0%} of sentences over {prose.LONG} words (at most "
        f"{MAX_LONG_SHARE:.0%}). Split the longest: tests/prose.py lists the texts.")


def test_the_measure_counts_sentences_items_and_skips_code_math_and_tables():
    text = """# A heading is not a sentence

One two three four. Five six seven eight nine ten, with `code` and $x^2$.

- An item of five words
- another one of five words

$$
a = b + c \\quad \\text{is not prose}
$$

```python
print("nor is this")
```

| a | table |
|---|---|
| is | skipped |
"""
    assert prose.sentences(text) == [4, 10, 5, 5]


def test_a_long_sentence_is_counted_long():
    sentence = " ".join(["word"] * (prose.LONG + 1)) + "."
    assert prose.sentences(sentence + " Short one.") == [prose.LONG + 1, 2]
