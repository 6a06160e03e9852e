"""Compiled-memory structure of the layers' scheduling helpers (`v41cp.layers.common`): a prefill's per-layer
buffers — weight operand copies (`weight_for`), loop accumulators (`full_after`) — are live one layer at a time,
so the compiled temporaries do not grow with the number of layers. Measured exactly from XLA's memory analysis of
small programs (one per variant)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from v41cp.layers.common import TIE_ROWS, full_after, weight_for

D = 512                  # a layer's BF16 weight [D, D]: its FP32 operand copy (the CPU backend's) is 1 MiB


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _layers(n: int, tie: bool, rows: int = TIE_ROWS):
    def run(x, ws):
        for i in range(n):
            w = weight_for(ws[i], x) if tie else ws[i].astype(x.dtype)
            x = jnp.tanh(x @ w)
        return x
    x = jax.ShapeDtypeStruct((rows, D), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((n, D, D), jnp.bfloat16)
    return run, x, ws


def test_weight_for_keeps_weight_copies_per_layer():
    """A chain of BF16 products over `TIE_ROWS` rows: through `weight_for` the compiled temporaries are the same
    for 2 and 8 layers (each layer's operand copy is made at the layer); the plain cast's are checked to grow
    where the backend makes copies (so the test measures the thing it guards)."""
    tied = {n: _temp_bytes(*_layers(n, True)) for n in (2, 8)}
    plain = {n: _temp_bytes(*_layers(n, False)) for n in (2, 8)}
    print(f"\n[weight_for] temporaries 2 → 8 layers: tied {tied[2]} → {tied[8]} B, plain cast {plain[2]} → {plain[8]} B")
    assert tied[8] == tied[2], tied
    if jax.default_backend() == "cpu":        # FP32 operand copies of BF16 weights, scheduled at the start
        assert plain[8] >= plain[2] + 6 * D * D * 4, plain


def test_weight_for_is_exact_and_leaves_small_forwards_alone():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((D, 8)), jnp.bfloat16)
    for rows in (4, TIE_ROWS):
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.bfloat16)
        got = jax.jit(lambda x, w: weight_for(w, x, jnp.float32))(x, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w.astype(jnp.float32)))
    x = x.at[0, 0].set(jnp.nan)                 # a non-finite first element still gives the weight itself
    np.testing.assert_array_equal(np.asarray(weight_for(w, x)), np.asarray(w))
    small = jax.make_jaxpr(lambda x, w: weight_for(w, x))(x[:4], w)
    assert [e.primitive.name for e in small.eqns] == [], small     # no dependency below TIE_ROWS rows


def test_full_after_keeps_loop_buffers_per_layer():
    """Layers that each accumulate into a loop buffer: with the buffer built by `full_after` the compiled
    temporaries hold no more buffers for 8 layers than for 2; with a constant initial buffer every layer's is
    allocated at the start (checked, so the test measures the thing it guards)."""
    rows, tiles = 256, 4

    def program(n: int, after: bool):
        def run(x):
            for _ in range(n):
                acc0 = full_after((rows, D), 0, jnp.float32, x) if after else jnp.zeros((rows, D), jnp.float32)

                def body(i, acc):
                    return acc + jnp.sin(x * (i + 1).astype(x.dtype))
                x = jax.lax.fori_loop(0, tiles, body, acc0) * 0.5
            return x
        return run, jax.ShapeDtypeStruct((rows, D), jnp.float32)

    got = {n: _temp_bytes(*program(n, True)) for n in (2, 8)}
    const = {n: _temp_bytes(*program(n, False)) for n in (2, 8)}
    print(f"\n[full_after] temporaries 2 → 8 layers: full_after {got[2]} → {got[8]} B, constant {const[2]} → "
          f"{const[8]} B")
    buffer = rows * D * 4
    assert got[8] - got[2] < buffer // 64, got          # a few scalars per layer, no buffer
    assert const[8] >= const[2] + 6 * buffer, const     # the hoisting it guards against
