"""Activation checkpointing of the shared decoder: none, selective (attention core) or full.

The memory chapter's lesson, kept here for the benchmark and later chapters
(tests/test_checkpointing.py keeps the two copies identical). ``forward``
computes what ``models.GPT.forward`` computes, with each layer written out so
that ``torch.utils.checkpoint.checkpoint`` can wrap the whole layer ("full",
Chen et al. 2016, arXiv 1604.06174) or only the attention core ("selective", Korthikanti et
al. 2022, arXiv 2205.05198, §5); ``CALLS`` counts the layer and attention-core forwards,
recomputations included.
"""
import collections
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# --- lesson: notebooks/00_memory.ipynb (the notebook's copy must match) ---
CALLS = collections.Counter()


def attention_core(q, k, v, dropout):                # 3 x (b, a, s, d)
    CALLS["attention core"] += 1
    s, d = q.shape[-2:]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)   # (b, a, s, s)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = dropout(scores.masked_fill(mask, float("-inf")).softmax(-1))
    return probs @ v                                  # (b, a, s, d)


def attention(attn, x, selective):                    # (b, s, h)
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
               for p in (attn.q, attn.k, attn.v))     # 3 x (b, a, s, d)
    if selective:
        out = checkpoint(attention_core, q, k, v, attn.dropout,
                         use_reentrant=False)
    else:
        out = attention_core(q, k, v, attn.dropout)
    return attn.o(out.transpose(1, 2).reshape(b, s, -1))


def layer(block, x, selective=False):                 # (b, s, h)
    CALLS["layer"] += 1
    x = x + block.dropout(attention(block.attn, block.ln1(x), selective))
    return x + block.dropout(block.mlp(block.ln2(x)))


def forward(model, ids, targets, policy="none"):
    # the model's forward, each layer run under a checkpointing policy
    pos = torch.arange(ids.shape[1], device=ids.device)
    x = model.dropout(model.tok(ids) + model.pos(pos))        # (b, s, h)
    for block in model.blocks:
        if policy == "full":
            x = checkpoint(layer, block, x, use_reentrant=False)
        else:
            x = layer(block, x, selective=policy == "selective")
    logits = model.lm_head(model.ln_f(x))                     # (b, s, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
# --- end of lesson ---
