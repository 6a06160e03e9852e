"""Released tensors → one parameter, one shard at a time: every `Layout`'s region read equals the whole
transform's region; quantized regions (FP8 32×32 blocks, FP8 rows, packed FP4) decode as the whole-tensor
decoders do, at ragged, non-contiguous and odd-column indices."""

import numpy as np
import pytest

from v41cp.checkpoint import ReleasedCheckpoint, default_released_checkpoint
from v41cp.checkpoint.formats import dequant_fp4_rows, dequant_fp8_blocks, dequant_fp8_rows
from v41cp.checkpoint.layouts import GroupsIn, GroupsOut, HeadsOut, PaddedRows, Same, Stacked, Transposed

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

RNG = np.random.default_rng(0)


def _subset(n: int, rng) -> np.ndarray:
    """An ascending index set over ``n``: a contiguous range, or a random (non-contiguous) subset."""
    if rng.random() < 0.5:
        a = int(rng.integers(0, n))
        return np.arange(a, int(rng.integers(a + 1, n + 1)))
    return np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False))


CASES = [  # (layout, stored shapes)
    (Same(), [(6, 10)]), (Same(), [(7,)]), (Transposed(), [(6, 10)]), (HeadsOut(3, 4), [(12, 5)]),
    (GroupsIn(2, 3), [(6, 7)]), (GroupsOut(2, 3), [(5, 6)]), (Stacked(), [(4, 6)] * 3),
    (Stacked(transpose=True), [(4, 6)] * 3), (PaddedRows(5, 3), [(5, 4)]),
]


@pytest.mark.parametrize("layout,shapes", CASES, ids=[f"{type(c[0]).__name__}{i}" for i, c in enumerate(CASES)])
def test_layout_region_equals_whole_transform_region(layout, shapes):
    stored = {f"k{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    keys = tuple(stored)
    whole = layout(*stored.values())
    reader = lambda key, index: stored[key][np.ix_(*index)]
    rng = np.random.default_rng(1)
    for _ in range(20):
        index = tuple(_subset(n, rng) for n in whole.shape)
        np.testing.assert_array_equal(layout.read(reader, keys, index), whole[np.ix_(*index)])


def test_quantized_regions_decode_as_whole_tensors():
    ckpt = ReleasedCheckpoint(default_released_checkpoint())
    kinds = {"F8_E4M3": [], "I8": []}
    for key, info in ckpt.files.tensors.items():
        if info.dtype in kinds:
            kinds[info.dtype].append(key)
    fp8_blocks = next(k for k in kinds["F8_E4M3"] if ".engram." not in k and ckpt.logical_shape(k)[1] > 32)
    fp8_rows = next(k for k in kinds["F8_E4M3"] if ".engram.embed." in k)
    fp4 = kinds["I8"][0]
    scale = lambda k: ckpt.files.read(k[: -len(".weight")] + ".scale")
    wholes = {fp8_blocks: dequant_fp8_blocks(ckpt.files.read(fp8_blocks), scale(fp8_blocks)),
              fp8_rows: dequant_fp8_rows(ckpt.files.read(fp8_rows), scale(fp8_rows)),
              fp4: dequant_fp4_rows(ckpt.files.read(fp4), scale(fp4))}
    rng = np.random.default_rng(2)
    for key, whole in wholes.items():
        for _ in range(12):                       # ragged blocks, odd FP4 columns, scattered rows
            index = (_subset(whole.shape[0], rng), _subset(whole.shape[1], rng))
            got = ckpt.read_region(key, index, np.float32)
            np.testing.assert_array_equal(got, whole[np.ix_(*index)], err_msg=key)
    raw = ckpt.read_region(fp4, (np.arange(3), np.arange(1, 4)), None, raw=True)
    np.testing.assert_array_equal(raw, ckpt.files.read(fp4).view(np.uint8)[:3, 1:4])
