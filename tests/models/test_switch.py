"""The seam: SwitchGLU over any expert source, the runtime's expert cache being one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import strata_mlx
from strata_mlx.models.switch import ExpertSource, SwitchGLU


class ScaledExperts:
    """Expert e of every layer multiplies its input by e + 1; experts 0 and 2 are resident."""

    route_bonus = 0.5
    decoding = False

    def __init__(self):
        self.calls: list[int] = []
        self.dumped: list[tuple] = []
        self.dump = lambda *state: self.dumped.append(state)

    def run_layer(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        self.calls.append(layer)
        return x[..., None, :] * (inds + 1).astype(x.dtype)[..., None]

    def resident_mask(self, layer: int) -> mx.array:
        return mx.array([1.0, 0.0, 1.0, 0.0])


def test_the_seam_combines_a_sources_experts_and_calls_its_hooks():
    source = ScaledExperts()
    assert isinstance(source, ExpertSource)
    seam = SwitchGLU(layer=3)
    seam.attach(source)
    x = mx.array([[1.0, 2.0], [3.0, 4.0]], dtype=mx.float16)
    inds = mx.array([[0, 2], [1, 3]])
    scores = mx.array([[0.5, 0.25], [1.0, 0.0]], dtype=mx.float16)

    each = seam(x, inds)
    assert each.shape == (2, 2, 2)
    np.testing.assert_array_equal(np.array(each[1, 1]), [12.0, 16.0])

    y = seam(x, inds, scores)
    assert y.dtype == mx.float16 and source.calls == [3, 3]
    np.testing.assert_array_equal(np.array(y), [[1.25, 2.5], [6.0, 8.0]])
    layer, *_, dumped_y = source.dumped[-1]
    assert layer == 3 and dumped_y is y

    assert seam.route_bonus() is None  # prefill: exact routing
    source.decoding = True
    np.testing.assert_array_equal(np.array(seam.route_bonus()), [0.5, 0.0, 0.5, 0.0])


def test_an_unattached_seam_says_how_to_load():
    with pytest.raises(RuntimeError, match="strata_mlx.load"):
        SwitchGLU(layer=0)(mx.zeros((1, 2)), mx.zeros((1, 1), dtype=mx.uint32))


def test_the_runtimes_expert_cache_is_an_expert_source(store):
    with strata_mlx.load(store("qwen3_moe"))[0] as model:
        assert isinstance(model.expert_cache, ExpertSource)
