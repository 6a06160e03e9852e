"""Shared test helpers: loading an oracle export into the JAX model, error metrics, tie checks."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from v41cp.checkpoint import params_from_released
from v41cp.config import ModelConfig
from v41cp.engram_hash import compressed_token_map
from v41cp.serving.cache.device_cache import POOLS
from v41cp.sharding.topology import ParallelConfig

REPO = Path(__file__).resolve().parents[1]          # the repository root

TOKEN_MAP = tuple(min(i, 135) for i in range(256))

# Two programs (the paged step and the full forward, or forwards of two lengths) compute a quantizer's input to the
# last bit differently now and then; an input within that of a code boundary is stored as the neighbouring code, most
# often in the records' BF16 RoPE channels (a code per 2^-8 relative, against FP8's 2^-4). The entry or window row
# keeps it, so the rows that read it differ: measured up to 4.1e-4 (tiny-v4, head 80: a window row at position 24
# read by positions 24..31; an entry of request "b" from position 12, 1.1e-4). A misplaced quantizer (a format, the
# rotation, a cache that stores what the forward does not) moves every row by 7e-2..2e-1 (the fake-quant's own
# effect on these logits). Which inputs flip depends on the host CPU (docs/architecture.md §5, "Numerics of the CPU
# test run"). Exact equalities — records vs fake-quantized value stores, a prefix hit vs a cold prefill, PD vs
# aggregated — are asserted bit for bit or to 1e-5 as elsewhere; sharded vs one device with the flips measured once,
# on the row that wrote them (`sharded_teacher_forcing`: one device reads the sharded path's codes; measured on an
# AMD EPYC with AVX-512: one BF16 RoPE word of a window row, 1.6e-5 on the row that wrote it).
FLIP = 1e-3


def perturbed_model(name: str, **overrides):
    """``(cfg, params)``: preset ``name`` (with ``overrides``) and its seeded parameters (key 0), `perturbed`."""
    from v41cp import model
    from v41cp.config import preset

    cfg = preset(name, **overrides)
    return cfg, perturbed(model.init_params(cfg, jax.random.key(0)))


def perturbed(params, seed=3):
    """Random non-trivial values for the parameters that init sets to constants (sinks, norms, biases)."""
    leaves, tree = jax.tree.flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if any(t in name for t in ("attn_sink", "gate_bias", "'base'", "'scale'")):
            leaf = leaf + rng.normal(0, 0.1, leaf.shape).astype(leaf.dtype)
        elif "'weight'" in name or "q_weight" in name or "k_weight" in name:
            leaf = leaf * (1 + rng.normal(0, 0.1, leaf.shape)).astype(leaf.dtype)
        out.append(np.asarray(leaf))
    return jax.tree.unflatten(tree, out)


def load_export(path: Path, **overrides):
    """(cfg, params, reference arrays) of an oracle export directory."""
    token_map, _ = compressed_token_map(path / "tokenizer.json")
    cfg = ModelConfig.from_json(path / "config.json", engram_token_map=token_map, **overrides)
    params = params_from_released(cfg, load_file(str(path / "weights.safetensors")))
    return cfg, params, load_file(str(path / "reference.safetensors"))


def rel_err(got, want) -> float:
    """max |got − want| / max |want| (the suite's relative error)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def selection_sets(idx: np.ndarray) -> list:
    """Per-row sets of selected positions (−1 = padding, dropped) for ``idx [..., K]``."""
    flat = idx.reshape(-1, idx.shape[-1])
    return [frozenset(int(v) for v in row if v >= 0) for row in flat]


def boundary_gap(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row: relative gap between the k-th and (k+1)-th selectable (> −inf) scores; +inf when a
    row has at most k selectable entries (everything selectable is selected: no boundary)."""
    s = -np.sort(-np.asarray(scores, np.float64), axis=-1)
    flat = s.reshape(-1, s.shape[-1])
    n_sel = (flat > -np.inf).sum(-1)
    finite = np.where(np.isfinite(flat), np.abs(flat), 0.0)
    scale = max(finite.max(), 1e-30)
    gap = np.full(flat.shape[0], np.inf)
    rows = n_sel > k
    if rows.any():
        a, b = flat[rows, k - 1], flat[rows, k]
        gap[rows] = np.where(np.isinf(a) & np.isinf(b), 0.0, a - b) / scale
    return gap


def candidate_block_scores(scores: np.ndarray, ratio: int, block: int) -> np.ndarray:
    """The candidate source's block scores (block max, newest visible block pinned to +inf)."""
    b, s, g = scores.shape
    pad = -g % block
    blk = np.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=-np.inf).reshape(b, s, -1, block).max(-1)
    last = ((np.arange(s) + 1) // ratio - 1) // block
    return np.where(np.arange(blk.shape[-1])[None, None] == last[None, :, None], np.inf, blk)


def selection_margin(cfg, params, tokens, first: int, length: int | None = None) -> tuple[float, str]:
    """The smallest relative gap at any selection boundary of rows ``first …`` of the full forward of ``tokens``
    (1-D): the index top-k and candidate blocks of every index layer and the MoE top-k of every layer, with the
    boundary it sits on. Two paths whose FP32 values differ by rounding select the same entries and experts on
    a row whose margin is well above that rounding; a smaller margin is a near-tie either path may flip.

    ``length``: run the forward padded to that many tokens (one compiled program for every sequence up to it) and
    read the rows and entries of the unpadded sequence only: the model is causal, so its rows are the unpadded
    forward's, and its ``n // ratio`` complete groups are the entries they see (asserted: every later entry is
    unselectable on those rows)."""
    from v41cp import model

    tokens = np.asarray(tokens)
    n = len(tokens)
    padded = tokens[None]
    if length is not None:
        if length < n:
            raise ValueError(f"length {length} is shorter than the sequence ({n} tokens)")
        padded = np.full((1, length), cfg.pad_token_id, np.int32)
        padded[0, :n] = tokens
    _, _, inter = model.forward_debug(params, cfg, padded)
    worst = (np.inf, "none")
    for role in cfg.layer_roles:
        layer = inter[f"layers_{role.index}"]
        gaps = {} if cfg.hash_routed(role.index) else {     # a hash-routed layer's experts come from its table
            "moe": boundary_gap(np.asarray(layer["ffn"]["route_scores"][0])[:n], cfg.num_experts_per_tok)}
        if role.is_index_source and "index_scores" in layer["attn"]:
            scores = np.asarray(layer["attn"]["index_scores"][0])[:, :n]
            entries = n // role.ratio
            assert (scores[:, :, entries:] == -np.inf).all(), (role.index, "an entry past the sequence is visible")
            scores = scores[:, :, :entries]
            if entries:                                     # (none yet: nothing selected, no boundary)
                gaps["index"] = boundary_gap(scores[0], min(cfg.index_topk, scores.shape[-1]))
                if role.candidate_source:
                    blocks = candidate_block_scores(scores, role.ratio, cfg.candidate_block_size)
                    gaps["blocks"] = boundary_gap(blocks[0], cfg.candidate_topk_blocks)
        for kind, gap in gaps.items():
            at = first + int(np.argmin(gap[first:]))
            if gap[at] < worst[0]:
                worst = (float(gap[at]), f"layer {role.index} {kind} top-k, row {at}")
    return worst


def cache_by_virtual_block(cache, kvp):
    """Cache leaves as NumPy; pools re-indexed by virtual block id (rank ``v % N`` holds ``v`` at ``v // N``)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        key, a = jax.tree_util.keystr(path), np.asarray(leaf)
        if kvp > 1 and path[0].name in POOLS:
            v = np.arange(a.shape[0])
            a = a[(v % kvp) * (a.shape[0] // kvp) + v // kvp]
        out[key] = a
    return out


# the V4 speculative tests' sharded topologies: KVP = DCP 2 decode; a model-wide QCP 2 prefill over KVP 2 pages
SPECULATIVE_TOPOLOGIES = {
    "kvp2": ParallelConfig(tp_size=2, kv_parallel_size=2, decode_context_parallel_size=2),
    "qcp2-kvp2": ParallelConfig(tp_size=2, query_context_parallel_size=2, kv_parallel_size=2,
                                decode_context_parallel_size=2),
}


def continuation_proposer(cfg, prompts: dict, continuations: dict, wrong: int):
    """A speculative ``proposer`` (`Speculative.proposer`) proposing each request's known continuation (prompt +
    ``continuations[id]``, then token 3 past its end) with draft ``wrong`` replaced by another token: exactly
    ``wrong`` drafts are kept per full step (none wrong when ``wrong ≥ n``)."""
    truth = {rid: list(prompts[rid]) + list(continuations[rid]) for rid in prompts}

    def propose(rid, history, n):
        cont = truth[rid][len(history):len(history) + n]
        cont += [3] * (n - len(cont))
        if wrong < n:
            cont[wrong] = (cont[wrong] + 1) % cfg.vocab_size
        return cont
    return propose


def tables_at_finish(eng) -> dict:
    """Each request's block table as it ends (pages are taken on demand, so two runs place a request's pages in
    different blocks): filled in as the requests finish."""
    tables, free = {}, eng.scheduler.free

    def capture(req):
        tables[req.rid] = list(eng.alloc.blocks(req.rid))
        free(req)
    eng.scheduler.free = capture
    return tables


def pages_in_table_order(cache, tables: dict, blocks: dict) -> dict:
    """The cache leaves with each pool's pages gathered request by request in table order (the first
    ``blocks[rid]`` of its table), the other leaves as they are."""
    out = {}
    for key, a in cache_by_virtual_block(cache, 1).items():
        if any(key.startswith(f".{pool}[") for pool in POOLS):
            a = np.concatenate([a[tables[rid][:blocks[rid]]] for rid in sorted(tables)])
        out[key] = a
    return out


# The quantizer's boundary: two programs whose FP32 values differ in the last bits (a TP reduction summed in another
# order, a span vs a token at a time) store the same code, except where a value straddles a rounding boundary of its
# format; then the two codes are adjacent — one step of the e4m3 / e2m1 / BF16 code, or a block scale one step apart
# and the block's codes adjacent on the coarser scale. `record_code_flips` asserts exactly that, per stored code.
_POOL_FORMAT = {"swa": "window", "ckv": "entries", "ikey": "index"}       # cache field → `CacheFormats` attribute


def _sign_magnitude_ordinal(code: np.ndarray, sign_bit: int) -> np.ndarray:
    """Codes whose magnitude order is their integer order below ``sign_bit`` (e4m3, e2m1, BF16) → signed ordinals
    that count code steps (+0 and −0 both 0)."""
    code = code.astype(np.int64)
    mag = code & (sign_bit - 1)
    return np.where(code & sign_bit, -mag, mag)


def _record_codes(record: dict, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A record's uint8 leaves → (payload ordinals ``[..., C]``, scale ordinals ``[..., C/block]``, BF16 ordinals
    ``[..., rope]`` or None)."""
    from v41cp.serving.cache.records import RECORD_FORMATS

    block, scale_kind = RECORD_FORMATS[fmt]
    q, s = record["q"], record["s"]
    if fmt in ("fp8", "fp8_ds_mla"):
        payload = _sign_magnitude_ordinal(q, 0x80)
    else:                                                          # packed e2m1, even channel in the low nibble
        payload = _sign_magnitude_ordinal(np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:-1], -1), 8)
    s = s[..., :payload.shape[-1] // block]                        # (fp8_ds_mla pads its scale bytes)
    scale = s.astype(np.int64) if scale_kind == "e8m0" else _sign_magnitude_ordinal(s, 0x80)
    rope = None
    if "r" in record:
        words = record["r"].reshape(*record["r"].shape[:-1], -1, 2).astype(np.uint16)
        rope = _sign_magnitude_ordinal(words[..., 0] | (words[..., 1] << 8), 0x8000)
    return payload, scale, rope


def _payload_on_scale(payload: np.ndarray, scale: np.ndarray, onto: np.ndarray, fmt: str) -> np.ndarray:
    """Payload ordinals under block scale ordinals ``scale`` requantized (to nearest) onto scale ordinals ``onto``."""
    import ml_dtypes

    from v41cp.quant import E2M1_LEVELS
    from v41cp.serving.cache.records import RECORD_FORMATS

    block, scale_kind = RECORD_FORMATS[fmt]
    scale_value = (lambda o: np.exp2(o.astype(np.float64) - 127) if scale_kind == "e8m0" else
                   np.sign(o) * np.abs(o).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    ratio = np.repeat(scale_value(scale) / scale_value(onto), block, axis=-1)
    sign, mag = np.sign(payload), np.abs(payload)
    if fmt in ("fp8", "fp8_ds_mla"):
        x = mag.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * ratio
        return sign * np.clip(x, 0, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64)
    x = E2M1_LEVELS.astype(np.float64)[mag] * ratio
    return sign * np.abs(x[..., None] - E2M1_LEVELS.astype(np.float64)).argmin(-1)


def _records(flat: dict) -> dict[str, dict[str, str]]:
    """The byte records of a `cache_by_virtual_block` dict: ``{record key: {leaf name: leaf key}}`` (``.ckv['3']``:
    ``{"q": ".ckv['3']['q']", ...}``)."""
    records: dict[str, dict] = {}
    for key, a in flat.items():
        if a.dtype == np.uint8:
            stem, leaf = key.rsplit("[", 1)
            records.setdefault(stem, {})[leaf.strip("']")] = key
    return records


def _format_of(stem: str, cfg) -> str:
    return getattr(cfg.cache_formats, _POOL_FORMAT[stem[1:].split("[")[0]])


def record_code_flips(got: dict, want: dict, cfg, tag: str = "") -> dict[str, np.ndarray]:
    """Compare two caches' byte records (`cache_by_virtual_block` dicts, same layout; non-record leaves ignored):
    asserts every stored code equal or one step apart (`_POOL_FORMAT`'s formats, per `cfg.cache_formats`; a block
    scale one code step apart, the block's codes then compared on the coarser scale), padding bytes equal, and such
    codes rare (≤ 0.1 % of the codes of a store). Returns ``{leaf key: flipped codes [...] int}`` for each record
    leaf (``q`` payload, ``s`` scales, ``r`` BF16 RoPE) holding a flipped code, counted per row of the record's
    leading axes (a page's entry, a window row)."""
    flips = {}
    for stem, leaves in _records(want).items():
        fmt = _format_of(stem, cfg)
        g = _record_codes({n: got[k] for n, k in leaves.items()}, fmt)
        w = _record_codes({n: want[k] for n, k in leaves.items()}, fmt)
        where = f"{tag} {stem} ({fmt})"
        used = g[1].shape[-1]                                      # (fp8_ds_mla pads its scale bytes to 8)
        np.testing.assert_array_equal(got[leaves["s"]][..., used:], want[leaves["s"]][..., used:], where + " pad")
        assert np.abs(g[1] - w[1]).max(initial=0) <= 1, (where, "a block scale more than one step apart")
        same = np.repeat(g[1] == w[1], g[0].shape[-1] // g[1].shape[-1], axis=-1)
        coarse = np.maximum(g[1], w[1])
        steps = np.where(same, np.abs(g[0] - w[0]), np.abs(_payload_on_scale(g[0], g[1], coarse, fmt)
                                                          - _payload_on_scale(w[0], w[1], coarse, fmt)))
        assert steps.max(initial=0) <= 1, (where, "payload codes more than one step apart")
        parts = {"['q']": steps > 0, "['s']": g[1] != w[1]}
        if g[2] is not None:
            assert np.abs(g[2] - w[2]).max(initial=0) <= 1, (where, "BF16 RoPE words more than one step apart")
            parts["['r']"] = g[2] != w[2]
        n_codes, n_flipped = sum(p.size for p in parts.values()), sum(int(p.sum()) for p in parts.values())
        assert n_flipped <= 1e-3 * n_codes, (where, f"{n_flipped} of {n_codes} codes one step apart")
        flips.update({stem + part: p.sum(-1) for part, p in parts.items() if p.any()})
    return flips


def record_rows_written(before: dict, after: dict, cfg) -> tuple[dict[str, np.ndarray], int]:
    """The record rows whose bytes differ between two `cache_by_virtual_block` dicts of one cache (a step's writes):
    ``({record key: changed [...] bool per row of its leading axes}, codes in those rows)``."""
    rows, codes = {}, 0
    for stem, leaves in _records(after).items():
        changed = np.any([(after[k] != before[k]).any(-1) for k in leaves.values()], axis=0)
        q, scale, rope = _record_codes({n: after[k] for n, k in leaves.items()}, _format_of(stem, cfg))
        rows[stem] = changed
        codes += int(changed.sum()) * (q.shape[-1] + scale.shape[-1] + (0 if rope is None else rope.shape[-1]))
    return rows, codes


def assert_caches_agree(got: dict, want: dict, cfg, tag: str = "") -> dict[str, np.ndarray]:
    """Two caches (`cache_by_virtual_block` / `pages_in_table_order` dicts) agree: byte records code for code up to
    `record_code_flips`' one-step flips (returned), every other leaf within 1e-5."""
    flips = record_code_flips(got, want, cfg, tag)
    for key, w in want.items():
        if w.dtype != np.uint8:
            assert rel_err(got[key], w) <= 1e-5, (tag, key)
    return flips


def assert_same_request_state(got: dict, want: dict, rid, window: int, cfg=None) -> None:
    """Two `Engine.request_state`s hold the same bytes: every complete entry of every group, the window rows of the
    request's last ``window`` positions (other ring rows are not the request's), the open ratio-2 pairs — with a
    DeepSeek-V4 ``cfg``, each compressor ring's rows of the request's last ``n`` positions."""
    import jax

    assert got["tokens"] == want["tokens"], rid
    t = got["tokens"]
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got["pages"]), jax.tree.leaves(want["pages"])):
        np.testing.assert_array_equal(g, w, err_msg=f"{rid} {jax.tree_util.keystr(path)}")
    rows = np.arange(max(0, t - window), t) % window
    for g, w in zip(jax.tree.leaves(got["slot"]["swa"]), jax.tree.leaves(want["slot"]["swa"])):
        np.testing.assert_array_equal(g[:, rows], w[:, rows], err_msg=f"{rid} window")
    rings = {}
    if cfg is not None and cfg.is_v4:
        for role in cfg.layer_roles:
            if role.ratio:
                rings[str(role.index)] = rings[str(role.index) + "i"] = role.window_rows
    for name in ("open_kv", "open_score"):
        for key, g in got["slot"][name].items():
            g, w = np.asarray(g), np.asarray(want["slot"][name][key])
            if key in rings:             # [n·width]: the rows of the request's last n positions
                n = rings[key]
                live = np.arange(max(0, t - n), t) % n
                g, w = g.reshape(n, -1)[live], w.reshape(n, -1)[live]
            np.testing.assert_array_equal(g, w, err_msg=f"{rid} {name} {key}")


@contextlib.contextmanager
def compile_events():
    """Collect the names of jax's compilation events (tracing, lowering, XLA compiles of every function, eager ops
    included) while the block runs: ``with compile_events() as compiled: ...``; ``compiled == []`` means nothing
    compiled."""
    compiled, listening = [], [True]

    def on_event(event: str, seconds: float, **kw) -> None:
        if listening[0] and "compile" in event and "cache" not in event:
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)     # (no public unregister: it goes quiet)
    try:
        yield compiled
    finally:
        listening[0] = False


