"""Each rank's stdout and stderr: read from its files, labelled, shown in rank order.

The ranks write to files (never pipes, so a chatty rank cannot block), and the
kernel reads what is new after each run. Shown grouped by rank, the output of
a cell is the same every time it runs, which is what nbval compares. With
``stream=True`` complete lines are shown as they arrive instead.
"""
import os
import sys


class RankOutput:
    """New bytes of one rank's stdout and stderr files, read incrementally."""

    def __init__(self, rank: int, out_path: str, err_path: str):
        self.rank = rank
        self.paths = {"stdout": out_path, "stderr": err_path}
        self.offsets = {"stdout": 0, "stderr": 0}
        self.partial = {"stdout": "", "stderr": ""}  # streamed text after the last newline

    def read(self, name: str) -> str:
        try:
            with open(self.paths[name], "rb") as f:
                f.seek(self.offsets[name])
                data = f.read()
        except FileNotFoundError:
            return ""
        self.offsets[name] += len(data)
        return data.decode("utf-8", errors="backslashreplace")

    def take(self, name: str, complete_lines_only: bool = False) -> str:
        """Text not shown yet; optionally keep an unfinished last line for later."""
        text = self.partial[name] + self.read(name)
        if complete_lines_only:
            cut = text.rfind("\n") + 1
            text, self.partial[name] = text[:cut], text[cut:]
        else:
            self.partial[name] = ""
        return text

    def remove(self):
        for path in self.paths.values():
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def label(rank: int, text: str) -> str:
    """Prefix every line with its rank: '[rank0] ...'."""
    if not text:
        return ""
    lines = text[:-1] if text.endswith("\n") else text
    return "".join(f"[rank{rank}] {line}\n" for line in lines.split("\n"))


def show(outputs: list[RankOutput], complete_lines_only: bool = False):
    """Print what the ranks wrote, stdout then stderr, each in rank order."""
    for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        text = "".join(label(o.rank, o.take(name, complete_lines_only)) for o in outputs)
        if text:
            stream.write(text)
            stream.flush()
