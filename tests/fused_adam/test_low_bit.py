"""How much the low-bit moment formats (ort_optim._spec.Q8 and Q4) change Adam's update, as a bound per format.

The update-space error: the expected squared change of the update m / sqrt(v) that storing one moment causes
(exp_avg rounded stochastically, sqrt(v) to its level nearest in 1/sqrt(v)), over the update's own squared size, on
block data shaped like Adam's moments (per block a scale over four decades, most elements between 5% and 50% of
their block's largest, a heavy tail). It has no training noise, so it tells a change of the levels from a lucky seed;
guides/low-bit-states.md ("Candidate 4-bit levels") has what it did and did not predict about training loss.
"""

from __future__ import annotations

import pytest
import torch

from ort_optim._spec import Q4, Q8
from ort_optim.backends import reference as reference_backend


def _moment_like_blocks(seed: int, blocks: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) of `blocks` x 128 elements: per 128 a scale over four decades; m ~ N(0, 1) * scale, 2% of the elements
    3-10x larger; sqrt(v) = |m| * (1 .. 4) + 1e-3 * scale (v >= m^2, as Adam's moments after a few steps)."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (-4 * torch.rand(blocks, 1, generator=g))
    m = torch.randn(blocks, 128, generator=g) * scale
    spikes = torch.rand(blocks, 128, generator=g) < 0.02
    m = torch.where(spikes, m * (3 + 7 * torch.rand(blocks, 128, generator=g)), m)
    root = m.abs() * (1 + 3 * torch.rand(blocks, 128, generator=g)) + 1e-3 * scale
    return m.reshape(-1), (root * root).reshape(-1)


def _update_error(m, v, m_hat, v_hat) -> float:
    update = m / v.sqrt()
    return float(((m_hat / v_hat.sqrt() - update) ** 2).sum() / (update**2).sum())


def _round_trip(values, fmt, second_moment, step):
    codes, scales = reference_backend.quantize_low_bit(values, fmt, second_moment, step)
    return reference_backend.dequantize_low_bit(codes, scales, fmt, second_moment, values.shape)


# (exp_avg, sqrt(v)) bounds: measured on seeds 0-2 (5 stochastic roundings each) with about 10% headroom.
# 4-bit: exp_avg 0.284-0.289, sqrt(v) 0.043-0.044; 8-bit: exp_avg 0.011-0.0127, sqrt(v) 0.0017-0.0020.
BOUNDS = {"8-bit": (0.014, 0.0022), "4-bit": (0.32, 0.048)}


@pytest.mark.parametrize("fmt", [Q8, Q4], ids=["8bit", "4bit"])
def test_stored_moments_change_the_update_by_at_most_the_formats_bound(fmt):
    m_bound, v_bound = BOUNDS[fmt.name]
    for seed in range(3):
        m, v = _moment_like_blocks(seed)
        m_error = sum(_update_error(m, v, _round_trip(m, fmt, False, step), v) for step in range(1, 6)) / 5
        v_error = _update_error(m, v, m, _round_trip(v, fmt, True, 0))
        assert 0 < m_error <= m_bound, (seed, m_error)
        assert 0 < v_error <= v_bound, (seed, v_error)
