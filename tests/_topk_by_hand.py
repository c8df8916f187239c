"""A top-k codec with error feedback applied by hand, per rank, for ``tests/diloco_reference.run_reference``'s
``compress`` hook: what each rank of a site encodes (its share of every chunk of a fragment's pseudo-gradient, plus
its residual) and what arrives at the other sites."""

from __future__ import annotations

import torch

from multidc.hierarchical import WanConfig, get_codec
from multidc.hierarchical.chunking import plan_chunks


class TopKByHand:
    """The codec applied by hand, as each rank of a site applies it to its share of every chunk of a fragment's
    pseudo-gradient (``replicated`` all-reduce), with (``feedback``) or without each rank's residual."""

    def __init__(self, codec: str, site_size: int, feedback: bool = True) -> None:
        self.codec, self.site_size, self.feedback = get_codec(codec), site_size, feedback
        self.residuals: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # (fragment, site, rank): per chunk

    def __call__(self, fragment: int, site: int, delta: dict) -> dict:
        flat = torch.cat([v.reshape(-1) for v in delta.values()])
        out = torch.empty_like(flat)
        chunks = plan_chunks(flat.numel(), 4, WanConfig().chunk_mb, self.site_size)
        for i, chunk in enumerate(chunks):
            buffer = flat.new_zeros(chunk.padded_numel)
            buffer[: chunk.numel] = flat[chunk.start : chunk.end]
            arrived = []
            for rank, share in enumerate(buffer.split(chunk.shard_numel)):
                kept = self.residuals.setdefault((fragment, site, rank), [torch.zeros(c.shard_numel) for c in chunks])
                values = share + kept[i] if self.feedback else share.clone()
                decoded = self.codec.decode(self.codec.encode(values), chunk.shard_numel)
                kept[i] = values - decoded if self.feedback else kept[i]
                arrived.append(decoded)
            out[chunk.start : chunk.end] = torch.cat(arrived)[: chunk.numel]
        return {n: piece.view(v.shape) for (n, v), piece in zip(delta.items(), out.split([v.numel() for v in
                                                                                        delta.values()]))}

    def residual(self, fragment: int, site: int, rank: int) -> torch.Tensor:
        return torch.cat(self.residuals[(fragment, site, rank)])
