"""The quantizer-boundary machinery the exactness tests lean on (`helpers.record_code_flips`): two caches' byte
records may differ only by codes one step apart — an input on a rounding boundary of its format — and it must refuse
anything more: two steps, a block scale two powers apart, many flips."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import record_code_flips

from v41cp.config import preset
from v41cp.serving.cache.records import encode

V4 = preset("tiny-v4", fake_quant=True, head_dim=80)        # window / entries fp8_ds_mla, index keys MXFP4
V41 = preset("tiny")                                          # window FP8, entries NVFP4, index keys MXFP4
ROPE = V4.qk_rope_head_dim


def _cache(cfg, entries: np.ndarray, keys: np.ndarray) -> dict:
    """A `cache_by_virtual_block`-shaped dict: one entries store ``.ckv['3']`` and one index-key store ``.ikey['3i']``
    (pages [8, 8, ·]), and a float leaf the comparison leaves alone."""
    out = {".open_kv['3']": np.zeros((2, 8), np.float32)}
    for pool, name, x, fmt in ((".ckv", "'3'", entries, cfg.cache_formats.entries),
                               (".ikey", "'3i'", keys, cfg.cache_formats.index)):
        rec = encode(jnp.asarray(x), fmt, ROPE if fmt == "fp8_ds_mla" else 0)
        out.update({f"{pool}[{name}]['{leaf}']": np.asarray(a) for leaf, a in rec.items()})
    return out


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(8, 8, cfg.head_dim)).astype(np.float32),
            rng.normal(size=(8, 8, cfg.index_head_dim)).astype(np.float32))


def _either_side(v: float) -> tuple[np.float32, np.float32]:
    """The FP32 neighbours of a rounding boundary at ``v``: two inputs one ulp apart that round to adjacent codes,
    whichever way the format breaks the tie at ``v``."""
    v = np.float32(v)
    return np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))


@pytest.mark.fast
@pytest.mark.parametrize("cfg", [V4, V41], ids=["v4", "v41"])
def test_one_step_flips_are_reported_where_they_are(cfg):
    entries, keys = _inputs(cfg)
    want = _cache(cfg, entries, keys)
    assert record_code_flips(want, want, cfg) == {}
    e2, k2 = entries.copy(), keys.copy()
    if cfg.is_v4:                                    # a BF16 RoPE channel: 1 + 2^-8 lies between 1 and 1 + 2^-7
        entries[0, 1, -1], e2[0, 1, -1] = _either_side(1 + 2.0**-8)
    else:                                            # NVFP4 (scale 6 / 6 = 1): 2.5 lies between e2m1 2 and 3
        entries[0, 1, :16] = e2[0, 1, :16] = [6.0] + [0.0] * 15
        entries[0, 1, 1], e2[0, 1, 1] = _either_side(2.5)
    keys[1, 2, :32] = k2[1, 2, :32] = [6.0] + [0.0] * 31      # MXFP4 (scale 1): 0.75 lies between 0.5 and 1
    keys[1, 2, 1], k2[1, 2, 1] = _either_side(0.75)
    flips = record_code_flips(_cache(cfg, entries, keys), _cache(cfg, e2, k2), cfg, "nudged")
    part = "['r']" if cfg.is_v4 else "['q']"
    assert sorted(flips) == sorted([f".ckv['3']{part}", ".ikey['3i']['q']"])
    assert np.argwhere(flips[f".ckv['3']{part}"]).tolist() == [[0, 1]]       # the page and entry of the flip
    assert np.argwhere(flips[".ikey['3i']['q']"]).tolist() == [[1, 2]]


@pytest.mark.fast
def test_a_block_scale_one_power_apart_is_one_step_on_the_coarser_scale():
    """FP8 (ue8m0 per 64): the block's largest value just under 448·2^-3 gives scale 2^-3, just above it 2^-2 — every
    code of the block requantized, each within one step of the other on the coarser scale."""
    entries, keys = _inputs(V4)
    e2 = entries.copy()
    e2[1, 3, 0], entries[1, 3, 0] = 448 * 2.0**-3 * (1 - 1e-6), 448 * 2.0**-3 * (1 + 1e-6)
    flips = record_code_flips(_cache(V4, entries, keys), _cache(V4, e2, keys), V4)
    assert ".ckv['3']['s']" in flips and np.argwhere(flips[".ckv['3']['s']"]).tolist() == [[1, 3]]


@pytest.mark.fast
@pytest.mark.parametrize("what, edit", [
    ("payload codes more than one step apart", lambda e, k: e.__setitem__((0, 0, 5), e[0, 0, 5] * 1.3)),
    ("BF16 RoPE words more than one step apart", lambda e, k: e.__setitem__((0, 0, -2), e[0, 0, -2] * 1.01)),
    ("a block scale more than one step apart", lambda e, k: k.__setitem__((1, 1, 3), 40 * np.abs(k[1, 1]).max())),
    ("codes one step apart", lambda e, k: e.__iadd__(np.where(np.arange(e.shape[-1]) < 64, 0.02 * e, 0))),
])
def test_more_than_a_rounding_boundary_is_refused(what, edit):
    entries, keys = _inputs(V4, seed=1)
    want = _cache(V4, entries, keys)
    edit(entries, keys)
    with pytest.raises(AssertionError, match=what):
        record_code_flips(_cache(V4, entries, keys), want, V4)
