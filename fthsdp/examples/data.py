"""Synthetic token sequences a model can learn, generated from a seeded ``torch.Generator`` per
(seed, step, replica slot, rank): nothing is downloaded, and any batch can be regenerated exactly.

Each sequence follows one of four affine rules ``next = (a * token + c) mod vocab`` picked at random, with 5%
random tokens mixed in: a model that infers the rule from the context predicts most tokens, so the loss falls
from ln(vocab) toward the noise floor, visibly.
"""

from __future__ import annotations

import torch

RULES = ((5, 1), (7, 3), (11, 5), (13, 7))
NOISE = 0.05


def batch(seed: int, step: int, slot: int, rank: int, size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """``size`` sequences of ``seq_len + 1`` tokens (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 10_007 + slot) * 101 + rank)
    rules = torch.tensor(RULES)[torch.randint(len(RULES), (size,), generator=g)]
    out = torch.empty(size, seq_len + 1, dtype=torch.int64)
    out[:, 0] = torch.randint(vocab, (size,), generator=g)
    for i in range(1, seq_len + 1):
        out[:, i] = (rules[:, 0] * out[:, i - 1] + rules[:, 1]) % vocab
    noise = torch.rand(size, seq_len + 1, generator=g) < NOISE
    out[noise] = torch.randint(vocab, (int(noise.sum()),), generator=g)
    return out
