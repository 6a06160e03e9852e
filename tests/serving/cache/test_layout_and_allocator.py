"""Serving: cache layout bytes (exact) and the block allocator's invariants under random operations."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from v41cp.config import preset
from v41cp.serving.cache.allocator import AllocationError, BlockAllocator
from v41cp.serving.cache.spec import CacheSpec

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def test_flash_cache_bytes_match_the_release():
    spec = CacheSpec(preset("v41-flash"), block_tokens=64)
    assert spec.swa_bytes_per_row == 528
    assert [(g.source, g.ratio, g.kv_bytes_per_entry, g.index_bytes_per_entry) for g in spec.groups] == [
        (2, 2, 288, 68), (8, 2, 288, 68), (14, 2, 288, 68), (20, 1, 288, 68)]
    assert spec.global_bytes_per_token == 890                       # 3 x (288+68)/2 + (288+68)
    assert spec.block_bytes == 64 * 890
    assert spec.swa_bytes_per_request == 40 * 128 * 528
    assert spec.compressor_state_bytes_per_request == 3 * 1 * 2 * 512 * 4
    plain = CacheSpec(preset("v41-flash"), quantized=False)         # BF16 records
    assert plain.global_bytes_per_token == 3 * (1024 + 256) / 2 + (1024 + 256)
    with pytest.raises(ValueError, match="block_tokens=3"):
        CacheSpec(preset("v41-flash"), block_tokens=3)


def test_allocator_errors_name_the_request_and_leave_state_intact():
    a = BlockAllocator(num_blocks=4, block_tokens=8, max_batch=2, max_blocks_per_request=3)
    a.admit("a", 9)
    with pytest.raises(AllocationError, match="'a' is already active"):
        a.admit("a", 1)
    with pytest.raises(AllocationError, match="25 tokens exceed the per-request capacity of 24"):
        a.admit("b", 25)
    with pytest.raises(AllocationError, match="must be a positive integer"):
        a.admit("b", 0)
    with pytest.raises(AllocationError, match="unknown request id 'zz'"):
        a.cancel("zz")
    a.admit("b", 16)
    with pytest.raises(AllocationError, match="batch slots"):
        a.admit("c", 1)
    with pytest.raises(AllocationError, match="needs 1 more blocks, 0 free"):
        a.extend("a", 17)
    assert a.tokens("a") == 9 and a.blocks("a") == [0, 1] and a.free_blocks == 0
    a.check()


OPS = {"count": 0}


class AllocatorMachine(RuleBasedStateMachine):
    """Random admit / extend / finish / cancel; invariants checked after every step."""

    @initialize(blocks=st.integers(4, 64), block_tokens=st.sampled_from([2, 4, 8, 64]),
                batch=st.integers(1, 8), per_req=st.integers(1, 16))
    def setup(self, blocks, block_tokens, batch, per_req):
        self.a = BlockAllocator(blocks, block_tokens, batch, per_req)
        self.model: dict[int, int] = {}
        self.next_id = 0

    @rule(tokens=st.integers(-2, 300))
    def admit(self, tokens):
        rid = self.next_id
        self.next_id += 1
        expect_ok = self.a.can_admit(tokens) if tokens > 0 else False
        free_before = self.a.free_blocks
        try:
            self.a.admit(rid, tokens)
            assert expect_ok
            self.model[rid] = tokens
        except AllocationError:
            assert not expect_ok and self.a.free_blocks == free_before and rid not in self.a

    @precondition(lambda self: self.model)
    @rule(data=st.data(), grow=st.integers(0, 200))
    def extend(self, data, grow):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        before = (self.a.blocks(rid), self.a.free_blocks)
        try:
            self.a.extend(rid, self.model[rid] + grow)
            self.model[rid] += grow
        except AllocationError:
            assert (self.a.blocks(rid), self.a.free_blocks) == before

    @precondition(lambda self: self.model)
    @rule(data=st.data(), cancel=st.booleans())
    def release(self, data, cancel):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        (self.a.cancel if cancel else self.a.finish)(rid)
        del self.model[rid]

    @rule()
    def duplicate_or_unknown(self):
        if self.model:
            with pytest.raises(AllocationError):
                self.a.admit(next(iter(self.model)), 1)
        with pytest.raises(AllocationError):
            self.a.cancel(-1)

    @invariant()
    def consistent(self):
        OPS["count"] += 1
        if hasattr(self, "a"):
            self.a.check()
            assert {r: self.a.tokens(r) for r in self.model} == self.model

    def teardown(self):
        if hasattr(self, "a"):
            for rid in list(self.model):
                self.a.finish(rid)
            self.a.check()
            assert self.a.free_blocks == self.a.num_blocks and self.a.free_slots == self.a.max_batch


AllocatorMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=200, deadline=None,
                                              derandomize=True)
TestAllocator = AllocatorMachine.TestCase


def test_allocator_saw_at_least_10000_operations():
    """Runs after TestAllocator (file order): the machine must have executed >= 10,000 checked steps."""
    if OPS["count"] == 0:
        pytest.skip("TestAllocator was deselected")
    print(f"\n[allocator] {OPS['count']} checked random operations")
    assert OPS["count"] >= 10_000, OPS["count"]


def test_v4_flash_cache_bytes_match_the_release_and_split_over_kvp():
    """DeepSeek-V4-Flash with the release's records: 584 B main entries (C4, C128) and window rows, 68 B C4 index
    keys, 21 CSA + 20 HCA groups; one 1M-token request's pages hold 3.43 GiB (seed 001: "roughly 3.44 GiB"), and
    under KVP = 8 each rank holds 1/8 of its pages (the window and compressor rings replicated)."""
    cfg = preset("v4-flash")
    spec = CacheSpec(cfg)                                            # the model's page
    assert spec.block_tokens == cfg.page_tokens == 128 and spec.v4_record_bytes == 584 and spec.swa_bytes_per_row == 584
    groups = [(g.ratio, g.kv_bytes_per_entry, g.index_bytes_per_entry) for g in spec.groups]
    assert groups.count((4, 584, 68)) == 21 and groups.count((128, 584, 0)) == 20 and len(groups) == 41
    assert spec.global_bytes_per_token == 21 * (584 + 68) / 4 + 20 * 584 / 128
    one, eight = spec.per_request(1 << 20), spec.per_request(1 << 20, kvp=8)
    assert one["global"] == (1 << 20) * spec.global_bytes_per_token
    assert abs(one["global"] / 2**30 - 3.44) < 0.01                   # 3.432 GiB of pages (+ 3.2 MB window rows)
    assert eight["global"] * 8 == one["global"] and eight["swa"] == one["swa"] == 43 * 128 * 584
    plain = CacheSpec(cfg, block_tokens=128, quantized=False)       # fake-quant off: BF16 values
    assert plain.global_bytes_per_token == 21 * (1024 + 256) / 4 + 20 * 1024 / 128


def test_bf16_value_stores_are_words_written_in_place():
    """A BF16 model's unquantized stores hold the values' 16-bit words (uint16): a write then a read returns the
    BF16-rounded values (an out-of-bounds row dropped), and writing entries into a pool compiles with no temporary of
    the pool's size (XLA:CPU runs a BF16 scatter in FP32 on a copy of the whole array: 2x the pool)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from v41cp.serving.cache import paged as pc
    from v41cp.serving.cache.device_cache import declare_cache

    cfg = preset("tiny", dtype="bfloat16", fake_quant=False)
    decl = declare_cache(cfg, 64, 16, 2)
    assert decl.swa.dtype == jnp.uint16 and all(d.dtype == jnp.uint16 for d in decl.ckv.values())
    pool = jnp.zeros((64, 8, cfg.head_dim), jnp.uint16)
    values = jnp.asarray(np.random.default_rng(0).normal(size=(3, cfg.head_dim)), jnp.float32)
    at = (jnp.array([5, 63, 64]), jnp.array([1, 7, 0]))                     # the third out of bounds: dropped
    pool = pc.write(cfg, pool, at, values, "nvfp4")
    got = pc.read(pool, "nvfp4", jnp.float32, lambda a: a[at[0][:2], at[1][:2]])
    np.testing.assert_array_equal(got, values[:2].astype(jnp.bfloat16).astype(jnp.float32))
    assert int(jnp.count_nonzero(pool)) == 2 * cfg.head_dim - int(jnp.sum(values[:2].astype(jnp.bfloat16) == 0))
    big = jax.ShapeDtypeStruct((4096, 8, cfg.head_dim), jnp.uint16)
    write = jax.jit(lambda p, v: pc.write(cfg, p, at, v, "nvfp4"), donate_argnums=0)
    temp = write.lower(big, values).compile().memory_analysis().temp_size_in_bytes
    assert temp < 4096 * 8 * cfg.head_dim * 2 // 100, temp
