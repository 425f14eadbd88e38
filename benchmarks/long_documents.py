"""Peak memory of the gradient pass on long documents, with and without gradient checkpointing.

Builds a GPT-2-shaped model from a config (random weights, nothing downloaded) whose context is
``--tokens``, and runs the gradient capture of every attributed module (as ``eogp ingest``
does, with a cheap transform in place of the projection) on ``--batch`` documents of
``--tokens`` tokens, each setting in a fresh process:

* on CUDA, the peak of ``torch.cuda.max_memory_allocated`` during the pass;
* on the CPU, the growth of the process's peak resident set (``common.peak_rss_bytes``) over
  what it held after building the model and the batch.

It prints both settings and their ratio side by side, and checks that the coordinates agree.
``--json PATH`` also writes the figures as one JSON object.

Usage: python benchmarks/long_documents.py [--tokens 2048] [--layers 12] [--width 256] [--batch 1] [--device cpu]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import add_json_argument, peak_rss_bytes, prints_json, write_json


def one_pass(args) -> dict:
    """Runs in the child process: one gradient pass, its peak memory and a checksum of the output."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from eogp_index.gradients.capture import GradientCapture
    from eogp_index.gradients.model import find_attributed_modules, freeze, replace_conv1d

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=2048,
        n_positions=args.tokens,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=max(1, args.width // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).eval()
    replace_conv1d(model)
    freeze(model)
    model.to(args.device)
    names = find_attributed_modules(model)
    ids = torch.randint(1, 2048, (args.batch, args.tokens), device=args.device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def summary(name, a, g):  # (B, 2): two numbers per example instead of the projection
        return torch.stack([torch.einsum("bto,bti->b", g, a), g.square().sum((1, 2))], dim=1)

    capture = GradientCapture(model, names, summary, checkpoint=args.checkpoint)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = peak_rss_bytes()
    started = time.perf_counter()
    out, _ = capture.run(batch)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = peak_rss_bytes() - before
    seconds = time.perf_counter() - started
    values = torch.cat([out[n].flatten().double().cpu() for n in names])
    return {"peak_bytes": int(peak), "seconds": seconds, "values": values.tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)  # the child's setting
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_pass(args)))
        return 0
    results = {}
    for checkpoint in (False, True):
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--tokens",
            str(args.tokens),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--device",
            args.device,
        ]
        out = subprocess.run(
            command + (["--checkpoint"] if checkpoint else []), check=True, capture_output=True, text=True
        )
        results[checkpoint] = json.loads(out.stdout.strip().splitlines()[-1])
    import numpy as np

    plain, ckpt = (np.array(results[c]["values"]) for c in (False, True))
    rel = float(np.abs(ckpt - plain).max() / np.abs(plain).max())
    what = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "growth of peak RSS"
    ratio = results[True]["peak_bytes"] / max(results[False]["peak_bytes"], 1)
    time_ratio = results[True]["seconds"] / results[False]["seconds"]
    write_json(
        args.json,
        {
            "layers": args.layers,
            "width": args.width,
            "batch": args.batch,
            "tokens": args.tokens,
            "device": args.device,
            "memory": what,
            **{
                key: {k: v for k, v in results[c].items() if k != "values"}
                for key, c in (("plain", False), ("checkpointed", True))
            },
            "memory_ratio": ratio,
            "time_ratio": time_ratio,
            "outputs_relative_difference": rel,
        },
    )
    if prints_json(args):
        return 0
    print(
        f"GPT-2 shape: {args.layers} layers, width {args.width}; {args.batch} x {args.tokens} tokens on {args.device}"
    )
    print(f"{'':<28}{'peak memory (' + what + ')':>44}{'time':>10}")
    for checkpoint, label in ((False, "without checkpointing"), (True, "--gradient-checkpointing")):
        r = results[checkpoint]
        print(f"{label:<28}{r['peak_bytes'] / 2**20:>40.1f} MiB{r['seconds']:>9.2f}s")
    print(f"ratio checkpointed / plain: memory {ratio:.2f}, time {time_ratio:.2f}; outputs agree to {rel:.1e} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
