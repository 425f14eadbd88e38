#!/usr/bin/env python
"""Peak RSS of a plain model's forward and backward passes on the CPU, float32 against bfloat16:
does half precision itself cost memory there, whatever eogp-index does?

A GPT-2-shaped model of width 256 and 2 layers (random init, built from a config; the shapes of
``benchmarks/fit_memory.py``'s default run) runs batches of 8 sequences of every length from 20 to
128 tokens, each pass rooted at the embeddings' output as gradient capture does, each dtype in
its own process; bfloat16 also with oneDNN's primitive cache off (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``).
Nothing is asserted: the peaks are printed side by side (``--json PATH`` also writes them).

    python benchmarks/cpu_half_memory.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import add_json_argument, peak_rss_bytes, prints_json, write_json


def hwm_gb() -> float:
    return peak_rss_bytes() / 1e9


def child(dtype_name: str) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).to(getattr(torch, dtype_name)).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    start = hwm_gb()
    for length in range(20, 129):
        ids = torch.randint(0, config.vocab_size, (8, length))
        embeddings = model.transformer.wte(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeddings).logits.float().sum().backward()
    print(json.dumps({"start_gb": start, "peak_gb": hwm_gb()}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_argument(parser)
    args = parser.parse_args()
    runs = [("float32", {}), ("bfloat16", {}), ("bfloat16", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"})]
    results = []
    for dtype, env in runs:
        done = subprocess.run(
            [sys.executable, __file__, "--child", dtype],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            check=True,
        )
        results.append((dtype, env, json.loads(done.stdout.strip().splitlines()[-1])))
    base = results[0][2]["peak_gb"]
    write_json(
        args.json,
        [
            {
                "dtype": dtype,
                "onednn_cache": "off" if env else "default",
                **result,
                "peak_over_float32": result["peak_gb"] / base,
            }
            for dtype, env, result in results
        ],
    )
    if prints_json(args):
        return
    print(f"{'dtype':<10} {'oneDNN cache':<13} {'start':>8} {'peak':>8} {'peak / float32':>15}")
    for dtype, env, result in results:
        cache = "off" if env else "default"
        print(
            f"{dtype:<10} {cache:<13} {result['start_gb']:>6.2f}GB {result['peak_gb']:>6.2f}GB "
            f"{result['peak_gb'] / base:>15.2f}"
        )


if __name__ == "__main__":
    main()
