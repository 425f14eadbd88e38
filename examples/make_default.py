#!/usr/bin/env python
"""Regenerate ``examples/default/``: the offline default corpus, tokenizer and models.

Everything is made from material already on the machine, with no network access:

* **Corpus.** English documentation from the docstrings of the running interpreter's pure-
  Python standard library: the modules in :data:`MODULES` (imported by name), their classes,
  functions and methods (own docstrings only, cleaned with ``inspect.cleandoc``), at least
  200 characters each, deduplicated by text, sorted by ``(module, qualname)``. A seeded split
  makes ``queries`` (64) and ``train`` (512) from the documents of 200-400 characters (so that
  nearly all fit in the 128-token fine-tuning window) and puts every other document in
  ``pretrain``. ``corpus/chat.jsonl`` turns 32 training docstrings into Tülu-style chats.
* **Tokenizer.** Byte-level BPE, 2048 tokens, trained on pretrain + train text.
* **Models.** ``base/``: a 2-layer GPT-2 pretrained from scratch on ``pretrain``;
  ``model/``: ``base`` fine-tuned on ``train`` with :class:`FinetuneRecipe` (the model the
  default index attributes, and the recipe the LDS evaluation retrains with).

The output is deterministic for a given Python version (docstrings change between
releases), library versions and CPU thread count; ``manifest.json`` records all three.
Runs in a few minutes on 2 CPU cores::

    python examples/make_default.py            # writes examples/default/
    python examples/make_default.py --out DIR  # somewhere else
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import inspect
import io
import json
import platform
import random
import shutil
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eogp_index.evaluation import tinylm  # noqa: E402

#: Pure-Python standard-library modules whose docstrings make the corpus (sorted, fixed).
MODULES = tuple(
    sorted(
        set(
            """
abc argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks
asyncio.protocols asyncio.queues asyncio.runners asyncio.selector_events asyncio.streams
asyncio.subprocess asyncio.taskgroups asyncio.tasks asyncio.timeouts asyncio.transports
asyncio.unix_events base64 bdb bisect bz2 cProfile calendar cmd code codecs codeop
collections collections.abc colorsys compileall concurrent.futures._base
concurrent.futures.process concurrent.futures.thread configparser contextlib copy copyreg
csv dataclasses datetime dbm.dumb decimal difflib dis doctest email.charset
email.contentmanager email.feedparser email.generator email.header email.headerregistry
email.message email.mime.base email.mime.multipart email.mime.text email.parser
email.policy email.utils enum filecmp fileinput fnmatch fractions ftplib functools getopt
getpass gettext glob graphlib gzip heapq hmac html html.parser http.client http.cookiejar
http.cookies http.server imaplib importlib.abc importlib.metadata importlib.resources
importlib.util inspect ipaddress json json.decoder json.encoder keyword linecache locale
logging logging.config logging.handlers lzma mailbox mimetypes modulefinder
multiprocessing.connection multiprocessing.managers multiprocessing.pool
multiprocessing.process multiprocessing.queues multiprocessing.shared_memory
multiprocessing.synchronize netrc numbers operator optparse os pathlib pdb pickle
pickletools platform plistlib poplib posixpath pprint profile pstats py_compile pyclbr
pydoc queue quopri random re reprlib runpy sched secrets selectors shelve shlex shutil
smtplib socket socketserver ssl statistics string stringprep subprocess symtable sysconfig
tabnanny tarfile tempfile textwrap threading timeit token tokenize trace traceback
tracemalloc types typing unittest.async_case unittest.case unittest.loader unittest.mock
unittest.result unittest.runner unittest.suite urllib.error urllib.parse urllib.request
urllib.robotparser uuid warnings wave weakref wsgiref.handlers wsgiref.simple_server
wsgiref.util wsgiref.validate xml.dom.minidom xml.dom.pulldom xml.etree.ElementInclude
xml.etree.ElementTree xml.sax.handler xml.sax.saxutils xml.sax.xmlreader xmlrpc.client
zipapp zipfile zipimport
""".split()
        )
    )
)

MIN_CHARS = 200  # every document
SHORT_MAX_CHARS = 400  # train and query documents (most fit in 128 tokens)
N_TRAIN = 512
N_QUERIES = 64
N_CHAT = 32
SPLIT_SEED = 20240601
VOCAB_SIZE = 2048
FINETUNE = tinylm.FinetuneRecipe()
PRETRAIN = tinylm.PretrainRecipe()


# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------


def _own_doc(obj) -> str | None:
    """The object's own docstring, cleaned (no inheritance, unlike ``inspect.getdoc``)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc or None


