"""The quantizer-boundary machinery the exactness tests lean on (`helpers.record_code_flips`): two caches' byte
records may differ only by codes one step apart — an input on a rounding boundary of its format — and it must refuse
anything more: two steps, a block scale two code steps apart, many flips."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import record_code_flips

from v41cp.config import preset
from v41cp.serving.cache.records import encode

V4 = preset("tiny-v4", fake_quant=True, head_dim=80)        # window / entries fp8_ds_mla, index keys MXFP4
V41 = preset("tiny")                                          # window FP8, entries NVFP4, index keys MXFP4
ROPE = V4.qk_rope_head_dim


def _cache(cfg, window: np.ndarray, entries: np.ndarray, keys: np.ndarray) -> dict:
    """A `cache_by_virtual_block`-shaped dict: a window store ``.swa`` [layers 2, slots 4, rows 8, ·], an entries
    store ``.ckv['3']`` and an index-key store ``.ikey['3i']`` (pages [8, 8, ·]), and a float leaf the comparison
    leaves alone."""
    out = {".open_kv['3']": np.zeros((2, 8), np.float32)}
    for prefix, x, fmt in ((".swa", window, cfg.cache_formats.window), (".ckv['3']", entries, cfg.cache_formats.entries),
                           (".ikey['3i']", keys, cfg.cache_formats.index)):
        rec = encode(jnp.asarray(x), fmt, ROPE if fmt == "fp8_ds_mla" else 0)
        out.update({f"{prefix}['{leaf}']": np.asarray(a) for leaf, a in rec.items()})
    return out


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(2, 4, 8, cfg.head_dim)).astype(np.float32),
            rng.normal(size=(8, 8, cfg.head_dim)).astype(np.float32),
            rng.normal(size=(8, 8, cfg.index_head_dim)).astype(np.float32))


def _either_side(v: float) -> tuple[np.float32, np.float32]:
    """The FP32 neighbours of a rounding boundary at ``v``: two inputs one ulp apart that round to adjacent codes,
    whichever way the format breaks the tie at ``v``."""
    v = np.float32(v)
    return np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))


def _pair(cfg, edit, seed=0):
    """``(got, want)`` caches of the same inputs, ``edit(got inputs, want inputs)`` applied first."""
    got, want = _inputs(cfg, seed), _inputs(cfg, seed)
    edit(got, want)
    return _cache(cfg, *got), _cache(cfg, *want)


def _boundaries(cfg):
    """One value per store on a rounding boundary, each side in one cache: a window e4m3 code (block amax 448: scale
    1; 1.0625 lies between e4m3 1 and 1.125), an entry's BF16 RoPE word (V4: 1 + 2^-8 between 1 and 1 + 2^-7) or
    NVFP4 code (scale 6 / 6 = 1: 2.5 between e2m1 2 and 3), an index key's MXFP4 code (scale 1: 0.75 between 0.5
    and 1)."""
    def edit(got, want):
        for g, w in zip(got, want, strict=True):
            g[...] = w[...] = 0.0
        for x in (got, want):
            x[0][1, 2, 3, :2] = [448.0, 0.0]
            x[2][1, 2, :2] = [6.0, 0.0]
            if not cfg.is_v4:
                x[1][0, 1, :2] = [6.0, 0.0]
        got[0][1, 2, 3, 1], want[0][1, 2, 3, 1] = _either_side(1.0625)
        at = (0, 1, -1) if cfg.is_v4 else (0, 1, 1)
        got[1][at], want[1][at] = _either_side(1 + 2.0**-8 if cfg.is_v4 else 2.5)
        got[2][1, 2, 1], want[2][1, 2, 1] = _either_side(0.75)
    return edit


@pytest.mark.fast
@pytest.mark.parametrize("cfg", [V4, V41], ids=["v4", "v41"])
def test_one_step_flips_are_reported_where_they_are(cfg):
    got, want = _pair(cfg, lambda g, w: None)
    assert record_code_flips(got, want, cfg) == {}
    got, want = _pair(cfg, _boundaries(cfg))
    flips = record_code_flips(got, want, cfg, "boundaries")
    entry = "['r']" if cfg.is_v4 else "['q']"
    assert sorted(flips) == sorted([".swa['q']", f".ckv['3']{entry}", ".ikey['3i']['q']"])
    assert np.argwhere(flips[".swa['q']"]).tolist() == [[1, 2, 3]]          # layer, slot, window row
    assert np.argwhere(flips[f".ckv['3']{entry}"]).tolist() == [[0, 1]]     # page, entry
    assert np.argwhere(flips[".ikey['3i']['q']"]).tolist() == [[1, 2]]
    assert all(int(c.sum()) == 1 for c in flips.values())                   # one code each


@pytest.mark.fast
@pytest.mark.parametrize("cfg", [V4, V41], ids=["v4", "v41"])
def test_a_block_scale_one_step_apart_is_one_step_on_the_coarser_scale(cfg):
    """A block's largest value on either side of a scale boundary: every code of the block requantized, each within
    one step of the other on the coarser scale. The window's ue8m0 scale (FP8 / fp8_ds_mla): amax just under /
    over 448·2^-3 gives 2^-3 / 2^-2; V4.1's NVFP4 entry scale (e4m3 of amax / 6): amax 6·1.0625 lies between the
    scales 1 and 1.125."""
    def edit(got, want):
        got[0][1, 3, 5, 0], want[0][1, 3, 5, 0] = 448 * 2.0**-3 * (1 + 1e-6), 448 * 2.0**-3 * (1 - 1e-6)
        if not cfg.is_v4:
            got[1][2, 4, 0], want[1][2, 4, 0] = 6 * 1.0625 * (1 + 1e-6), 6 * 1.0625 * (1 - 1e-6)
    flips = record_code_flips(*_pair(cfg, edit), cfg)
    assert np.argwhere(flips[".swa['s']"]).tolist() == [[1, 3, 5]]
    if not cfg.is_v4:
        assert np.argwhere(flips[".ckv['3']['s']"]).tolist() == [[2, 4]]


def _scaled(which, factor):
    def edit(got, want):
        x = got[which][(1, 1, 1) if which == 0 else (1, 1)]
        x[0] = factor * np.abs(x).max()                # the block's largest value `factor` × (scale × factor)
    return edit


@pytest.mark.fast
@pytest.mark.parametrize("cfg, what, edit", [
    (V4, "payload codes more than one step apart", lambda g, w: g[1].__setitem__((0, 0, 5), g[1][0, 0, 5] * 1.3)),
    (V4, "BF16 RoPE words more than one step apart", lambda g, w: g[1].__setitem__((0, 0, -2), g[1][0, 0, -2] * 1.01)),
    (V4, "a block scale more than one step apart", _scaled(0, 4.0)),           # ue8m0 ×4: two steps
    (V41, "a block scale more than one step apart", _scaled(1, 1.3)),          # NVFP4's e4m3 scale: ≥ two steps
    (V4, "a block scale more than one step apart", _scaled(2, 40.0)),
    (V4, "codes one step apart", lambda g, w: g[1].__iadd__(np.where(np.arange(g[1].shape[-1]) < 64, 0.02 * g[1], 0))),
    (V4, "pad", lambda g, w: None),
], ids=["e4m3-two-steps", "bf16-two-steps", "ue8m0-x4", "nvfp4-scale", "mxfp4-scale", "many-flips", "pad-bytes"])
def test_more_than_a_rounding_boundary_is_refused(cfg, what, edit):
    got, want = _pair(cfg, edit, seed=1)
    if what == "pad":                                  # fp8_ds_mla's scale bytes padded to 8: the padding is zero
        got[".ckv['3']['s']"] = got[".ckv['3']['s']"].copy()
        got[".ckv['3']['s']"][0, 0, -1] = 1
    with pytest.raises(AssertionError, match=what):
        record_code_flips(got, want, cfg)
