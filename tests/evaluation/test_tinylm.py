"""The tiny-LM training recipe (eogp_index.evaluation.tinylm) and the shipped default.

Mechanics are tested on a throwaway 1-layer GPT-2 so the file runs in seconds; the shipped
``examples/default`` is only loaded (and skipped if it has not been generated).
"""

from __future__ import annotations

import dataclasses
import random
import socket

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: E402

from eogp_index.errors import ConfigError  # noqa: E402
from eogp_index.evaluation import tinylm  # noqa: E402

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and it stays fast on a busy shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = tinylm.default_config(VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2, n_inner=64)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    rng = random.Random(0)
    # A learnable pattern (arithmetic progressions) plus eos, lengths 3..20.
    out = []
    for _ in range(24):
        start, step, n = rng.randrange(1, VOCAB), rng.randrange(1, 4), rng.randrange(2, 20)
        out.append([1 + (start + k * step) % (VOCAB - 1) for k in range(n)] + [0])
    return out


RECIPE = tinylm.FinetuneRecipe(epochs=2, lr=1e-2, batch_size=4, max_tokens=32, seed=0)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_recipe_is_frozen_and_validated():
    r = tinylm.FinetuneRecipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.lr = 1.0  # type: ignore[misc]
    assert r.to_dict()["batch_size"] == 8 and r.to_dict()["max_tokens"] == 128
    # Bad values are user errors (ConfigError: a one-line message from `eogp eval`), naming the field.
    with pytest.raises(ConfigError, match="FinetuneRecipe.batch_size must be at least 1"):
        tinylm.FinetuneRecipe(batch_size=0)
    with pytest.raises(ConfigError, match="FinetuneRecipe.epochs"):
        tinylm.FinetuneRecipe(epochs=0)
    with pytest.raises(ConfigError, match="FinetuneRecipe.lr"):
        tinylm.FinetuneRecipe(lr=0.0)


def test_finetune_is_deterministic_for_a_seed_and_changes_with_it(tiny_model, docs):
    before = _params(tiny_model)
    a = _params(tinylm.finetune(tiny_model, docs, RECIPE))
    b = _params(tinylm.finetune(tiny_model, docs, RECIPE))
    c = _params(tinylm.finetune(tiny_model, docs, dataclasses.replace(RECIPE, seed=1)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # The base model is copied, never trained in place.
    assert all(torch.equal(before[k], v) for k, v in _params(tiny_model).items())


def test_finetune_returns_eval_model_and_lowers_training_losses(tiny_model, docs):
    steps = []
    tuned = tinylm.finetune(tiny_model, docs, RECIPE, callback=lambda s, loss: steps.append(s))
    assert not tuned.training
    assert steps == list(range(1, 2 * 6 + 1))  # 24 docs / batch 4 = 6 steps per epoch
    before = tinylm.document_losses(tiny_model, docs)
    after = tinylm.document_losses(tuned, docs)
    assert after.sum() < 0.9 * before.sum()
    assert (after < before).mean() > 0.8


def test_finetune_from_a_directory(tmp_path, tiny_model, docs):
    tiny_model.save_pretrained(tmp_path)
    from_dir = _params(tinylm.finetune(tmp_path, docs[:8], dataclasses.replace(RECIPE, epochs=1)))
    from_obj = _params(tinylm.finetune(tiny_model, docs[:8], dataclasses.replace(RECIPE, epochs=1)))
    assert all(torch.allclose(from_dir[k], from_obj[k], atol=1e-6) for k in from_obj)


def test_document_losses_match_hf_loss_and_ignore_batching(tiny_model, docs):
    losses = tinylm.document_losses(tiny_model, docs, batch_size=16)
    assert losses.dtype == np.float64 and losses.shape == (len(docs),)
    with torch.no_grad():
        ref = np.array(
            [float(tiny_model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss) * (len(d) - 1) for d in docs]
        )
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-5)

    # Other batch compositions and paddings: batch size 1 (no padding), reversed order.
    alone = tinylm.document_losses(tiny_model, docs, batch_size=1)
    reversed_ = tinylm.document_losses(tiny_model, docs[::-1], batch_size=5)[::-1]
    np.testing.assert_allclose(alone, losses, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reversed_, losses, rtol=1e-5, atol=1e-5)

    # A one-token document predicts nothing.
    assert tinylm.document_losses(tiny_model, [[5], docs[0]])[0] == 0.0
    assert tinylm.document_losses(tiny_model, []).shape == (0,)


def test_tokenize_documents_appends_eos_and_truncates():
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False, **kwargs):
            return {"input_ids": [ord(c) for c in text]}

    out = tinylm.tokenize_documents(["abc", "x" * 50], Tok(), max_tokens=8)
    assert out[0] == [97, 98, 99, 0]
    assert len(out[1]) == 8 and out[1][-1] == 0


@pytest.fixture()
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_load_default_offline(no_network):
    root = tinylm.default_root()
    if not (root / "model" / "config.json").is_file():
        pytest.skip(f"{root} not generated (python examples/make_default.py)")
    model, tok = tinylm.load_default(root)
    base, _ = tinylm.load_default(root, which="base")
    assert isinstance(model, GPT2LMHeadModel) and not model.training
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size) == (2, 4, 128, 2048)
    assert len(tok) == cfg.vocab_size and tok.model_max_length == 256

    assert tok.eos_token == tok.pad_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == cfg.eos_token_id == 0
    for special in tinylm.SPECIAL_TOKENS:
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == special

    assert tok.chat_template == tinylm.CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.<|endoftext|>\n"
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nHi\n<|assistant|>\n")
    assert (
        tok.decode(tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]) == "def f(x):\n    return x"
    )
    chat = tinylm.load_default_corpus("chat", root)[0]["messages"]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered.count("<|assistant|>\n") == sum(m["role"] == "assistant" for m in chat)

    # The corpus is there and the fine-tuned model fits its training documents better than its base.
    train = tinylm.load_default_corpus("train", root)
    queries = tinylm.load_default_corpus("queries", root)
    assert len(train) >= 256 and len(queries) >= 32
    assert {"id", "text", "module", "kind", "qualname", "n_chars"} <= set(train[0])
    assert not {r["text"] for r in train} & {r["text"] for r in queries}
    sample = tinylm.tokenize_documents([r["text"] for r in train[:32]], tok, tinylm.FinetuneRecipe().max_tokens)
    assert tinylm.document_losses(model, sample).sum() < tinylm.document_losses(base, sample).sum()