def _collect_module(mod, name: str, min_chars: int, found: list) -> None:
    """Append (top-level module, qualname, kind, text) of the module, its classes, functions, methods."""
    top = name.split(".")[0]

    def add(obj, kind: str, qualname: str) -> None:
        text = _own_doc(obj)
        if text is not None and len(text) >= min_chars:
            found.append((top, qualname, kind, text))

    add(mod, "module", name)
    for attr, value in sorted(vars(mod).items()):
        if getattr(value, "__module__", None) != mod.__name__:
            continue  # re-exported from elsewhere
        if inspect.isclass(value):
            add(value, "class", f"{name}.{attr}")
            for meth, member in sorted(vars(value).items()):
                func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if inspect.isfunction(func):
                    add(func, "method", f"{name}.{attr}.{meth}")
        elif inspect.isfunction(value):
            add(value, "function", f"{name}.{attr}")


def collect_docstrings(modules=MODULES, min_chars: int = MIN_CHARS) -> list[dict]:
    """Docstring documents of ``modules``, deduplicated by text, sorted by (module, qualname)."""
    found: list[tuple[str, str, str, str]] = []  # (top-level module, qualname, kind, text)
    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules and attributes (typing.io, ...)
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                missing.append(name)
                continue
            _collect_module(mod, name, min_chars, found)
    if missing:
        print(f"warning: modules not importable here, skipped: {', '.join(missing)}", file=sys.stderr)
    found.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    seen: set[str] = set()
    docs = []
    for top, qualname, kind, text in found:
        if text in seen:
            continue
        seen.add(text)
        docs.append({"text": text, "module": top, "kind": kind, "qualname": qualname, "n_chars": len(text)})
    return docs


def split_corpus(docs: list[dict], seed: int = SPLIT_SEED, max_pretrain: int | None = None) -> dict[str, list[dict]]:
    """Seeded split into queries / train (short documents) and pretrain (everything else, a seeded
    sample of ``max_pretrain`` when given)."""
    rng = random.Random(seed)
    short = [i for i, d in enumerate(docs) if d["n_chars"] <= SHORT_MAX_CHARS]
    if len(short) < N_TRAIN + N_QUERIES:
        raise SystemExit(f"only {len(short)} short documents; need {N_TRAIN + N_QUERIES}")
    rng.shuffle(short)
    query_idx = sorted(short[:N_QUERIES])
    train_idx = sorted(short[N_QUERIES : N_QUERIES + N_TRAIN])
    taken = set(query_idx) | set(train_idx)
    pretrain_idx = [i for i in range(len(docs)) if i not in taken]
    if max_pretrain is not None and len(pretrain_idx) > max_pretrain:
        pretrain_idx = sorted(rng.sample(pretrain_idx, max_pretrain))
    out = {}
    for split, prefix, idx in (
        ("pretrain", "pretrain", pretrain_idx),
        ("train", "train", train_idx),
        ("queries", "query", query_idx),
    ):
        out[split] = [{"id": f"{prefix}-{k:05d}", **docs[i]} for k, i in enumerate(idx)]
    return out


def first_paragraph(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].strip()


