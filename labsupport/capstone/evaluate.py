"""What training did: validation loss in bits per byte, and text sampled from the model.

    gpt = models.GPT(model.config(...)); gpt.load_state_dict(compare.full_params(outs))
    evaluate.bits_per_byte(gpt, val_bytes, batch=16, seq_len=64, count=4)   # e.g. 3.1
    evaluate.sample(gpt, "And God said", 120, seed=0)                         # a str

Bits per byte is the mean cross-entropy over the validation bytes in bits
(nats / ln 2): with byte tokens (V = 256) it needs no tokenizer to compare,
and it is the unit of text-compression benchmarks (Hutter Prize; "Language
Modeling Is Compression", Delétang et al. 2023, arXiv 2309.10668). A model
that knows nothing spends 8 bits on a byte; one that knows the 68 characters
of this text and no more, log2 68 = 6.1. The validation set is the last 5%
of the text (``capstone.data.split``), the same batches at every evaluation
(``data.validation_batches``: consecutive windows, no shuffle).

Sampling draws each next byte from the model's softmax with a generator
seeded once, so the same weights give the same text; the context is the
last ``seq_len`` bytes (the position embedding knows no more).
"""

import torch

from labsupport.capstone import data as capdata
from labsupport.capstone import trainer


@torch.no_grad()
def bits_per_byte(gpt, data, batch, seq_len, count) -> float:
    """Mean cross-entropy of ``gpt`` over ``count`` validation batches of
    ``batch`` windows of ``seq_len`` bytes of ``data``, in bits per byte."""
    was = gpt.training
    gpt.eval()
    try:
        batches = capdata.validation_batches(data, batch, seq_len, count)
        nats = sum(gpt(ids, targets).item() for ids, targets in batches) / count
    finally:
        gpt.train(was)
    return trainer.bits_per_byte(nats)


@torch.no_grad()
def sample(gpt, prompt: str, length: int, seed: int = 0,
           temperature: float = 1.0) -> str:
    """``prompt`` and ``length`` bytes drawn from ``gpt`` one at a time
    (softmax of the logits / ``temperature``, a generator seeded with
    ``seed``), decoded as UTF-8 (a cut character shows U+FFFD)."""
    if length < 0 or temperature <= 0:
        raise ValueError(f"length={length} and temperature={temperature}: "
                         "need >= 0 and > 0")
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(prompt.encode("utf-8")), dtype=torch.long)[None]   # (1, t)
    if ids.shape[1] == 0:
        raise ValueError("sample needs a prompt of at least one byte")
    was = gpt.training
    gpt.eval()
    try:
        for _ in range(length):
            logits = gpt(ids[:, -gpt.cfg.seq_len:])[0, -1]                   # (V,)
            probs = (logits.double() / temperature).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=g)
            ids = torch.cat([ids, nxt[None]], dim=1)
    finally:
        gpt.train(was)
    return capdata.decode(ids[0])
