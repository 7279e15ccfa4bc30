"""What assignment 9's graded runs train: the tied decoder, its batches, its reference.

Every run and the one-process reference share these: chapter 11's small
decoder with the LM head tied to the token embedding, 12 sequences of 16
bytes of the Bible's training split per step, 2 micro-batches, AdamW, and
for the clipped runs ``MAX_NORM`` (below every step's gradient norm, so the
clip acts at each step).
"""
import functools

from labsupport import models
from labsupport.capstone import trainer
from labsupport.capstone.layout import Layout

STEPS = 3             # the gradients at step 0, the loss (and norm) of every step
BATCH, SEQ_LEN, MICRO_BATCHES = 12, 16, 2   # 12 rows split over dp = 1, 2, 3, 4, 6
LR = 3e-3
MAX_NORM = 1.0        # the clipped runs' max_norm; the norms are 6 to 8
SIZES = dict(vocab_size=256, hidden=32, heads=4)
TIED = "tok.weight"   # the one-process name of the tied weight


def tied_config(layers=2) -> models.GPTConfig:
    """The assignment's decoder: chapter 11's sizes, the LM head tied to the
    token embedding."""
    return models.GPTConfig(**SIZES, seq_len=SEQ_LEN, layers=layers, tie_weights=True)


def layers_for(layout) -> int:
    """Blocks enough for every pipeline stage to hold one (2 at least)."""
    return max(2, Layout(*layout).pp)


def train_config(layers=2, clip_norm=None) -> trainer.TrainConfig:
    """What every graded run and the reference train: the tied decoder, the
    assignment's batches (the Bible's training split), AdamW, clipped to
    ``clip_norm`` if given."""
    return trainer.TrainConfig(model=tied_config(layers), batch=BATCH, seq_len=SEQ_LEN,
                               micro_batches=MICRO_BATCHES, lr=LR, clip_norm=clip_norm)


@functools.lru_cache(maxsize=8)
def reference(layers=2, steps=STEPS, clip_norm=None) -> dict:
    """One process training the tied ``models.GPT`` on the same global batches:
    {"losses": per step, "grads": {name: gradient at step 0}, "norms": each
    step's gradient norm before ``clip_grad_norm_`` (with ``clip_norm``)}."""
    out = trainer.reference(steps, train_config(layers, clip_norm), record_grads=(0,))
    return dict(losses=out["losses"], grads=out["grads"][0], norms=out["grad_norms"])


def describe(layout) -> str:
    layout = Layout(*layout)
    return (f"layout dp={layout.dp}, tp={layout.tp}, pp={layout.pp}, cp={layout.cp} "
            f"({layout.world_size} ranks)")