def make_chats(train: list[dict], seed: int = SPLIT_SEED) -> list[dict]:
    """Tülu-style conversations about training docstrings (some with a system turn, some two turns)."""
    rng = random.Random(seed + 1)
    picks = rng.sample(range(len(train)), 2 * N_CHAT)
    system = "You are a concise assistant that explains the Python standard library."
    chats = []
    for k in range(N_CHAT):
        a, b = train[picks[2 * k]], train[picks[2 * k + 1]]
        messages = []
        if k % 3 == 0:
            messages.append({"role": "system", "content": system})
        messages += [
            {"role": "user", "content": f"What does `{a['qualname']}` do?"},
            {"role": "assistant", "content": first_paragraph(a["text"])},
        ]
        if k % 2 == 1:
            messages += [
                {"role": "user", "content": f"And `{b['qualname']}`?"},
                {"role": "assistant", "content": first_paragraph(b["text"])},
            ]
        chats.append(
            {
                "id": f"chat-{k:05d}",
                "messages": messages,
                "source": "python-stdlib-docstrings",
                "qualnames": [a["qualname"]] + ([b["qualname"]] if k % 2 == 1 else []),
            }
        )
    return chats


def _jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n" for r in records).encode("utf-8")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _jsonl_bytes(records)
    if path.suffix == ".gz":
        buf = io.BytesIO()
        # mtime=0 and no file name in the header: the bytes depend on the content only.
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            gz.write(data)
        data = buf.getvalue()
    path.write_bytes(data)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

