"""mHC's Sinkhorn normalisation: the same arithmetic as a loop (CPU) and unrolled (GPU), equal to a float64
reference of the row / column passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v41cp.layers.mhc import sinkhorn

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def _reference(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    x = np.exp(logits - logits.max(-1, keepdims=True))
    x = x / x.sum(-1, keepdims=True) + eps
    x = x / (x.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(-1, keepdims=True) + eps)
        x = x / (x.sum(-2, keepdims=True) + eps)
    return x


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_equals_the_passes_in_order(iters):
    logits = 3 * jax.random.normal(jax.random.key(1), (3, 5, 4, 4), jnp.float32)
    got = np.asarray(jax.jit(sinkhorn, static_argnums=(1, 2))(logits, iters, 1e-6))
    want = _reference(np.asarray(logits, np.float64), iters, 1e-6)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_a_loop_on_a_cpu_and_unrolled_for_a_gpu():
    """XLA:CPU compiles the loop in ~0.56x the unrolled passes' time (docs/benchmarks.md); a GPU program keeps the
    unrolled passes (no per-pass kernel launches)."""
    traced = jax.jit(sinkhorn, static_argnums=(1, 2)).trace(jnp.zeros((2, 3, 4, 4), jnp.float32), 20, 1e-6)
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in cpu and cpu.count("stablehlo.divide") == 1 + 1 + 2   # softmax, column, loop body
    assert "stablehlo.while" not in gpu and gpu.count("stablehlo.divide") == 1 + 1 + 2 * 19
