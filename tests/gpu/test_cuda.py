"""CUDA paths on one GPU. Skipped where there is none (no CI machine has one); on a GPU machine::

    pytest tests/gpu

The CPU suite proves these paths' logic; these run the same code on CUDA tensors: the WAN codecs, checkpoints of a
CUDA model (the snapshot's copy to the host, the load's copy into GPU tensors, the CUDA random stream), a striped
load whose destinations are GPU tensors (two gloo ranks sharing the GPU), and Lightning fits on one GPU through
``hierarchical_ddp`` and DiLoCo (its sync in the background) resumed from multidc checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multidc.hierarchical.compression import get_codec
from multidc.hierarchical.tools.ranks import run_ranks
from tests._resources import require_cuda

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4", "topk", "topk:0.02:4:1024"])
def test_each_codec_encodes_and_sums_cuda_tensors_on_the_gpu_within_its_error_bound(name):
    cuda = require_cuda()
    codec = get_codec(name)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(100_003, generator=gen).mul_(3).to(cuda) for _ in range(2))
    wires = torch.stack([codec.encode(a), codec.encode(b)])
    assert wires.device == a.device
    for x, wire in ((a, wires[0]), (b, wires[1])):
        out = codec.decode(wire, x.numel())
        assert out.device == x.device and out.dtype == x.dtype
        assert ((out - x).abs().double() <= codec.max_abs_error(x).double()).all()
    total = codec.decode_sum(wires, a.numel())  # what a site does with the sites' gathered wires
    torch.testing.assert_close(total, codec.decode(wires[0], a.numel()) + codec.decode(wires[1], a.numel()))


def _model(device: torch.device, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer, seed: int) -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_cuda_model_optimizer_and_random_stream_restore_exactly(tmp_path, async_save):
    # the model trains on right after save() returns: an async save must hold the values of the save
    from multidc.plugins import Checkpointer, ModelState, RNGState

    cuda = require_cuda()
    model, optimizer = _model(cuda, 0)
    for seed in range(3):
        _step(model, optimizer, seed)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        handle = ckpt.save({"model": ModelState(model, optimizer), "rng": RNGState()}, step=3, async_save=async_save)
        draw = torch.randn(4, device=cuda)  # the CUDA stream right after the save
        _step(model, optimizer, 10)
        handle.wait()
        expected = {k: v.clone() for k, v in model.state_dict().items()}  # after the step the copy will take too
        copy, copy_optimizer = _model(cuda, 1)
        ckpt.load({"model": ModelState(copy, copy_optimizer), "rng": RNGState()})
    assert torch.equal(torch.randn(4, device=cuda), draw)
    assert all(p.device.type == "cuda" for p in copy.parameters())
    _step(copy, copy_optimizer, 10)  # equal only if the weights and AdamW's moments and step count came back
    for name, value in copy.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _striped_load_into_gpu_tensors(rank, world, url):
    from multidc.plugins import Checkpointer, ReadConfig

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 256, generator=gen), "b": torch.randn(300, generator=gen),
             "h": torch.randn(512, 64, generator=gen).to(torch.bfloat16)}
    state = {k: v.to(cuda) for k, v in state.items()}  # replicated: each rank stores half, reads half
    config = ReadConfig(piece_bytes=64 << 10, round_bytes=256 << 10, read_ahead_bytes=256 << 10)
    ckpt = Checkpointer(url, stripe_min_mb=0, read_config=config)
    ckpt.save(state, step=1)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.load(target)
    ckpt.close()
    return {k: (target[k].device.type, torch.equal(target[k], v)) for k, v in state.items()}


def test_two_ranks_sharing_the_gpu_load_a_replicated_cuda_state_striped_and_exchanged(tmp_path):
    require_cuda()
    for result in run_ranks(_striped_load_into_gpu_tensors, 2, str(tmp_path / "ckpt"), timeout=240):
        assert result == {k: ("cuda", True) for k in ("w", "b", "h")}, result


def _fit(tmp_path: Path, strategy: str, name: str, resume: Path | None = None) -> dict:
    out = tmp_path / f"{name}.pt"
    command = [sys.executable, str(ROOT / "tests" / "gpu" / "_lightning_fit.py"), "--strategy", strategy,
               "--ckpt-dir", str(tmp_path / name), "--out", str(out)] + (["--resume", str(resume)] if resume else [])
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS, for the exact comparison
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("strategy", ["hierarchical_ddp", "diloco"])
def test_a_fit_on_one_gpu_resumed_from_a_multidc_checkpoint_ends_like_the_unbroken_fit(tmp_path, strategy):
    require_cuda()
    unbroken = _fit(tmp_path, strategy, "unbroken")
    resumed = _fit(tmp_path, strategy, "resumed", resume=tmp_path / "unbroken" / "step=4.ckpt")
    assert unbroken["device"] == resumed["device"] == "cuda"
    assert unbroken["step"] == resumed["step"] == 12
    assert (unbroken["first_step"], resumed["first_step"]) == (0, 4)  # the resumed fit went on from the checkpoint
    for name, value in unbroken["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