def penalized_reference(logits, prompt, outputs, presence=0.0, frequency=0.0, repetition=1.0) -> np.ndarray:
    """A row of logits with the penalties applied as vLLM defines them, in float64: repetition on every id of the
    prompt or the outputs (positive logits divided by it, the others multiplied), then minus ``frequency`` per
    occurrence among the outputs and ``presence`` once for an id among them."""
    x = np.asarray(logits, np.float64).copy()
    count = np.bincount(np.asarray(outputs, np.int64), minlength=x.size)[:x.size].astype(np.float64)
    seen = (count > 0) | np.isin(np.arange(x.size), np.asarray(prompt, np.int64))
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - frequency * count - presence * (count > 0)


def top_gap(row) -> float:
    """The gap between a row's two largest values, relative to its largest magnitude (a greedy choice's margin)."""
    row = np.sort(np.asarray(row, np.float64))
    return float((row[-1] - row[-2]) / max(np.abs(row).max(), 1e-30))


def run_recording_logits(eng, requests) -> dict:
    """Run ``requests`` ({rid: (prompt, SamplingParams)}) through engine ``eng`` round by round (prefill, then
    decode), keeping the FP32 logits behind every output token (``eng`` built with ``record_logits=True``):
    ``{rid: [logits, …]}``."""
    for rid, (prompt, sp) in requests.items():
        eng.submit(rid, prompt, sp)
    logits = {rid: [] for rid in requests}

    def grab():
        for rid in requests:
            r = eng.requests[rid]
            while r.last_logits is not None and len(logits[rid]) < len(r.output):
                logits[rid].append(r.last_logits)
    while eng.pending:
        eng.prefill_round()
        grab()
        eng.decode_round()
        grab()
    return logits