README = """\
# eogp-index offline default

Generated by `python examples/make_default.py`; do not edit by hand. Everything here is made
from the docstrings of the Python {py} standard library ({n_mod} modules), so a machine with
no network access can build an index and answer queries.

| path | contents |
|---|---|
| `corpus/pretrain.jsonl.gz` | {n_pre} docstrings used only to pretrain `base/` |
| `corpus/train.jsonl.gz` | {n_train} docstrings `model/` is fine-tuned on: the attribution training set |
| `queries.jsonl` | {n_q} held-out docstrings to use as queries |
| `corpus/chat.jsonl` | {n_chat} Tülu-style conversations built from training docstrings |
| `base/` | 2-layer GPT-2 (n_embd 128, vocab {vocab}) pretrained from scratch for {steps} steps |
| `model/` | `base/` fine-tuned on `train` ({r.epochs} epochs, lr {r.lr:g}, batch {r.batch_size}, {r.max_tokens} tokens) |
| `manifest.json` | versions, recipes, losses and sha256 of every file |

Records are `{{"id", "text", "module", "kind", "qualname", "n_chars"}}`. Both model directories
hold the same byte-level BPE tokenizer (`<|endoftext|>` = bos/eos/unk/pad, chat roles
`<|system|>`, `<|user|>`, `<|assistant|>`, a Tülu-style chat template).

Mean next-token loss (nats/token) on the {n_q} queries: base {base_q:.3f}, model {model_q:.3f};
on the training documents: base {base_t:.3f}, model {model_t:.3f}.

Load with `eogp_index.evaluation.tinylm.load_default()`; retrain with
`tinylm.finetune("examples/default/base", documents, tinylm.FinetuneRecipe())`.
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "examples" / "default")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--pretrain-steps", type=int, default=PRETRAIN.steps)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    out: Path = args.out
    t_all = time.perf_counter()

    # Corpus --------------------------------------------------------------------------
    docs = collect_docstrings()
    splits = split_corpus(docs)
    chats = make_chats(splits["train"])
    print(
        f"corpus: {len(docs)} docstrings from {len(MODULES)} modules -> "
        + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
        + f", chat {len(chats)}"
    )

    for sub in ("corpus", "base", "model"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    write_jsonl(out / "corpus" / "pretrain.jsonl.gz", splits["pretrain"])
    write_jsonl(out / "corpus" / "train.jsonl.gz", splits["train"])
    write_jsonl(out / "corpus" / "chat.jsonl", chats)
    write_jsonl(out / "queries.jsonl", splits["queries"])

    # Tokenizer -----------------------------------------------------------------------
    t0 = time.perf_counter()
    tok = tinylm.train_tokenizer([d["text"] for d in splits["pretrain"] + splits["train"]], VOCAB_SIZE)
    print(f"tokenizer: {len(tok)} tokens ({time.perf_counter() - t0:.1f}s)")

    pre_docs = tinylm.tokenize_documents([d["text"] for d in splits["pretrain"]], tok, max_tokens=10**9)
    train_docs = tinylm.tokenize_documents([d["text"] for d in splits["train"]], tok, FINETUNE.max_tokens)
    query_docs = tinylm.tokenize_documents([d["text"] for d in splits["queries"]], tok, FINETUNE.max_tokens)
    n_cut = sum(
        len(tok(d["text"], verbose=False)["input_ids"]) + 1 > FINETUNE.max_tokens
        for d in splits["train"] + splits["queries"]
    )
    print(
        f"tokens: pretrain {sum(map(len, pre_docs))}, train {sum(map(len, train_docs))}, "
        f"queries {sum(map(len, query_docs))}; train/query documents truncated: {n_cut}"
    )

    # Base model ----------------------------------------------------------------------
    config = tinylm.default_config(len(tok))
    recipe = tinylm.PretrainRecipe(**{**PRETRAIN.to_dict(), "steps": args.pretrain_steps})
    t0, c0 = time.perf_counter(), time.process_time()
    base = tinylm.pretrain(pre_docs, config, recipe, log=print, log_every=200)
    t_pretrain, c_pretrain = time.perf_counter() - t0, time.process_time() - c0
    pre_eval = tinylm.pack_blocks(pre_docs, recipe.block_size)

    def mean_token_loss(model, documents) -> float:
        losses = tinylm.document_losses(model, documents)
        return float(losses.sum() / sum(len(d) - 1 for d in documents))

    base_stats = {
        "pretrain_loss": mean_token_loss(base, pre_eval.tolist()),
        "train_loss": mean_token_loss(base, train_docs),
        "query_loss": mean_token_loss(base, query_docs),
    }
    print(
        f"base: {recipe.steps} steps in {t_pretrain:.1f}s wall, {c_pretrain:.1f}s CPU; mean token loss pretrain {base_stats['pretrain_loss']:.4f}, "
        f"train {base_stats['train_loss']:.4f}, queries {base_stats['query_loss']:.4f}"
    )
    base.save_pretrained(out / "base")
    tok.save_pretrained(out / "base")

    # Fine-tuned model ----------------------------------------------------------------
    t0, c0 = time.perf_counter(), time.process_time()
    model = tinylm.finetune(base, train_docs, FINETUNE)
    t_finetune, c_finetune = time.perf_counter() - t0, time.process_time() - c0
    model_stats = {
        "train_loss": mean_token_loss(model, train_docs),
        "query_loss": mean_token_loss(model, query_docs),
    }
    print(
        f"model: fine-tuned on {len(train_docs)} documents x {FINETUNE.epochs} epochs in {t_finetune:.1f}s wall, {c_finetune:.1f}s CPU; "
        f"mean token loss train {model_stats['train_loss']:.4f}, queries {model_stats['query_loss']:.4f}"
    )
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")

    # README and manifest -------------------------------------------------------------
    (out / "README.md").write_text(
        README.format(
            n_pre=len(splits["pretrain"]),
            n_train=len(splits["train"]),
            n_q=len(splits["queries"]),
            n_chat=len(chats),
            n_mod=len(MODULES),
            py=platform.python_version(),
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
        "description": "eogp-index offline default: Python stdlib docstrings, byte-level BPE, tiny GPT-2.",
        "generator": "examples/make_default.py",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "threads": args.threads,
        "modules": list(MODULES),
        "counts": {**{k: len(v) for k, v in splits.items()}, "chat": len(chats)},
        "split_seed": SPLIT_SEED,
        "vocab_size": len(tok),
        "pretrain_recipe": recipe.to_dict(),
        "finetune_recipe": FINETUNE.to_dict(),
        "mean_token_loss": {"base": base_stats, "model": model_stats},
        "files": {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB) in {time.perf_counter() - t_all:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
