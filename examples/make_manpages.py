#!/usr/bin/env python
"""Regenerate ``examples/manpages/``: the second evaluation case, wider model, different text.

The shipped default (``examples/default``) is a 2-layer GPT-2 of width 128 on Python docstrings.
This case checks that conclusions drawn there hold elsewhere: a GPT-2 of width 256 (attributed
modules of 65k-262k parameters, so a first-stage width m can be much smaller than d_u) trained
on a different kind of text, Debian manual pages. Everything comes from the machine itself:

* **Corpus.** English manual pages installed under ``/usr/share/man/man{1,5,7,8}`` (the
  ``manpages`` package and every other installed package's pages, without the generated
  ``gcloud`` pages). Pages are de-duplicated by their resolved path, a seeded sample of
  :data:`N_PAGES` is rendered to plain text by ``man -l`` (80 columns, no hyphenation or
  justification), and each section of a page (NAME, DESCRIPTION, OPTIONS, ...) is cut into
  documents of consecutive paragraphs with at least 200 characters. A seeded split makes
  ``queries`` (64) and ``train`` (512) from the documents of 200-400 characters and samples
  :data:`MAX_PRETRAIN` of the rest for ``pretrain``; queries and training documents may come
  from the same page, as docstrings of one module do in the default.
* **Tokenizer.** Byte-level BPE, 2048 tokens, trained on pretrain + train text.
* **Models.** ``base/``: a 2-layer GPT-2 of width 256 pretrained from scratch on ``pretrain``;
  ``model/``: ``base`` fine-tuned on ``train`` with the default :class:`FinetuneRecipe`.

The installed pages differ between machines, so the shipped output (not this script's rerun)
is the reference; ``manifest.json`` lists the pages used::

    python examples/make_manpages.py            # writes examples/manpages/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from make_default import (  # noqa: E402  (shared corpus-writing helpers)
    FINETUNE,
    MIN_CHARS,
    VOCAB_SIZE,
    _sha256,
    split_corpus,
    write_jsonl,
)

from eogp_index.evaluation import tinylm  # noqa: E402

MAN_ROOT = Path("/usr/share/man")
SECTIONS = ("1", "5", "7", "8")
N_PAGES = 2000
MAX_PRETRAIN = (
    16000  # pretraining passages kept (a seeded sample): about one pass of the pretraining steps; keeps the repo small
)
MAX_CHARS = 1200  # pretraining documents are cut at paragraph boundaries below this
SPLIT_SEED = 20261124
PRETRAIN = tinylm.PretrainRecipe(steps=500)
WIDTH = 256
#: Page families skipped: the Google Cloud SDK's 16k generated gcloud pages would be most of man1.
SKIP = ("gcloud",)
HEADING = re.compile(r"^[A-Z][A-Z0-9 ,/&()'-]*$")


def list_pages(root: Path = MAN_ROOT, sections=SECTIONS) -> list[Path]:
    """English pages of ``sections``, one per resolved file, without ``.so`` redirect stubs."""
    seen, pages = set(), []
    for sec in sections:
        for p in sorted((root / f"man{sec}").glob("*")):
            real = p.resolve()
            if real in seen or not real.is_file() or real.stat().st_size < 300 or p.name.startswith(SKIP):
                continue
            seen.add(real)
            pages.append(p)
    return pages


def render(page: Path) -> str:
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    out = subprocess.run(["man", "-l", "--nj", "--nh", str(page)], capture_output=True, env=env, timeout=60)
    text = out.stdout.decode("utf-8", "replace")
    return re.sub(r".\x08", "", text)  # overstrike bold/underline, as `col -b` would


def page_documents(page: Path, text: str) -> list[dict]:
    """Documents of one rendered page: paragraphs joined per section until >= MIN_CHARS."""
    name = page.name.split(".")[0]
    section = page.parent.name[3:]
    docs: list[dict] = []
    heading, paragraph, acc = "", [], []

    def flush_doc() -> None:
        text = "\n".join(acc).strip()
        if len(text) >= MIN_CHARS:
            docs.append(
                {
                    "text": text,
                    "page": f"{name}({section})",
                    "section": section,
                    "heading": heading,
                    "n_chars": len(text),
                }
            )
        acc.clear()

    def end_paragraph() -> None:
        if paragraph:
            para = " ".join(" ".join(paragraph).split())
            paragraph.clear()
            if acc and sum(len(a) + 1 for a in acc) + len(para) > MAX_CHARS:
                flush_doc()
            acc.append(para)
            if sum(len(a) + 1 for a in acc) >= MIN_CHARS:
                flush_doc()

    lines = text.splitlines()[1:-1]  # drop the running header and footer
    for line in lines:
        if not line.strip():
            end_paragraph()
        elif not line.startswith(" ") and HEADING.match(line.strip()):
            end_paragraph()
            acc.clear()  # a section's short remainder is not glued to the next section
            heading = line.strip()
        else:
            paragraph.append(line.strip())
    end_paragraph()
    return docs


def collect(n_pages: int = N_PAGES, seed: int = SPLIT_SEED) -> tuple[list[dict], list[str]]:
    pages = list_pages()
    picked = sorted(random.Random(seed).sample(pages, min(n_pages, len(pages))))
    with ThreadPoolExecutor(max_workers=4) as pool:
        texts = list(pool.map(render, picked))
    seen, docs = set(), []
    for page, text in zip(picked, texts):
        for d in page_documents(page, text):
            if d["text"] not in seen:
                seen.add(d["text"])
                docs.append(d)
    return docs, [str(p.relative_to(MAN_ROOT)) for p in picked]


README = """\
# eogp-index second evaluation case: manual pages, wider model

