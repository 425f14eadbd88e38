"""Measurements beyond a text's loss equal kronfluence given the same measurement.

At full width (m = k = d, fp32, ekfac-topk) the index's score of a prompt-completion query (text
or messages: loss on the completion only) and of a preference query (log p(chosen | prompt) -
log p(rejected | prompt)) equals kronfluence's EK-FAC pairwise score with that measurement in
its ``Task.compute_measurement``, on a tiny GPT-2 and a tiny Llama. The reference's inputs are
built here from the words, not by the index's tokenization.
"""

import numpy as np
import pytest
from tinymodels import kronfluence_scores, make_examples, make_tiny_gpt2, make_tiny_llama, make_word_tokenizer

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.data.records import IGNORE_INDEX, Example
from eogp_index.errors import InputError

TRAIN = make_examples(16, seed=3)
#: Each word ``tN`` is token N; the template wraps a turn in t1 ... t2 and prompts with t1.
CHAT_TEMPLATE = (
    "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t1 {% endif %}"
)

TEXT_QUERY = {"prompt": "t5 t9 t3", "completion": " t7 t2 t8 t11"}
CHAT_QUERY = {
    "prompt": [{"role": "user", "content": "t5 t6 t40"}],
    "completion": [{"role": "assistant", "content": "t7 t8"}],
}
PREFERENCE_QUERIES = [
    {"prompt": "t5 t9 t3", "chosen": " t7 t2 t8", "rejected": " t30 t31"},
    {
        "prompt": [{"role": "user", "content": "t12 t13"}],
        "chosen": [{"role": "assistant", "content": "t14"}],
        "rejected": [{"role": "assistant", "content": "t20 t21 t22"}],
    },
]


def _completion(prompt_ids, completion_ids) -> Example:
    """The reference's example: the prompt's labels are -100, the completion's count."""
    return Example.from_ids(
        "ref", list(prompt_ids) + list(completion_ids), [IGNORE_INDEX] * len(prompt_ids) + list(completion_ids)
    )


#: The reference tokenizations of the queries above, written out by hand.
TEXT_REFERENCE = _completion([5, 9, 3], [7, 2, 8, 11])
CHAT_REFERENCE = _completion([1, 5, 6, 40, 2, 1], [7, 8, 2])
PREFERENCE_REFERENCES = [
    (_completion([5, 9, 3], [7, 2, 8]), _completion([5, 9, 3], [30, 31])),
    (_completion([1, 12, 13, 2, 1], [14, 2]), _completion([1, 12, 13, 2, 1], [20, 21, 22, 2])),
]


@pytest.fixture(scope="module", params=[make_tiny_gpt2, make_tiny_llama], ids=["gpt2", "llama"])
def full_width(request, tmp_path_factory):
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    index = AttributionIndex.create(
        tmp_path_factory.mktemp("measure") / "idx",
        request.param(),
        tokenizer,
        TRAIN,
        model_name="tiny",
        curvature=CurvatureConfig(num_examples=16, batch_size=4),
        gradients=GradientConfig(batch_size=5),
        projection=ProjectionConfig(variant="ekfac-topk", k=10**9),
        storage=StorageConfig(precision="fp32"),
        progress=False,
    )
    index.ingest(TRAIN, progress=False)
    return index


def _ours(index, queries):
    ids, scores = index.scores(queries)
    return scores[:, [ids.index(e.id) for e in TRAIN]].astype(np.float64)


def _relative_error(ours, reference):
    return np.linalg.norm(ours - reference) / np.linalg.norm(reference)


def test_completion_only_loss_equals_kronfluence(full_width):
    ours = _ours(full_width, [TEXT_QUERY, CHAT_QUERY])
    reference = kronfluence_scores(full_width, [TEXT_REFERENCE, CHAT_REFERENCE], TRAIN)
    assert _relative_error(ours, reference) <= 1e-4


def test_preference_margin_equals_kronfluence(full_width):
    ours = _ours(full_width, PREFERENCE_QUERIES)
    reference = kronfluence_scores(full_width, PREFERENCE_REFERENCES, TRAIN, preference=True)
    assert _relative_error(ours, reference) <= 1e-4
    # Not the loss of either completion alone: the margin is its own measurement.
    chosen = kronfluence_scores(full_width, [c for c, _ in PREFERENCE_REFERENCES], TRAIN)
    assert _relative_error(chosen, reference) > 1e-2


def test_preference_query_fields_are_checked(full_width):
    with pytest.raises(InputError, match=r"lacks \['rejected'\]"):
        full_width.scores([{"prompt": "t1", "chosen": " t2"}])
    with pytest.raises(InputError, match="preference query .* answered by query, select and scores"):
        full_width.query_examples([PREFERENCE_QUERIES[0]])
