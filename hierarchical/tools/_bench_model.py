"""The model and data of ``multidc bench diloco``: a small GPT and generated token sequences. Pure torch.

The data: ``topics`` random Markov chains over ``vocab`` tokens (each token has ``branch`` likely successors
per topic). Site ``s`` draws most of its sequences (``own_share``) from the topics ``k`` with ``k % sites == s``
(sites hold different data, as datacenters do); validation mixes every topic alike. A site training alone
therefore sees the other sites' topics rarely, while cross-site training (DDP or DiLoCo) learns them all. The
floor of the validation loss is the chains' mean entropy, which ``topic_entropy`` returns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class _Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions[: idx.shape[1]]


class TinyGPT(nn.Module):
    """A pre-norm decoder-only transformer. ``pipeline_blocks()`` (embedding, each layer, the head) are the
    blocks DiLoCo deals into streaming fragments."""

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = _Embed(vocab, dim, seq)
        self.layers = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (nats) of sequences ``idx`` (batch, seq + 1)."""
        return next_token_loss(self(idx[:, :-1]), idx)


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (nats) of ``logits`` for ``idx[:, :-1]`` against the next tokens ``idx[:, 1:]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class TopicData:
    """Token sequences from ``topics`` Markov chains; every table comes from ``seed`` (the same on every rank)."""

    def __init__(self, *, vocab: int, topics: int, branch: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.topics = vocab, topics
        self.tables = torch.zeros(topics, vocab, vocab)
        for k in range(topics):
            successors = torch.stack([torch.randperm(vocab, generator=g)[:branch] for _ in range(vocab)])
            # Dirichlet(1, ..., 1) as normalized Exp(1) draws from ``g``: torch.distributions samples from the global
            # RNG, which torch seeds differently in every process (each rank and run would get other chains)
            draws = torch.empty(vocab, branch).exponential_(generator=g)
            weights = draws / draws.sum(1, keepdim=True)
            self.tables[k].scatter_(1, successors, weights)

    def topic_entropy(self) -> float:
        """Mean per-token entropy (nats) of the chains: the loss a perfect model reaches (uniform start token)."""
        p = self.tables.clamp_min(1e-30)
        return float(-(self.tables * p.log()).sum(-1).mean())

    def sample(self, count: int, length: int, weights: torch.Tensor, seed: int) -> torch.Tensor:
        """``count`` sequences of ``length`` tokens, each from a topic drawn with probabilities ``weights``."""
        g = torch.Generator().manual_seed(seed)
        chosen = torch.multinomial(weights, count, replacement=True, generator=g)
        out = torch.empty(count, length, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab, (count,), generator=g)
        for t in range(1, length):
            probs = self.tables[chosen, out[:, t - 1]]
            out[:, t] = torch.multinomial(probs, 1, generator=g).squeeze(1)
        return out

    def site_weights(self, site: int, sites: int, own_share: float) -> torch.Tensor:
        """Topic probabilities of site ``site``: ``own_share`` spread over its own topics (``k % sites == site``),
        the rest over the others. ``1 / sites`` makes every site's data alike; ``1`` gives each site only its own."""
        mine = torch.tensor([k % sites == site for k in range(self.topics)])
        if not mine.any() or mine.all():
            raise ValueError(f"{self.topics} topics cannot be split over {sites} sites; use more topics.")
        return torch.where(mine, own_share / mine.sum(), (1 - own_share) / (~mine).sum())

    def mixed_weights(self) -> torch.Tensor:
        """Every topic alike: the validation mix."""
        return torch.full((self.topics,), 1.0 / self.topics)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def uniform_loss(vocab: int) -> float:
    return math.log(vocab)
