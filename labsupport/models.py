"""Small models and toy data for the chapters, identical on every rank.

Every constructor takes a ``seed`` and builds its parameters under that seed
without touching the global random state, so a model made on rank 0, on rank
3 and in the notebook's single-process reference is the same model: the
parity checks compare against it with tight tolerances.
"""
import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def seeded(seed: int):
    """Run the block under ``torch.manual_seed(seed)``, restoring the RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class DeepMLP(nn.Sequential):
    """``depth`` blocks of Linear(width, width) + ReLU, then a Linear to ``d_out``.

    The model of the data- and pipeline-parallel chapters: deep enough to
    split into stages, wide enough that compute dominates on a CPU. Shapes:
    (b, d_in) -> (b, d_out).
    """

    def __init__(self, d_in=32, width=128, depth=8, d_out=8, seed=0):
        if min(d_in, width, depth, d_out) < 1:
            raise ValueError(f"DeepMLP needs positive sizes, got d_in={d_in}, width={width}, "
                             f"depth={depth}, d_out={d_out}")
        with seeded(seed):
            layers = [nn.Linear(d_in, width), nn.ReLU()]
            for _ in range(depth - 1):
                layers += [nn.Linear(width, width), nn.ReLU()]
            layers.append(nn.Linear(width, d_out))
        super().__init__(*layers)

    def blocks(self) -> list[nn.Module]:
        """The model as a list of blocks (Linear+ReLU pairs, then the head), in order."""
        mods = list(self)
        return [nn.Sequential(*mods[i:i + 2]) for i in range(0, len(mods) - 1, 2)] + [mods[-1]]

    def stages(self, num_stages: int) -> list[nn.Sequential]:
        """Split the blocks into ``num_stages`` contiguous stages of near-equal size.

        The stages share parameters with the model (no copy), so gradients of
        the staged model are gradients of this one.
        """
        blocks = self.blocks()
        if not 1 <= num_stages <= len(blocks):
            raise ValueError(f"cannot split {len(blocks)} blocks into {num_stages} stages: "
                             f"use 1..{len(blocks)} stages or a deeper model")
        bounds = [round(i * len(blocks) / num_stages) for i in range(num_stages + 1)]
        return [nn.Sequential(*blocks[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shared decoder's sizes, in the book's alphabet (see book/conventions.md)."""
    vocab_size: int = 256      # V
    seq_len: int = 64          # s, the longest sequence (learned positions)
    hidden: int = 64           # h
    heads: int = 4             # a; each head has d = h / a features
    layers: int = 2            # L
    ffn: int = 0               # the MLP's inner width; 0 means 4h
    dropout: float = 0.0       # after attention probabilities and each residual branch
    tie_weights: bool = True   # the LM head reuses the token embedding (as GPT-2)
    moe_experts: int = 0       # E > 0: mixture-of-experts MLPs (chapter 9); 0: dense
    moe_top_k: int = 2         # k experts per token
    moe_every: int = 1         # an MoE MLP in blocks moe_every-1, 2*moe_every-1, ...
    moe_capacity: float | None = None  # capacity factor c_f; None: drop nothing
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss (Switch: 1e-2)

    def __post_init__(self):
        if min(self.vocab_size, self.seq_len, self.hidden, self.heads, self.layers) < 1:
            raise ValueError(f"GPTConfig needs positive sizes, got {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.moe_experts < 0 or self.moe_every < 1:
            raise ValueError(f"moe_experts={self.moe_experts} must be >= 0 (0: dense) and "
                             f"moe_every={self.moe_every} >= 1")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has a mixture-of-experts MLP."""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention, written out so it can be split by heads.

    q, k and v are separate projections (column-parallel each, under tensor
    parallelism) and the number of heads is read from the tensor, so a module
    whose projections hold a/t heads runs unchanged. Shapes: (b, s, h) -> (b, s, h).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.q, self.k, self.v = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(3))
        self.o = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):                                     # (b, s, h)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))          # 3 x (b, a, s, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (b, a, s, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)   # (b, s, h)
        return self.o(out)


class MLP(nn.Module):
    """Linear(h, 4h), GELU, Linear(4h, h): column- then row-parallel under TP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x):                                     # (b, s, h)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))).

    In the blocks ``cfg.is_moe(layer)`` names, the MLP is ``moe(h, ffn, E, k,
    c_f)``: the mixture-of-experts class the caller passes (chapter 9's ``MoE``),
    so this module, used from chapter 0 on, does not depend on chapter 9.
    """

    def __init__(self, cfg: GPTConfig, layer: int = 0, moe=None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn, self.mlp = CausalSelfAttention(cfg), _mlp(cfg, layer, moe)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):                                     # (b, s, h)
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


def _mlp(cfg: GPTConfig, layer: int, moe) -> nn.Module:
    if not cfg.is_moe(layer):
        return MLP(cfg)
    if moe is None:
        raise ValueError(f"GPTConfig(moe_experts={cfg.moe_experts}) needs the mixture-of-"
                         "experts class: GPT(cfg, moe=MoE), with chapter 9's "
                         "labsupport.expert_parallel.moe.MoE or your own")
    return moe(cfg.hidden, cfg.ffn_hidden, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity)


class GPT(nn.Module):
    """The book's small GPT-style decoder, shared by chapters 0, 4, 6, 7 and 8.

    Token and learned position embeddings, ``L`` pre-LayerNorm blocks, a final
    LayerNorm and an LM head (tied to the token embedding by default). Built
    under ``seed``, so every rank and the single-process reference hold the
    same weights. ``model(ids)`` gives logits (b, s, V); ``model(ids, targets)``
    the mean cross-entropy, plus ``cfg.moe_aux_coef`` times the MoE blocks'
    load-balancing losses when the config has experts (then ``moe`` is the
    mixture-of-experts class, e.g. ``GPT(cfg, moe=MoE)`` in chapter 9).
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0, moe=None):
        super().__init__()
        self.cfg = cfg
        with seeded(seed):
            self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.blocks = nn.ModuleList(DecoderBlock(cfg, i, moe)
                                        for i in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok.weight
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids, targets=None):                     # ids: (b, s) int64
        s = ids.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence of {s} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.dropout(self.tok(ids) + self.pos(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            x = block(x)                                      # (b, s, h)
        logits = self.lm_head(self.ln_f(x))                   # (b, s, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = [b.mlp.aux_loss for b in self.blocks if hasattr(b.mlp, "aux_loss")]
        return loss + self.cfg.moe_aux_coef * sum(aux) if aux else loss


def toy_tokens(batch=8, seq_len=64, vocab_size=256, seed=0):
    """Token sequences with a learnable rule: (ids, targets), both (b, s) int64.

    Each row counts from a random start in a random stride modulo V, so the next
    token is predictable from the previous two; ``targets`` is ``ids`` shifted left.
    """
    with seeded(seed):
        start = torch.randint(vocab_size, (batch, 1))
        stride = torch.randint(1, 8, (batch, 1))
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size   # (b, s + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def toy_regression(n_samples=256, d_in=32, d_out=8, seed=0):
    """A noisy linear-plus-sine regression task: (X, Y) of shapes (n, d_in), (n, d_out)."""
    with seeded(seed):
        x = torch.randn(n_samples, d_in)
        w = torch.randn(d_in, d_out) / math.sqrt(d_in)
        y = torch.sin(x @ w) + 0.1 * torch.randn(n_samples, d_out)
    return x, y


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the first dimension (which N must divide)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if tensor.shape[0] % world_size:
        raise ValueError(f"{tensor.shape[0]} samples do not split evenly over {world_size} "
                         f"ranks: use a batch size divisible by the world size")
    size = tensor.shape[0] // world_size
    return tensor[rank * size:(rank + 1) * size]