def greedy_rounds(eng, prompts: dict, rounds, new: int) -> tuple[dict, dict]:
    """Greedy requests of ``prompts`` (id → tokens) through engine ``eng`` (built with ``record_logits=True``), one
    group of ids per entry of ``rounds`` run to completion before the next (a later group can hit an earlier one's
    prefix), ``new`` tokens each, no stop on EOS → ``({id: output ids}, {id: logits [new, V]})``."""
    from v41cp.serving.engine import SamplingParams

    got, logits = {}, {}
    for ids in rounds:
        logits.update(run_recording_logits(eng, {rid: (prompts[rid], SamplingParams(max_new_tokens=new,
                                                                                     stop_on_eos=False))
                                                 for rid in ids}))
        got.update({rid: eng.result(rid)["output_ids"] for rid in ids})
    return got, {rid: np.stack(rows) for rid, rows in logits.items()}


def _on_mesh(cfg, params, parallel):
    """``(params, plan, kvp, sharding)`` of the decode step on ``parallel``'s mesh (None: one device): KVP pages split
    over the ``cp`` group with the DCP step, or plain TP's split selection."""
    from v41cp import model
    from v41cp.serving.attention.dcp import DCPPlan

    if parallel is None:
        return params, None, 1, None
    mesh = parallel.make_mesh()
    params = model.shard_params(params, cfg, mesh, parallel.rules())
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if parallel.kv_parallel_size > 1:
        return params, DCPPlan.build(cfg, parallel, mesh), parallel.kv_parallel_size, sharding
    return params, DCPPlan.split_selection(mesh), 1, sharding


