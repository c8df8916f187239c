"""A top-k codec with error feedback applied by hand, per rank, for ``tests/diloco_reference.run_reference``'s
``compress`` hook: what each rank of a site encodes (its share of every chunk of a fragment's pseudo-gradient, plus
its residual) and what arrives at the other sites. Under FSDP2 (``shards > 1``) each rank holds one shard of every
parameter (dim-0 pieces, as ``torch.chunk`` cuts them) and syncs the flat of its pieces alone."""

from __future__ import annotations

import torch

from multidc.hierarchical import WanConfig, get_codec
from multidc.hierarchical.chunking import plan_chunks


class TopKByHand:
    """The codec applied by hand, as each rank of a site applies it to its share of every chunk of a fragment's
    pseudo-gradient (``replicated`` all-reduce), with (``feedback``) or without each rank's residual. ``shards``:
    the FSDP2 shards of a site; each shard's pieces are one flat buffer, shared by ``site_size`` ranks."""

    def __init__(self, codec: str, site_size: int, feedback: bool = True, shards: int = 1) -> None:
        self.codec, self.site_size, self.feedback, self.shards = get_codec(codec), site_size, feedback, shards
        # (fragment, site, shard, rank): per chunk
        self.residuals: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}

    def __call__(self, fragment: int, site: int, delta: dict) -> dict:
        pieces = {n: _shards(v, self.shards) for n, v in delta.items()}
        arrived = [self._replicated(fragment, site, j, {n: p[j] for n, p in pieces.items()})
                   for j in range(self.shards)]
        return {n: torch.cat([a[n] for a in arrived]).view(v.shape) for n, v in delta.items()}

    def _replicated(self, fragment: int, site: int, shard: int, delta: dict) -> dict:
        flat = torch.cat([v.reshape(-1) for v in delta.values()])
        out = torch.empty_like(flat)
        chunks = plan_chunks(flat.numel(), 4, WanConfig().chunk_mb, self.site_size)
        for i, chunk in enumerate(chunks):
            buffer = flat.new_zeros(chunk.padded_numel)
            buffer[: chunk.numel] = flat[chunk.start : chunk.end]
            arrived = []
            for rank, share in enumerate(buffer.split(chunk.shard_numel)):
                kept = self.residuals.setdefault((fragment, site, shard, rank),
                                                 [torch.zeros(c.shard_numel) for c in chunks])
                values = share + kept[i] if self.feedback else share.clone()
                decoded = self.codec.decode(self.codec.encode(values), chunk.shard_numel)
                kept[i] = values - decoded if self.feedback else kept[i]
                arrived.append(decoded)
            out[chunk.start : chunk.end] = torch.cat(arrived)[: chunk.numel]
        return {n: piece.view(v.shape) for (n, v), piece in zip(delta.items(), out.split([v.numel() for v in
                                                                                        delta.values()]))}

    def residual(self, fragment: int, site: int, rank: int, shard: int = 0) -> torch.Tensor:
        return torch.cat(self.residuals[(fragment, site, shard, rank)])


def _shards(value: torch.Tensor, shards: int) -> list[torch.Tensor]:
    """``value``'s dim-0 pieces as FSDP2 holds them: ``torch.chunk``'s, empty ones for the ranks it leaves out."""
    pieces = list(value.chunk(shards)) if shards > 1 else [value]
    return pieces + [value.new_empty(0, *value.shape[1:])] * (shards - len(pieces))
