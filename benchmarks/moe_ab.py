"""Sparse vs dense MoE layer time on this machine, side by side in one run, at the released expert count.

``python benchmarks/moe_ab.py [--tokens 8 4096] [--rounds 5] [--hidden 256] [--intermediate 128]``: one V4.1 MoE
layer (router, 384 routed experts top-6 stored as FP4 + e8m0 scales as released, the shared expert; reduced
hidden / intermediate widths so the dense reference runs on a CPU) on random weights and inputs, jitted once per
backend and token count; the two backends alternate ``--rounds`` times and the fastest call of each counts.
Prints JSON: per token count the seconds of each backend, the ratio sparse / dense, and the compiled FLOPs of each
(`v41cp.sharding.hlo_stats.program_cost`). CPU timings are noisy: only the side-by-side ratio means something
here; absolute times count on a GPU.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--top-k", type=int, default=6)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from v41cp.config import preset
    from v41cp.layers.moe import MoE
    from v41cp.sharding.hlo_stats import program_cost

    cfg = preset("tiny", hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                 n_routed_experts=args.experts, num_experts_per_tok=args.top_k, keep_quantized=True,
                 dtype="bfloat16")
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: MoE(cfg).init(jax.random.key(0), jnp.zeros((1, 1, args.hidden), jnp.bfloat16)))

    def fill(path, a):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.asarray(rng.integers(118, 122, a.shape), a.dtype)        # 2^-9 … 2^-6
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, a.shape), a.dtype)
        return jnp.asarray(rng.normal(0, 0.05, a.shape), a.dtype)

    variables = jax.tree_util.tree_map_with_path(fill, jax.tree.map(lambda x: getattr(x, "value", x), shapes,
                                                                     is_leaf=lambda x: hasattr(x, "value")))
    fns = {b: jax.jit(lambda v, x, c=cfg.replace(moe_backend=b): MoE(c).apply(v, x)) for b in ("sparse", "dense")}
    out = {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "intermediate": args.intermediate,
           "rounds": args.rounds, "results": {}}
    for t in args.tokens:
        x = jnp.asarray(rng.normal(0, 1, (1, t, args.hidden)), jnp.bfloat16)
        best = {b: float("inf") for b in fns}
        flops = {b: program_cost(fns[b].lower(variables, x).compile())["flops"] for b in fns}
        got = {b: fns[b](variables, x).block_until_ready() for b in fns}           # compile + warm up
        err = float(jnp.max(jnp.abs(got["sparse"].astype(jnp.float32) - got["dense"].astype(jnp.float32))))
        for _ in range(args.rounds):
            for b, f in fns.items():
                start = time.perf_counter()
                f(variables, x).block_until_ready()
                best[b] = min(best[b], time.perf_counter() - start)
        out["results"][str(t)] = {"sparse_s": best["sparse"], "dense_s": best["dense"],
                                  "sparse_over_dense": best["sparse"] / best["dense"],
                                  "sparse_flops": flops["sparse"], "dense_flops": flops["dense"],
                                  "max_abs_diff_bf16": err}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