def _teacher_forcing_steps(cfg, seqs: dict, start: dict, alloc, steps: int, max_batch: int, max_blocks: int):
    """Yield ``(rows, meta)`` per step: the ``(id, history)`` rows fed (request ``id`` joins at step ``start[id]``,
    one token per step) and their `StepBatch`; a request's pages come back after its last step."""
    from v41cp.serving.step_batch import StepBatch

    for step in range(steps):
        rows = []
        for rid, seq in seqs.items():
            t = step - start[rid]
            if 0 <= t < len(seq):
                alloc.admit(rid, 1) if rid not in alloc else alloc.extend(rid, t + 1)
                rows.append((rid, seq[: t + 1]))
        if not rows:
            continue
        yield rows, StepBatch.for_histories(cfg, [h for _, h in rows], [alloc.slot(r) for r, _ in rows],
                                            [alloc.blocks(r) for r, _ in rows], max_batch, max_blocks)
        for rid, hist in rows:
            if len(hist) == len(seqs[rid]):
                alloc.finish(rid)


def decode_teacher_forcing(cfg, params, seqs: dict, start: dict, block: int, max_batch: int, max_blocks: int,
                           num_blocks: int, steps: int, parallel=None, records=None) -> dict:
    """Feed each sequence of ``seqs`` (id → tokens) token by token through the paged decode step, request ``id``
    joining at step ``start[id]``, one compile for all steps: ``{id: logits [len, V]}`` (row ``t`` after token
    ``t``). Every page comes back at the end. ``parallel`` (a `ParallelConfig`): the step on its mesh — KVP pages
    split over the ``cp`` group with the DCP step, or plain TP's split selection. ``records``: the cache's stores as
    byte records or values (default: records under the cache fake-quant, `device_cache.declare_cache`)."""
    from v41cp.serving.cache.allocator import BlockAllocator
    from v41cp.serving.runner.steps import decode_step, init_cache

    params, plan, n, sharding = _on_mesh(cfg, params, parallel)
    alloc = BlockAllocator(num_blocks, block, max_batch, max_blocks, n)
    cache = init_cache(cfg, num_blocks, block, max_batch, sharding=None if n > 1 else sharding, records=records,
                       plan=plan if n > 1 else None)
    got = {k: [] for k in seqs}
    before = decode_step._cache_size()
    for rows, meta in _teacher_forcing_steps(cfg, seqs, start, alloc, steps, max_batch, max_blocks):
        logits, cache = decode_step(params, cache, meta, cfg, plan)
        for i, (rid, _) in enumerate(rows):
            got[rid].append(np.asarray(logits)[i])
    assert decode_step._cache_size() - before == 1
    alloc.check()
    assert alloc.free_blocks == num_blocks
    return {rid: np.stack(rows) for rid, rows in got.items()}


