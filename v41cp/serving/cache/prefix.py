"""Exact prefix caching: a tree of full cache blocks keyed by their tokens, with the per-request state at its nodes.

Host-side bookkeeping only (integers and opaque state handles); the engine owns the device arrays.

**Granularity.** A node is one logical block (``block_tokens`` tokens, a multiple of every compress ratio — the LCM
rule of `v41cp.serving.cache.spec`): after ``k`` whole blocks every ratio-2 pair is closed and every compressed
entry and index key of positions ``< k · block_tokens`` lives in blocks ``0 .. k − 1``, which later positions never
write. Under KVP a block's owner is ``block id mod N`` (`v41cp.sharding.ownership`), so cached pages never move:
a request that reuses a chain takes the chain's residue class for its own later blocks and stays page-cyclic; the
KVP size adds no factor to the granularity.

**State at a boundary.** What is not in pages — every layer's window ring (the last ``sliding_window`` rows), the
open ratio-2 pair and the drafter's context window — cannot be recomputed exactly from the pages (a window row
depends on the window rows before it, back to position 0), so it is *stored*: a node may carry a snapshot of the
slot state taken when a request's prefill reached that boundary exactly (`v41cp.serving.cache.slot_state`). A request
resumes only at a node with a snapshot (the *hit*); matched blocks past it are recomputed (bit-identically) into
the request's own blocks. Snapshots are taken at two boundaries per request: the last whole block of its prompt
that leaves at least one token to prefill, and the branch point where its prompt leaves the tree (so that the next
request sharing only that part hits).

**Lifetime.** Every node holds one block. Running requests hold references on the nodes they matched or inserted;
a node is evicted (least recently used first, leaves first, so chains stay whole) only with no reference, and
snapshots beyond ``max_states`` are dropped LRU (the node stays as a chain link). Cached blocks are never written:
a request reads the shared blocks and writes only blocks it allocated itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from v41cp.serving.cache.allocator import content_residue

__all__ = ["Admission", "PrefixCache", "PrefixMatch", "PrefixNode", "admit", "grow"]


@dataclass(eq=False)
class PrefixNode:
    """One cached block: its virtual block id, the tokens it holds and the node before it (None: first block)."""

    block: int
    tokens: tuple[int, ...]
    parent: "PrefixNode | None"
    depth: int                                   # blocks from the start, this one included
    children: dict = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    state: object = None                         # the slot state after this block, or None


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt's match: ``nodes`` — the chain of its leading whole blocks found in the tree (depth order);
    ``hit`` — how many of them the request reuses (the deepest with a snapshot; 0: a cold start)."""

    nodes: tuple[PrefixNode, ...]
    hit: int


