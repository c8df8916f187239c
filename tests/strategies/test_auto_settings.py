""""auto" settings reach the Lightning strategies (construction only, no process group): DiLoCo's take them, the
per-step all-reduce refuses WAN settings on auto with the field and the fix; the semantics are tested on raw
``DiLoCo`` in tests/hierarchical/test_diloco_auto.py."""

from __future__ import annotations

import pytest

from multidc.hierarchical import DiLoCoConfig, WanConfig
from multidc.strategies import DiLoCoStrategy, HierarchicalDDPStrategy, Parallel3DStrategy


def test_diloco_strategies_take_auto_settings_and_hierarchical_ddp_refuses_wan_auto():
    wan = WanConfig(chunk_mb="auto", streams="auto")
    strategy = DiLoCoStrategy(diloco=DiLoCoConfig(sync_every="auto"), wan=wan)
    assert strategy.gradient_sync.wan.chunk_mb_auto and strategy.gradient_sync.diloco_config.sync_every_auto
    p3d = Parallel3DStrategy(cross_site="diloco", diloco=DiLoCoConfig(sync_every="auto"), wan=wan)
    assert p3d.gradient_sync.diloco_config.sync_every_auto
    with pytest.raises(ValueError, match="per-step all-reduce .*chunk_mb='auto'.*Give chunk_mb a number"):
        HierarchicalDDPStrategy(wan=wan)
    with pytest.raises(ValueError, match="per-step all-reduce"):
        Parallel3DStrategy(wan=wan)
