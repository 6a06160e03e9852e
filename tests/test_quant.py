"""Fake-quant formats: bit-exact against the oracle's quantize_cache, and against the spec's table."""

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from v41cp import quant

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


@pytest.mark.oracle
@pytest.mark.parametrize("fmt,block", [("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)])
def test_bit_exact_vs_oracle(oracle, fmt, block):
    q = load_file(str(oracle.run("quant") / "quant.safetensors"))
    got = np.asarray(quant.fake_quant(jnp.asarray(q[f"input_{fmt}"]), fmt, block))
    want = q[f"output_{fmt}"]
    np.testing.assert_array_equal(got.view(np.uint32) & 0x7FFFFFFF, want.view(np.uint32) & 0x7FFFFFFF)
    np.testing.assert_array_equal(np.signbit(got) | (got == 0), np.signbit(want) | (want == 0))


@pytest.mark.oracle
def test_ragged_block_zero_padding_vs_oracle(oracle):
    q = load_file(str(oracle.run("quant") / "quant.safetensors"))
    got = np.asarray(quant.mxfp4_block32(jnp.asarray(q["input_ragged"])))
    np.testing.assert_array_equal(got, q["output_ragged_mxfp4"])


def test_e2m1_ties_round_to_even_code():
    # block max 6 → MXFP4 scale 1, so the listed values are the normalised values themselves
    x = np.array([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
                  + [0.0] * 16], np.float32)
    got = np.asarray(quant.mxfp4_block32(jnp.asarray(x)))[0, :16]
    np.testing.assert_array_equal(got, [6, 0, 1, 1, 2, 2, 4, 4, -0, -1, -1, -2, -2, -4, -4, 0])


def test_zero_block_and_pow2ceil():
    x = jnp.zeros((2, 64), jnp.float32)
    for fmt, block in (("fp8", 32), ("nvfp4", 16), ("mxfp4", 32)):
        assert not np.asarray(quant.fake_quant(x, fmt, block)).any()
    v = jnp.array([1.0, 1.5, 3.0, 0.3, 2.0 ** -20], jnp.float32)
    np.testing.assert_array_equal(np.asarray(quant.pow2ceil(v)), [1.0, 2.0, 4.0, 0.5, 2.0 ** -20])


def test_bf16_keeps_dtype():
    x = jnp.linspace(-3, 3, 64, dtype=jnp.bfloat16).reshape(1, 64)
    assert quant.fp8_block32(x).dtype == jnp.bfloat16
