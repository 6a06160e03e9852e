"""`StepBatch`, the one metadata record of every cached step: the decode constructor's layout (a leading chunk axis
kept for the token-serial prefill's scan), the idle bucket, the modes, and the rows' positions and validity in both
layouts (per request and packed)."""

import jax
import numpy as np
import pytest
from helpers import TOKEN_MAP

from v41cp.config import preset
from v41cp.serving.step_batch import CEDRows, ForwardMode, StepBatch

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def test_decode_rows_and_a_stacked_chunk():
    b = StepBatch.decode([7, 8, 0], [4, 9, 0], [2, 0, 1], np.full((3, 5), -1), [True, True, False],
                         np.zeros((3, 2, 4), np.int32))
    assert (b.max_batch, b.max_blocks, b.rows, b.mode) == (3, 5, 1, ForwardMode.DECODE)
    assert b.tokens.shape == (3, 1) and b.engram_ids.shape == (3, 1, 2, 4)
    assert np.asarray(b.lengths).tolist() == [1, 1, 0] and np.asarray(b.positions).tolist() == [[4], [9], [0]]
    chunk = StepBatch.decode(np.zeros((6, 1)), np.arange(6)[:, None], np.zeros((6, 1)), np.full((6, 1, 5), -1),
                             np.ones((6, 1), bool), np.zeros((6, 1, 2, 4), np.int32))
    assert (chunk.max_batch, chunk.max_blocks, chunk.tokens.shape) == (1, 5, (6, 1, 1))
    first = jax.tree.map(lambda a: a[0], chunk)             # what one step of the scan sees
    assert first.tokens.shape == (1, 1) and first.mode == ForwardMode.DECODE


def test_idle_verify_and_packed_rows():
    cfg = preset("tiny")
    idle = StepBatch.idle(cfg, 4, 3, rows=2)
    assert idle.mode == ForwardMode.VERIFY and not np.asarray(idle.row_valid).any()
    z = np.zeros(3, np.int32)
    packed = StepBatch(np.zeros((1, 8), np.int32), np.array([10, 0, 5]), np.array([3, 0, 4]), z,
                       np.full((3, 2), -1), np.zeros((1, 8, 0, 0), np.int32), 3, 2, 8,
                       CEDRows(np.array([1, 0, 2]), 4), np.array([0, 3, 3]))
    assert packed.mode == ForwardMode.PREFILL and packed.decoder_rows == 4
    assert np.asarray(packed.positions).tolist() == [[10, 11, 12, 5, 6, 7, 8, 9]]
    assert np.asarray(packed.row_valid).tolist() == [[True] * 7 + [False]]


def test_verify_rows_are_the_last_token_then_the_drafts():
    """`StepBatch.verify`: each request's last token then its drafts from its last position, as many rows as asked
    (the rest padding), idle batch rows past the requests; each row's Engram ids those of the decode step that would
    feed that token after the same history."""
    cfg = preset("tiny", engram_token_map=TOKEN_MAP)
    hist, drafts = [[5, 6, 7, 8], [9, 10]], np.array([[11, 12, 13], [14, 15, 16]])
    v = StepBatch.verify(cfg, hist, drafts, [4, 2], [3, 1], [[4, 5], [6]], 3, 2, 4)
    assert (v.max_batch, v.max_blocks, v.rows, v.mode) == (3, 2, 4, ForwardMode.VERIFY)
    assert np.asarray(v.tokens).tolist() == [[8, 11, 12, 13], [10, 14, 0, 0], [0, 0, 0, 0]]
    assert np.asarray(v.starts).tolist() == [3, 1, 0] and np.asarray(v.lengths).tolist() == [4, 2, 0]
    assert np.asarray(v.slots).tolist() == [3, 1, 0] and np.asarray(v.block_tables).tolist() == [[4, 5], [6, -1],
                                                                                                 [-1, -1]]
    for i, k in enumerate([4, 2]):
        for j in range(k):
            fed = hist[i] + drafts[i, :j].tolist()
            one = StepBatch.for_histories(cfg, [fed], [0], [[0]], 1, 1)
            np.testing.assert_array_equal(np.asarray(v.engram_ids)[i, j], np.asarray(one.engram_ids)[0, 0])
    eng = np.asarray(v.engram_ids)
    assert eng.shape == (3, 4, 2, cfg.engram_hash_heads) and len({eng[0, j].tobytes() for j in range(4)}) == 4
