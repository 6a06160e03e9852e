"""Load test of the OpenAI-compatible server: throughput and time to first token vs concurrent clients.

Starts ``python -m v41cp serve`` on 127.0.0.1 (or uses ``--url``), then for each concurrency level runs that many
streaming clients at once, each sending ``--requests`` completions one after another (``--max-tokens`` tokens,
greedy, EOS ignored), and prints JSON: per level the output tokens per second over the level's wall time, the
time to first token (p50 / p90 over requests) and the per-request decode rate. Requests are bounded in number
and time; the server is stopped at the end. ``python benchmarks/server_load.py --concurrency 1,16``

``--modes default,token-serial,no-prefix-caching`` runs the levels against one server per configuration, one after
the other in this run (the defaults: span prefill under its per-round row budget with prefix caching;
``--token-serial-prefill``; ``--no-enable-prefix-caching``), and reports each level's time to first token relative to
one client and the other / default ratios. ``--prompt-words``: prompt length (each client repeats its prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            tokens += 1
            if first is None:
                first = time.perf_counter() - t0
    return {"ttft_s": first, "tokens": tokens, "seconds": time.perf_counter() - t0}


async def _level(url: str, model: str, clients: int, requests: int, max_tokens: int, words: int = 8) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = [" ".join(f"w{(7 * c + j) % 100}" for j in range(words)) for c in range(clients)]

    async def worker(c):
        return [await _one(client, model, prompts[c], max_tokens) for _ in range(requests)]

    t0 = time.perf_counter()
    rows = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - t0
    await client.close()
    ttft = sorted(r["ttft_s"] for r in rows)
    return {"clients": clients, "requests": len(rows), "output_tokens": sum(r["tokens"] for r in rows),
            "wall_s": round(wall, 3), "output_tokens_per_s": round(sum(r["tokens"] for r in rows) / wall, 1),
            "ttft_ms_p50": round(1e3 * statistics.median(ttft), 1),
            "ttft_ms_p90": round(1e3 * ttft[int(0.9 * (len(ttft) - 1))], 1),
            "per_request_tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in rows), 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument("--model", default="tiny-v41")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=8, help="words per prompt (each client sends its own prompt "
                   "--requests times: with prefix caching the later ones reuse its whole blocks)")
    p.add_argument("--modes", default="default", help="server configurations to compare, each with its own server: "
                   "default (span prefill, prefix caching), token-serial, no-prefix-caching")
    a = p.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    modes = a.modes.split(",")
    if a.url is not None and modes != ["default"]:
        p.error("--modes needs servers this script starts (no --url)")
    out = {"max_tokens": a.max_tokens, "modes": {}}
    for mode in modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (choose from {sorted(MODES)})")
        out["modes"][mode] = _run_mode(a, levels, MODES[mode])
    for other in ("token-serial", "no-prefix-caching"):
        if "default" in out["modes"] and other in out["modes"]:
            d, t = out["modes"]["default"]["levels"], out["modes"][other]["levels"]
            out[f"ttft_p50_{other.replace('-', '_')}_over_default"] = {
                lv["clients"]: round(b["ttft_ms_p50"] / lv["ttft_ms_p50"], 2) for lv, b in zip(d, t)}
    print(json.dumps(out, indent=1))


MODES = {"default": (), "token-serial": ("--token-serial-prefill",), "no-prefix-caching": ("--no-enable-prefix-caching",)}


def _run_mode(a, levels: list[int], flags: tuple[str, ...]) -> dict:
    server, url = None, a.url
    if url is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from server_harness import ServerProcess

        context = max(64, 2 * (a.prompt_words + a.max_tokens))
        server = ServerProcess("--max-batch", str(max(levels)), "--max-context", str(context), "--max-waiting", "256",
                               *flags)
        url = server.url
    try:
        out = {"url": url, "flags": list(flags),
               "levels": [asyncio.run(_level(url, a.model, c, a.requests, a.max_tokens, a.prompt_words))
                          for c in levels]}
    finally:
        if server is not None:
            server.stop()
    first = out["levels"][0]
    for lv in out["levels"]:
        lv["throughput_vs_first_level"] = round(lv["output_tokens_per_s"] / first["output_tokens_per_s"], 2)
        lv["ttft_p50_vs_first_level"] = round(lv["ttft_ms_p50"] / first["ttft_ms_p50"], 2)
    return out


if __name__ == "__main__":
    main()