class LockstepDecode:
    """The decode step on ``parallel``'s mesh and on one device in lockstep over one allocator (``alloc``; one
    compile each), the one device continuing from the sharded path's cache: after every `step` the two caches agree
    (records up to one-step quantizer flips — `record_code_flips` —, each in a row the step wrote for one of its
    requests; FP32 state within 1e-5, `FLIP` on a step that wrote a flip) and the one device's cache is replaced by
    the sharded path's, so a flip is measured once — on the row that wrote it — and every later row compares two
    programs over the same bytes.
    ``flips``: ``{id: [(row, record leaf)]}`` of the flips each request's pages or window slot received (row = its
    history length − 1 at that step); `check` bounds them over the run: ≤ 0.1 % of the codes the steps wrote.
    ``plan_overrides``: fields of the sharded step's `DCPPlan` replaced."""

    def __init__(self, cfg, params, parallel, num_blocks: int, block: int, max_batch: int, max_blocks: int,
                 **plan_overrides):
        from v41cp.serving.cache.allocator import BlockAllocator
        from v41cp.serving.runner.steps import decode_step, init_cache

        self.cfg, self.params = cfg, params
        self.sharded, self.plan, self.kvp, sharding = _on_mesh(cfg, params, parallel)
        if plan_overrides:                            # (a `DCPPlan` field, e.g. the selection's scan tile)
            self.plan = dataclasses.replace(self.plan, **plan_overrides)
        self.alloc = BlockAllocator(num_blocks, block, max_batch, max_blocks, self.kvp)
        many = self.kvp > 1
        self.caches = [init_cache(cfg, num_blocks, block, max_batch, sharding=None if many else sharding,
                                  plan=self.plan if many else None), init_cache(cfg, num_blocks, block, max_batch)]
        self.flips: dict = {}
        self.codes_written = self.codes_flipped = 0
        self._stored = cache_by_virtual_block(self.caches[1], 1)
        self._programs = [decode_step._cache_size(), None]

    def step(self, rows, meta) -> tuple[np.ndarray, np.ndarray]:
        """One step of both paths over ``rows`` (``(id, history)``, the batch rows of ``meta``): ``(sharded logits,
        one-device logits)``, each ``[max_batch, vocab]``."""
        from v41cp.serving.runner.steps import decode_step

        a, self.caches[0] = decode_step(self.sharded, self.caches[0], meta, self.cfg, self.plan)
        b, self.caches[1] = decode_step(self.params, self.caches[1], meta, self.cfg, None)
        self._programs[1] = self._programs[1] or decode_step._cache_size()
        assert self._programs[1] - self._programs[0] <= 2 and decode_step._cache_size() == self._programs[1], \
            "a step compiled again"
        stored, own = cache_by_virtual_block(self.caches[0], self.kvp), cache_by_virtual_block(self.caches[1], 1)
        written, codes = record_rows_written(self._stored, own, self.cfg)
        self.codes_written += codes
        tag = f"step of {[rid for rid, _ in rows]}"
        flips = record_code_flips(stored, own, self.cfg, tag)
        for key, w in own.items():                    # the FP32 state this step wrote (the rest is the sharded's)
            if w.dtype != np.uint8:                   # — on a flip's step it may carry the flip's effect
                assert rel_err(stored[key], w) <= (FLIP if flips else 1e-5), (tag, key)
        for key, count in flips.items():
            mine = np.zeros(count.shape, bool)
            for rid, hist in rows:                    # the request whose pages (or window slot) hold the flip
                at = (slice(None), self.alloc.slot(rid)) if key.startswith(".swa") else self.alloc.blocks(rid)
                mine[at] = True
                if count[at].any():
                    self.flips.setdefault(rid, []).append((len(hist) - 1, key))
            stem = key.rsplit("[", 1)[0]
            assert not (count.astype(bool) & ~(mine & written[stem])).any(), (key, "a flip in a row this step did "
                                                                               "not write")
            self.codes_flipped += int(count.sum())
        leaves, tree = jax.tree_util.tree_flatten_with_path(self.caches[1])
        self.caches[1] = jax.tree.unflatten(tree, [jax.device_put(stored[jax.tree_util.keystr(k)], v.sharding)
                                                   for k, v in leaves])
        self._stored = stored
        return np.asarray(a), np.asarray(b)

    def check(self, tag: str) -> None:
        """Flipped codes ≤ 0.1 % of the codes the steps wrote (a flip is a last-bit accident; a quantizer that rounds
        otherwise on one path flips a large share of what it writes)."""
        print(f"\n[{tag}] quantizer flips: {self.codes_flipped} of {self.codes_written} codes written")
        assert self.codes_written > 0 and self.codes_flipped <= 1e-3 * self.codes_written, tag


