"""``v41cp info``: the config summary and the per-layer role table of a checkpoint or a named preset."""

from __future__ import annotations

import json

from v41cp.cli import flags


def add_arguments(parser) -> None:
    flags.add(parser, flags.ModelFlags, "checkpoint", "no_fake_quant", help=flags.ModelFlags.DESCRIBED)
    flags.add(parser, flags.OutputFlags, help=flags.OutputFlags.DESCRIBED)
    flags.add(parser, flags.ModelFlags, "preset", help={"preset": "show a named preset instead (v41-flash, tiny, ...)"})


def run(args) -> int:
    cfg = flags.ModelFlags.from_args(args).config()
    summary = {
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim, "window": cfg.sliding_window, "experts": f"{cfg.n_routed_experts} top-"
        f"{cfg.num_experts_per_tok} + 1 shared", "index": f"{cfg.index_n_heads} heads x {cfg.index_head_dim}, "
        f"top-{cfg.index_topk}", "candidates": (f"layer {cfg.candidate_source_layer_id}: {cfg.candidate_topk_blocks} "
        f"blocks x {cfg.candidate_block_size}" if cfg.candidate_source_layer_id >= 0 else "off"),
        "engram_layers": list(cfg.engram_layer_ids), "dtype": cfg.dtype, "fake_quant": cfg.fake_quant,
    }
    table = [{"layer": r.index, "ratio": r.ratio, "role": r.kind, "kv_source": r.kv_source,
              "index_source": r.index_source, "candidates": "source" if r.candidate_source else
              ("masked" if r.uses_candidates else ""), "engram": r.engram_slot >= 0} for r in cfg.layer_roles]
    if args.json:
        print(json.dumps({"config": summary, "layers": table}, indent=1))
        return 0
    for k, v in summary.items():
        print(f"{k:>14}: {v}")
    print(f"\n{'layer':>5} {'ratio':>5} {'role':>8} {'kv_src':>6} {'idx_src':>7} {'candidates':>10} engram")
    for t in table:
        print(f"{t['layer']:>5} {t['ratio']:>5} {t['role']:>8} {t['kv_source']:>6} {t['index_source']:>7} "
              f"{t['candidates']:>10} {'yes' if t['engram'] else ''}")
    return 0
