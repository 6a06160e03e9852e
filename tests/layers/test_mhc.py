"""mHC's Sinkhorn normalisation: the same arithmetic as a loop (CPU) and unrolled (GPU), equal to a float64
reference of the row / column passes."""

import re

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
    unrolled passes (no per-pass kernel launches): no loop, the pass's body (traced once) called once per pass, which
    XLA inlines — compiled, the same program as 19 passes written out (checked on the CPU compiler: no loop, every
    pass's divides)."""
    traced = jax.jit(sinkhorn, static_argnums=(1, 2)).trace(jnp.zeros((2, 3, 4, 4), jnp.float32), 20, 1e-6)
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in cpu and cpu.count("stablehlo.divide") == 1 + 1 + 2   # softmax, column, loop body
    body = re.findall(r"func\.func private @(\w+)", gpu)
    assert "stablehlo.while" not in gpu and len(body) == 1 and gpu.count("stablehlo.divide") == 1 + 1 + 2
    assert len(re.findall(rf"call @{body[0]}\(", gpu)) == 19
    unrolled = jax.jit(lambda x: jax.lax.fori_loop(0, 19, lambda _, v: v / (v.sum(-1, keepdims=True) + 1.0), x,
                                                   unroll=True)).lower(jnp.ones((4, 4))).compile().as_text()
    assert "while" not in unrolled and unrolled.count(" divide(") == 19