def assert_rows_agree(tag: str, errs, flips=()) -> float:
    """Per-row relative errors of a sharded path vs one device (`LockstepDecode`): every row within 1e-5 but the
    rows that wrote a flipped code (``flips``: ``[(row, leaf)]``), those within `FLIP`; prints them, returns the
    largest error of the other rows."""
    errs = np.asarray(errs)
    wrote = sorted({row for row, _ in flips})
    exact = float(np.delete(errs, wrote).max(initial=0))
    print(f"\n[{tag}] vs one device {exact:.2e}; rows writing a flipped code "
          f"{wrote or 'none'} {[f'{e:.1e}' for e in errs[wrote]]} {[k for _, k in flips]}")
    assert exact <= 1e-5, tag
    assert errs[wrote].max(initial=0) <= FLIP, tag
    return exact


def sharded_teacher_forcing(cfg, params, seqs: dict, start: dict, block: int, max_batch: int, max_blocks: int,
                            num_blocks: int, steps: int, parallel) -> tuple[dict, dict, dict]:
    """`decode_teacher_forcing` through `LockstepDecode`: ``(sharded {id: logits [len, V]}, one device {id: logits},
    {id: [(row, record leaf)] of its flips})``."""
    run = LockstepDecode(cfg, params, parallel, num_blocks, block, max_batch, max_blocks)
    got, want = ({k: [] for k in seqs} for _ in range(2))
    for rows, meta in _teacher_forcing_steps(cfg, seqs, start, run.alloc, steps, max_batch, max_blocks):
        a, b = run.step(rows, meta)
        for i, (rid, _) in enumerate(rows):
            got[rid].append(a[i])
            want[rid].append(b[i])
    run.alloc.check()
    assert run.alloc.free_blocks == num_blocks
    run.check(f"lockstep TP {parallel.tp_size} KVP {parallel.kv_parallel_size}")
    return ({rid: np.stack(r) for rid, r in got.items()}, {rid: np.stack(r) for rid, r in want.items()},
            {rid: run.flips.get(rid, []) for rid in seqs})