Generated by `python examples/make_manpages.py`; do not edit by hand. The second case of `eogp
eval` (see `examples/eval_default.md`): a wider model than the default, trained on a different
kind of text, made offline from the {n_pages} Debian manual pages (sections 1, 5, 7, 8) sampled
from this machine (listed in `manifest.json`).

| path | contents |
|---|---|
| `corpus/pretrain.jsonl.gz` | {n_pre} man-page passages used only to pretrain `base/` |
| `corpus/train.jsonl.gz` | {n_train} passages `model/` is fine-tuned on: the attribution training set |
| `queries.jsonl` | {n_q} held-out passages to use as queries |
| `base/` | 2-layer GPT-2 (n_embd {width}, n_inner {inner}, vocab {vocab}) pretrained from scratch for {steps} steps |
| `model/` | `base/` fine-tuned on `train` ({r.epochs} epochs, lr {r.lr:g}, batch {r.batch_size}, {r.max_tokens} tokens) |
| `manifest.json` | versions, recipes, losses, pages and sha256 of every file |

Records are `{{"id", "text", "page", "section", "heading", "n_chars"}}`. Attributed modules have
d_u = 65,536 to 262,144 parameters (the default's are at most 65,536).

Mean next-token loss (nats/token) on the {n_q} queries: base {base_q:.3f}, model {model_q:.3f};
on the training documents: base {base_t:.3f}, model {model_t:.3f}.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "manpages")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pages", type=int, default=N_PAGES)
    ap.add_argument("--pretrain-steps", type=int, default=PRETRAIN.steps)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: Path = args.out
    t_all = time.perf_counter()

    docs, pages = collect(args.pages)
    splits = split_corpus(docs, seed=SPLIT_SEED, max_pretrain=MAX_PRETRAIN)
    print(
        f"corpus: {len(docs)} passages from {len(pages)} pages -> "
        + ", ".join(f"{k} {len(v)}" for k, v in splits.items()),
        flush=True,
    )
    for sub in ("corpus", "base", "model"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    (out / "manifest.json").unlink(missing_ok=True)  # written last: its presence means "complete"
    write_jsonl(out / "corpus" / "pretrain.jsonl.gz", splits["pretrain"])
    write_jsonl(out / "corpus" / "train.jsonl.gz", splits["train"])
    write_jsonl(out / "queries.jsonl", splits["queries"])

    tok = tinylm.train_tokenizer([d["text"] for d in splits["pretrain"] + splits["train"]], VOCAB_SIZE)
    pre_docs = tinylm.tokenize_documents([d["text"] for d in splits["pretrain"]], tok, max_tokens=10**9)
    train_docs = tinylm.tokenize_documents([d["text"] for d in splits["train"]], tok, FINETUNE.max_tokens)
    query_docs = tinylm.tokenize_documents([d["text"] for d in splits["queries"]], tok, FINETUNE.max_tokens)
    print(
        f"tokens: pretrain {sum(map(len, pre_docs))}, train {sum(map(len, train_docs))}, "
        f"queries {sum(map(len, query_docs))}",
        flush=True,
    )

    config = tinylm.default_config(len(tok), n_embd=WIDTH, n_inner=4 * WIDTH)
    recipe = tinylm.PretrainRecipe(**{**PRETRAIN.to_dict(), "steps": args.pretrain_steps})
    t0 = time.perf_counter()
    base = tinylm.pretrain(pre_docs, config, recipe, log=lambda *a: print(*a, flush=True), log_every=100)
    t_pretrain = time.perf_counter() - t0

    def mean_token_loss(model, documents) -> float:
        losses = tinylm.document_losses(model, documents)
        return float(losses.sum() / sum(len(d) - 1 for d in documents))

    base_stats = {"train_loss": mean_token_loss(base, train_docs), "query_loss": mean_token_loss(base, query_docs)}
    base.save_pretrained(out / "base")
    tok.save_pretrained(out / "base")
    t0 = time.perf_counter()
    model = tinylm.finetune(base, train_docs, FINETUNE)
    t_finetune = time.perf_counter() - t0
    model_stats = {"train_loss": mean_token_loss(model, train_docs), "query_loss": mean_token_loss(model, query_docs)}
    print(f"base {base_stats}, model {model_stats}; pretrain {t_pretrain:.0f}s, finetune {t_finetune:.0f}s", flush=True)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")

    (out / "README.md").write_text(
        README.format(
            n_pages=len(pages),
            n_pre=len(splits["pretrain"]),
            n_train=len(splits["train"]),
            n_q=len(splits["queries"]),
            width=WIDTH,
            inner=4 * WIDTH,
            vocab=len(tok),
            steps=recipe.steps,
            r=FINETUNE,
            base_q=base_stats["query_loss"],
            model_q=model_stats["query_loss"],
            base_t=base_stats["train_loss"],
            model_t=model_stats["train_loss"],
        ),
        encoding="utf-8",
    )
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        "description": "eogp-index second evaluation case: Debian manual pages, byte-level BPE, GPT-2 width 256.",
        "generator": "examples/make_manpages.py",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "counts": {k: len(v) for k, v in splits.items()},
        "split_seed": SPLIT_SEED,
        "vocab_size": len(tok),
        "pretrain_recipe": recipe.to_dict(),
        "finetune_recipe": FINETUNE.to_dict(),
        "mean_token_loss": {"base": base_stats, "model": model_stats},
        "seconds": {"pretrain": round(t_pretrain, 1), "finetune": round(t_finetune, 1)},
        "pages": pages,
        "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} in {time.perf_counter() - t_all:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
