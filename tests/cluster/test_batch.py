"""`eogp scores --ray` and `eogp select --ray` on a local Ray: the same file as one process."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tinymodels import make_examples, make_tiny_gpt2, make_word_tokenizer

from eogp_index.cli import cli

pytestmark = pytest.mark.cluster

QUERIES = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 40, 41], [12, 13, 14]]
TEXTS = ["t3 t1 t4 t1 t5 t9 t2 t6", "t7 t7 t2 t40 t41", "t12 t13 t14"]
WHERE = "`group` != 1"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny model's index with an int8 rescoring tier, its 40 rows stored in 5 commits (5
    fragments), and its model saved where the manifest names it, so that the CLI opens it."""
    from eogp_index.client import AttributionIndex
    from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig

    root = tmp_path_factory.mktemp("batch")
    model, tokenizer = make_tiny_gpt2(), make_word_tokenizer()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    examples = make_examples(40, seed=5)
    index = AttributionIndex.create(
        root / "idx",
        model,
        tokenizer,
        examples,
        model_name=str(root / "model"),
        projection=ProjectionConfig(variant="eogp", k=16, m=64),
        curvature=CurvatureConfig(num_examples=40, batch_size=8),
        storage=StorageConfig(rescore="int8"),
        gradients=GradientConfig(batch_size=8),
        progress=False,
    )
    for start in range(0, 40, 8):
        index.add_batch(examples[start : start + 8])
    assert index.stored.store.fragment_count() == 5 and index.stored.tier is not None
    (root / "queries.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root, index


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_bad_address_or_shards_without_ray_is_a_clear_error(workspace, tmp_path):
    root, _ = workspace
    for args in (["--ray", "127.0.0.1:1"], ["--ray", "no-port"]):
        result = _cli("scores", root / "idx", *args, "--text", "t1 t2", "--out", tmp_path / "s.parquet")
        assert result.exit_code == 1
        assert "Ray" in result.output and "ray start --head" in result.output, result.output
    result = _cli("select", root / "idx", "--shards", "2", "--text", "t1 t2", "--out", tmp_path / "s.jsonl")
    assert result.exit_code == 2 and "give --ray too" in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("shards", [2, 3])
def test_scores_on_shards_write_the_file_one_process_writes(workspace, local_ray, tmp_path, shards):
    from eogp_index.cluster.batch import scores_on_ray
    from eogp_index.search.question import Question
    from eogp_index.search.select import write_scores

    root, index = workspace
    cases = [(Question(queries=tuple(QUERIES)), "1bit"), (Question(queries=tuple(QUERIES), where=WHERE), "rescore")]
    for n, (question, precision) in enumerate(cases):
        one, many = tmp_path / f"one{n}.parquet", tmp_path / f"many{n}.parquet"
        rows = write_scores(index, question, one, precision=precision, batch_bytes=200)
        assert scores_on_ray(index, question, many, shards=shards, precision=precision, batch_bytes=200) == rows
        table = pq.read_table(one)
        assert rows == table.num_rows == len(QUERIES) * index.stored.count(question.where) > 0
        assert pq.ParquetFile(one).metadata.num_row_groups > 2 * len(QUERIES)  # several batches per fragment
        assert many.read_bytes() == one.read_bytes()
    # The filter and the tier changed the answer (a test of two equal files would pass anyway).
    assert set(pq.read_table(tmp_path / "one1.parquet").column("group").to_pylist()) == {0, 2}


def test_scores_cli_with_ray(workspace, local_ray, tmp_path):
    root, _ = workspace
    common = ["--queries", root / "queries.jsonl", "--where", WHERE, "--precision", "rescore"]
    one = _cli("scores", root / "idx", *common, "--out", tmp_path / "one.parquet")
    many = _cli("scores", root / "idx", "--ray", "--shards", "3", *common, "--out", tmp_path / "many.parquet", "--json")
    assert one.exit_code == 0 and many.exit_code == 0, one.output + many.output
    assert json.loads(many.stdout)["rows"] == pq.read_table(tmp_path / "one.parquet").num_rows > 0
    assert (tmp_path / "many.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()


@pytest.mark.parametrize("shards", [2, 3])
def test_select_on_shards_is_the_one_process_selection(workspace, local_ray, shards):
    from eogp_index.cluster.batch import select_on_ray
    from eogp_index.config import SelectOptions
    from eogp_index.errors import InputError
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents

    _, index = workspace
    cases = [
        (Question(queries=tuple(QUERIES)), SelectOptions(top="7")),
        (Question(queries=tuple(QUERIES), where=WHERE), SelectOptions(top="30%", precision="rescore")),
        (
            Question(queries=tuple(QUERIES), where=WHERE, normalize="unit"),
            SelectOptions(top="5", score="max", direction="negative", precision="rescore"),
        ),
        (Question(queries=tuple(QUERIES), where="`group` = 7"), SelectOptions(top="3")),  # no row matches
    ]
    for question, options in cases:
        one = select_documents(index, question, options, batch_bytes=200)
        many = select_on_ray(index, question, options, shards=shards, batch_bytes=200)
        np.testing.assert_array_equal(many.rowaddr, one.rowaddr)
        np.testing.assert_array_equal(many.scores, one.scores)
        assert len(one.rowaddr) == options.count(index.stored.count(question.where))
    # The rows picked come from several fragments (the high 32 bits of a row address).
    assert len({int(a) >> 32 for a in select_documents(index, *cases[1]).rowaddr}) > 1
    # One shard per CPU of the cluster by default; a broken filter is refused as one process refuses it.
    np.testing.assert_array_equal(select_on_ray(index, *cases[0]).rowaddr, select_documents(index, *cases[0]).rowaddr)
    with pytest.raises(InputError) as refused:
        select_on_ray(index, Question(queries=tuple(QUERIES), where="nope = 1"), SelectOptions(top="3"), shards=2)
    assert refused.value.field == "where"


def test_select_cli_with_ray_writes_the_same_file(workspace, local_ray, tmp_path):
    root, _ = workspace
    common = ["--queries", root / "queries.jsonl", "--where", WHERE, "--top", "40%", "--precision", "rescore"]
    one = _cli("select", root / "idx", *common, "--ids-only", "--out", tmp_path / "one.jsonl")
    many = _cli(
        "select", root / "idx", "--ray", "--shards", "2", *common, "--ids-only", "--out", tmp_path / "many.jsonl"
    )
    assert one.exit_code == 0 and many.exit_code == 0, one.output + many.output
    lines = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(lines) == 10 and (tmp_path / "many.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