def full_forward_rows(params, cfg, seq, length: int) -> np.ndarray:
    """Logits ``[len(seq), V]`` (FP32) of the full forward of the 1-D ``seq``, run padded to ``length`` tokens: one
    compiled program for every sequence up to that length, where the unpadded forward compiles one per length. The
    model is causal, so the rows are the unpadded forward's (to the rounding of another program's shapes)."""
    from v41cp import model

    seq = np.asarray(seq)
    if length < len(seq):
        raise ValueError(f"length {length} is shorter than the sequence ({len(seq)} tokens)")
    padded = np.full((1, length), cfg.pad_token_id, np.int32)
    padded[0, :len(seq)] = seq
    return np.asarray(model.forward(params, cfg, padded))[0, :len(seq)]


def greedy_reference(cfg, params, prompts: dict, new: int, length: int) -> tuple[dict, dict]:
    """The full forward's greedy continuation of each prompt (id → token list) by ``new`` tokens, with the logits
    behind each: ``({id: tokens}, {id: logits [new, V]})``. Every forward runs at one padded length ``length`` (one
    compile; the model is causal, so the rows before the padding are those of the unpadded sequence). Asserts no
    greedy near-tie (1e-4 relative) and no selection near-tie (`selection_margin` > 1e-5, at the same padded length)
    on any row."""
    from v41cp import model

    want, want_logits = {}, {}
    for rid, prompt in prompts.items():
        seq, rows = list(prompt), []
        for _ in range(new):
            padded = np.full((1, length), cfg.pad_token_id, np.int32)
            padded[0, :len(seq)] = seq
            logits = np.asarray(model.forward(params, cfg, padded))[0, len(seq) - 1]
            assert top_gap(logits) > 1e-4, (rid, len(seq), "greedy near-tie")
            rows.append(logits)
            seq.append(int(logits.argmax()))
        margin, where = selection_margin(cfg, params, seq, 0, length)
        assert margin > 1e-5, (rid, where)
        want[rid], want_logits[rid] = seq[len(prompt):], np.stack(rows)
    return want, want_logits


