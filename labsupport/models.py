"""Small models and toy data for the chapters, identical on every rank.

Every constructor takes a ``seed`` and builds its parameters under that seed
without touching the global random state, so a model made on rank 0, on rank
3 and in the notebook's single-process reference is the same model: the
parity checks compare against it with tight tolerances.
"""
import contextlib
import math

import torch
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


class TinyTransformerBlock(nn.Module):
    """A pre-norm transformer block: x + Attn(LN(x)), then x + MLP(LN(x)).

    For the tensor- and sequence-parallel chapters. Attention is written out
    (q, k, v projections, heads, scaled dot product, output projection) so it
    can be split by heads. Shapes: (b, s, h) -> (b, s, h); a heads of d = h/a.
    """

    def __init__(self, hidden=64, heads=4, ffn=256, causal=True, seed=0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        self.heads, self.causal = heads, causal
        with seeded(seed):
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def attention(self, x):                                   # (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)                # 3 x (b, s, h)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # (b, a, s, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, a, s, s)
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(-1) @ v                          # (b, a, s, d)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):                                     # (b, s, h)
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


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
