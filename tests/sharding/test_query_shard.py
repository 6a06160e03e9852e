"""QueryShardPlan (model-wide QCP rows): coverage, zigzag balance and the restore maps, exhaustively over small
batches and on random ragged ones."""

import itertools

import numpy as np
import pytest

from v41cp.sharding.query_shard import QueryShardPlan, fresh_visible_total, zigzag_blocks

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def _check(lengths, n):
    plan = QueryShardPlan.build(lengths, n)
    total = sum(lengths)
    rows = plan.local_rows[plan.local_rows >= 0]
    assert sorted(rows.tolist()) == list(range(total))                     # every row exactly once
    x = np.arange(total) * 10 + 7
    np.testing.assert_array_equal(plan.unshard(plan.shard(x)), x)           # restore ∘ shard = identity
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i, length in enumerate(lengths):                                    # per request: counts differ ≤ 1
        mine = [((plan.local_rows[r] >= offsets[i]) & (plan.local_rows[r] < offsets[i + 1])).sum() for r in range(n)]
        assert max(mine) - min(mine) <= 1
        if length:
            assert plan.restore[offsets[i + 1] - 1] == plan.sampled[i]
            blocks = zigzag_blocks(length, n)
            for r in range(n):                                               # rank r: blocks r and 2n−1−r
                want = [offsets[i] + j for b in (r, 2 * n - 1 - r) for j in range(*blocks[b])]
                got = [v for v in plan.local_rows[r] if offsets[i] <= v < offsets[i + 1]]
                assert got == want
        else:
            assert plan.sampled[i] == -1
    per_rank = plan.rows_per_rank()
    assert per_rank.max() - per_rank.min() <= len(lengths)
    assert plan.capacity == per_rank.max()
    pos = plan.positions()
    req = plan.request_of_slot()
    ok = plan.local_rows >= 0
    np.testing.assert_array_equal(pos[ok], plan.local_rows[ok] - offsets[req[ok]])


def test_exhaustive_small_batches():
    for b in (0, 1, 2, 3):                          # 0: an empty batch
        for lengths in itertools.product(range(7), repeat=b):
            for n in range(1, 9):
                _check(list(lengths), n)


def test_random_ragged_batches():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.choice([1, 2, 4, 8]))
        _check(rng.integers(0, 100, rng.integers(1, 9)).tolist(), n)


def test_zigzag_blocks_and_capacity_errors():
    assert zigzag_blocks(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    plan = QueryShardPlan.build([10], 2, capacity=8)
    assert plan.local_rows.tolist() == [[0, 1, 2, 8, 9, -1, -1, -1], [3, 4, 5, 6, 7, -1, -1, -1]]
    with pytest.raises(ValueError, match="needs 5 rows but capacity=4"):
        QueryShardPlan.build([10], 2, capacity=4)
    with pytest.raises(ValueError, match="negative extend length"):
        QueryShardPlan.build([3, -1], 2)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_fresh_visible_total_bounds_every_rank_of_a_fresh_pass(n):
    """The static bound the row-tiled selection schedules a fresh pass's key tiles by: for every request length
    to 2,000 (and packed batches), no rank's rows see more entries in total, at ratios 1, 2 and 4."""
    rng = np.random.default_rng(n)
    batches = [(length,) for length in range(2000)] + [tuple(rng.integers(0, 300, 4)) for _ in range(50)]
    for lengths in batches:
        plan = QueryShardPlan.build(lengths, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for r in range(n):
            rows = plan.local_rows[r][plan.local_rows[r] >= 0]
            pos = rows - offsets[np.searchsorted(offsets, rows, side="right") - 1]     # each row's position
            for ratio in (1, 2, 4):
                assert ((pos + 1) // ratio).sum() <= fresh_visible_total(plan.capacity, max(lengths), n, ratio), \
                    (lengths, r, ratio)