class PrefixCache:
    """See the module docstring. ``block_tokens``: tokens per node; ``max_states``: snapshots kept at most."""

    def __init__(self, block_tokens: int, max_states: int):
        for name, v in (("block_tokens", block_tokens), ("max_states", max_states)):
            if type(v) is not int or v <= 0:
                raise ValueError(f"prefix cache {name} must be a positive integer, got {v!r}")
        self.block_tokens, self.max_states = block_tokens, max_states
        self._roots: dict[tuple[int, ...], PrefixNode] = {}
        self._nodes: list[PrefixNode] = []
        self._clock = itertools.count(1)
        self.stats = {"queries": 0, "hits": 0, "prompt_tokens": 0, "hit_tokens": 0, "inserted_blocks": 0,
                      "evicted_blocks": 0, "states_taken": 0, "states_dropped": 0}

    # ------------------------------------------------------------------ queries
    @property
    def blocks(self) -> list[int]:
        """Every block the cache holds."""
        return [n.block for n in self._nodes]

    @property
    def nodes(self) -> tuple[PrefixNode, ...]:
        return tuple(self._nodes)

    @property
    def reclaimable(self) -> int:
        """Blocks no running request holds (evicted on demand; a held node's chain up to the root is held too)."""
        return sum(n.refs == 0 for n in self._nodes)

    @property
    def states(self) -> int:
        return sum(n.state is not None for n in self._nodes)

    def _children(self, node: PrefixNode | None) -> dict:
        return self._roots if node is None else node.children

    def match(self, prompt, max_blocks: int) -> PrefixMatch:
        """The longest chain of ``prompt``'s first ``≤ max_blocks`` whole blocks in the tree, and its hit."""
        bt, node, nodes = self.block_tokens, None, []
        for i in range(max_blocks):
            key = tuple(prompt[i * bt:(i + 1) * bt])
            nxt = self._children(node).get(key)
            if len(key) < bt or nxt is None:
                break
            nodes.append(nxt)
            node = nxt
        hit = max((i + 1 for i, n in enumerate(nodes) if n.state is not None), default=0)
        return PrefixMatch(tuple(nodes), hit)

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request (its prompt length and the tokens it did not prefill)."""
        st = self.stats
        st["queries"] += 1
        st["hits"] += hit_tokens > 0
        st["prompt_tokens"] += prompt_tokens
        st["hit_tokens"] += hit_tokens

    def summary(self) -> dict:
        st = self.stats
        return {**st, "hit_rate": st["hit_tokens"] / st["prompt_tokens"] if st["prompt_tokens"] else 0.0,
                "cached_blocks": len(self._nodes), "reclaimable_blocks": self.reclaimable, "states": self.states}

    # ------------------------------------------------------------------ references
    def acquire(self, nodes) -> None:
        t = next(self._clock)
        for n in nodes:
            n.refs += 1
            n.last_used = t

    def release(self, nodes) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise AssertionError(f"prefix node of block {n.block} released more often than acquired")
            n.refs -= 1

    # ------------------------------------------------------------------ growth
    def insert(self, parent: PrefixNode | None, token_blocks, blocks) -> tuple[list[PrefixNode], list[int]]:
        """Extend the chain after ``parent`` by whole blocks (``token_blocks[i]`` the tokens of block id
        ``blocks[i]``), every node acquired once for the caller. Returns ``(nodes, adopted)``: the chain's nodes
        and the positions in ``blocks`` the cache now owns (a block whose tokens were already cached there stays
        the caller's: its node is the existing one)."""
        nodes, adopted, t = [], [], next(self._clock)
        node = parent
        for i, (toks, b) in enumerate(zip(token_blocks, blocks)):
            toks = tuple(int(x) for x in toks)
            if len(toks) != self.block_tokens:
                raise ValueError(f"prefix cache: block {b} has {len(toks)} tokens, not {self.block_tokens}")
            kids = self._children(node)
            nxt = kids.get(toks)
            if nxt is None:
                nxt = PrefixNode(b, toks, node, (node.depth if node else 0) + 1)
                kids[toks] = nxt
                self._nodes.append(nxt)
                adopted.append(i)
                self.stats["inserted_blocks"] += 1
            nxt.refs += 1
            nxt.last_used = t
            nodes.append(nxt)
            node = nxt
        return nodes, adopted

    def set_state(self, node: PrefixNode, state) -> None:
        """Attach a snapshot to ``node`` (kept if it has one: equal by construction); drops the least recently
        used snapshots beyond ``max_states``."""
        if node.state is not None:
            return
        node.state = state
        node.last_used = next(self._clock)
        self.stats["states_taken"] += 1
        held = sorted((n for n in self._nodes if n.state is not None), key=lambda n: n.last_used)
        for n in held[: max(0, len(held) - self.max_states)]:
            n.state = None
            self.stats["states_dropped"] += 1

    # ------------------------------------------------------------------ eviction
    def evictable(self) -> list[PrefixNode]:
        """Leaves no running request holds, least recently used first."""
        return sorted((n for n in self._nodes if n.refs == 0 and not n.children), key=lambda n: n.last_used)

    def evict(self, node: PrefixNode) -> int:
        """Remove leaf ``node`` (no references, no children); returns its block for the allocator to free."""
        if node.refs or node.children:
            raise AssertionError(f"prefix node of block {node.block} is held ({node.refs} refs) or has children")
        del self._children(node.parent)[node.tokens]
        self._nodes.remove(node)
        self.stats["evicted_blocks"] += 1
        return node.block

    def check(self) -> None:
        """Raise AssertionError unless the tree is consistent (every node reachable once, depths and refs sane)."""
        seen, stack = [], [(None, n) for n in self._roots.values()]
        while stack:
            parent, n = stack.pop()
            assert n.parent is parent and n.depth == (parent.depth if parent else 0) + 1, "broken chain"
            assert n.refs >= 0, "negative references"
            seen.append(n)
            stack.extend((n, c) for c in n.children.values())
        assert len(seen) == len(self._nodes) and {id(n) for n in seen} == {id(n) for n in self._nodes}, \
            "a node is unreachable or listed twice"
        assert len(set(self.blocks)) == len(self._nodes), "a block is cached twice"
        assert self.states <= self.max_states, "more snapshots than max_states"


# ---------------------------------------------------------------------------------------- with the allocator
@dataclass(frozen=True)
class Admission:
    """A request admitted with prefix caching: ``cached`` prompt tokens reused (its slot must get ``state``), the
    prefix nodes it holds (release them when it ends), and the prompt positions where its prefill must stop to
    `grow` the cache (``cuts``, ascending block boundaries)."""

    cached: int
    nodes: list
    state: object
    cuts: tuple[int, ...]


def admit(alloc, cache: PrefixCache, rid, prompt, need: int) -> Admission | None:
    """Admit request ``rid`` (``need`` tokens of blocks, `v41cp.serving.cache.allocator.BlockAllocator`) reusing the
    longest chain of ``prompt``'s whole blocks that has a stored state and leaves at least one prompt token to
    prefill. None: it does not fit now, even with every cached block no running request holds evicted — only
    running requests hold what it needs, and they free it as they end (nothing changed).

    The plans, best first; the first that fits once the cache's unreferenced blocks are evicted is taken, and
    only then are blocks evicted (least recently used leaves first, only as many as it needs):

    1. the whole match held (its blocks past the hit have no stored state, so the request recomputes them into
       blocks of its own; holding them keeps them cached);
    2. the hit only: the matched blocks past it are left to eviction;
    3. cold: no block reused (a matched chain's page cycle kept, else the content placement `content_residue`);
    4. with no match, any page cycle that fits.

    Every plan stops its prefill at the branch point where the prompt leaves the matched chain to store the state
    there (`grow` finds the chain's node, or re-creates it from the request's blocks if it was evicted), so the next
    request sharing that part hits. With no request running every cached block is evictable, so a request that
    `BlockAllocator.fits_when_empty` is always admitted then (plan 3 or 4): admission never waits on nothing."""
    if not alloc.free_slots:
        return None
    bt = cache.block_tokens
    m = cache.match(prompt, (len(prompt) - 1) // bt)
    if m.nodes:                              # own blocks continue the chain's page cycle, so the chain stays cyclic
        chain = m.nodes[0].block % alloc.n
        plans = [(m.nodes, m.hit, chain)] + ([(m.nodes[: m.hit], m.hit, chain)] if m.hit else []) + [((), 0, chain)]
    else:
        plans = [((), 0, content_residue(prompt, bt, alloc.n)), ((), 0, None)]
    for nodes, hit, residue in plans:
        held = {id(n) for n in nodes}
        reclaim = [n.block for n in cache.nodes if n.refs == 0 and id(n) not in held]
        if alloc.can_admit(need, hit, residue, reclaim):
            break
    else:
        return None
    cache.acquire(nodes)                                           # held: not evicted below
    while not alloc.can_admit(need, hit, residue):                 # feasible above: the victims suffice
        for victim in cache.evictable():                           # a round of leaves, least recently used first
            alloc.free([cache.evict(victim)])
            if alloc.can_admit(need, hit, residue):
                break
    alloc.admit(rid, need, prefix=[n.block for n in nodes[:hit]], residue=residue)
    cached = hit * bt
    cache.record(len(prompt), cached)
    matched, end = len(m.nodes), (len(prompt) - 1) // bt * bt
    branch = matched * bt if matched > m.hit else 0                # where the prompt leaves the cached states
    cuts = tuple(sorted({c for c in (branch, end) if c > cached}))
    return Admission(cached, list(nodes), nodes[hit - 1].state if hit else None, cuts)


def grow(alloc, cache: PrefixCache, rid, prompt, nodes: list, cut: int) -> PrefixNode:
    """Request ``rid``'s prefill has reached block boundary ``cut``: its whole blocks up to there not cached yet
    join the cache after ``nodes`` (the chain it holds, extended in place; the new blocks are given to the cache).
    Returns the node at ``cut``: store the slot state there (`PrefixCache.set_state`)."""
    bt, k = cache.block_tokens, len(nodes)
    if cut % bt or cut <= 0:
        raise ValueError(f"prefix cache: {cut} is not a positive multiple of block_tokens={bt}")
    if cut > k * bt:
        blocks = alloc.blocks(rid)[k:cut // bt]
        toks = [prompt[i * bt:(i + 1) * bt] for i in range(k, cut // bt)]
        new, adopted = cache.insert(nodes[-1] if nodes else None, toks, blocks)
        alloc.give(rid, [k + i for i in adopted])
        nodes += new
    return nodes[cut // bt - 1]