def assert_prefix_hit_bit_identical(params, cfg, cap, prompts: dict, warm: tuple, hit, sampling, cached: int) -> set:
    """Prefill the ``warm`` prompts in an engine, then ``hit`` (it must reuse ``cached`` tokens); its first token's
    logits and every byte of its cache (`Engine.request_state`: pages, window rings, compressor rings) equal the same
    prompt prefilled cold in an engine of its own. Returns the state's leaf names."""
    from v41cp.serving.engine import Engine

    def first_token(eng, rid):
        eng.submit(rid, prompts[rid], sampling)
        for _ in range(16):                                     # bounded: its prefill takes a few rounds at most
            if eng.requests[rid].output:
                break
            eng.step()
        assert eng.requests[rid].output, rid
        return eng.requests[rid].last_logits, eng.request_state(rid)

    hot = Engine(params, cfg, cap, record_logits=True)
    for rid in warm:
        hot.submit(rid, prompts[rid], sampling)
    while hot.pending:
        hot.step()
    got = first_token(hot, hit)
    assert hot.result(hit)["cached_tokens"] == cached
    want = first_token(Engine(params, cfg, cap, record_logits=True), hit)
    np.testing.assert_array_equal(got[0], want[0])
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    a, b = flat(got[1]), flat(want[1])
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    return set(a)
