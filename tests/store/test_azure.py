"""An index at an ``az://`` URL: the tiny model's index fitted, ingested and queried in a
container of Azurite's blob service on loopback (the variables Lance's object store and pyarrow
read, ``AZURE_STORAGE_USE_EMULATOR`` and ``AZURITE_BLOB_STORAGE_URL``) answers what the same steps
on a local directory answer. Skips, naming the install command, where Azurite is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from azurite import azurite_server, blob_filesystem
from click.testing import CliRunner
from tinymodels import make_tiny_gpt2, save_workspace

from eogp_index.cli import cli
from eogp_index.data import location
from eogp_index.errors import ConfigError

pytestmark = pytest.mark.objectstore
__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

CONTAINER = "eogp-test"
DOCUMENTS = 12


def _ok(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def _hits(result):
    return [[(r["id"], r["score"]) for r in side["results"]] for side in json.loads(result.stdout)]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """One fit to ``az://eogp-test/idx``, its files copied to a local directory; both ingested
    with the same records. Yields the work folder and the two locations."""
    root = tmp_path_factory.mktemp("azure")
    with azurite_server(CONTAINER, root) as endpoint:
        save_workspace(root, make_tiny_gpt2(), DOCUMENTS, stride=5, numbered=True)
        url = f"az://{CONTAINER}/idx"
        fit = ["-k", "16", "--curvature-examples", str(DOCUMENTS), "--pca-examples", str(DOCUMENTS)]
        _ok("fit", root / "model", "--data", root / "shard.jsonl", "--out", url, *fit, "--max-tokens", "24")
        remote = location.index_path(url)
        pafs.copy_files(remote.fs_path, str(root / "idx"), remote.filesystem, pafs.LocalFileSystem())
        for where in (root / "idx", url):
            _ok("ingest", where, root / "shard.jsonl", "--id-field", "id", "--metadata", "n", "--json")
        yield root, {"local": root / "idx", "az": url}, endpoint


def test_the_index_lives_in_the_container_and_nothing_named_az_is_made(both):
    root, indexes, endpoint = both
    keys = {
        info.path
        for info in blob_filesystem(endpoint).get_file_info(pafs.FileSelector(CONTAINER, recursive=True))
        if info.type == pafs.FileType.File
    }
    prefix = f"{CONTAINER}/idx/"
    assert {prefix + "manifest.json", prefix + "projection.safetensors", prefix + "sources.json"} <= keys
    assert any(key.startswith(prefix + "examples.lance/_versions/") for key in keys)
    assert not any("/hot/" in key or "ingest-cache" in key for key in keys)  # on a local disk
    assert not (Path.cwd() / "az:").exists() and not (root / "az:").exists()
    info = json.loads(_ok("info", indexes["az"], "--json").stdout)
    assert info["rows"] == DOCUMENTS and info["path"] == indexes["az"]


def test_queries_equal_the_local_index(both):
    from eogp_index.client import AttributionIndex

    _, indexes, _ = both
    question = ["--text", "t1 t2 t3 t4", "-k", "5", "--direction", "both", "--where", "n > 3", "--json"]
    local = _hits(_ok("query", indexes["local"], *question))
    assert local[0] and _hits(_ok("query", indexes["az"], *question)) == local
    answers = {
        name: AttributionIndex(where).search("t5 t6 t7").limit(4).direction("both").to_arrow().to_pylist()
        for name, where in indexes.items()
    }
    assert answers["az"] == answers["local"] and answers["local"]


def test_the_azure_settings_come_from_the_environment(monkeypatch):
    """No server: what each layer is given for an az:// index, from the variables alone."""
    for name in ("AZURE_STORAGE_USE_EMULATOR", "AZURITE_BLOB_STORAGE_URL", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    remote = location.index_path("az://box/idx")
    assert location.lance_target(remote / "examples.lance") == ("az://box/idx/examples.lance", None)
    settings = dict(location._env_key("az", "box"))
    assert location._azure_options(None, settings) == {"account_name": "acct"}
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")
    assert location._azure_options("other", dict(location._env_key("az", "box"))) == {
        "account_name": "other",
        "account_key": "a2V5",
    }
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY")
    emulated = location._azure_options(None, dict(location._env_key("az", "box")))
    assert emulated == {
        "account_name": location.AZURITE_ACCOUNT,
        "account_key": location.AZURITE_KEY,
        "blob_storage_authority": "127.0.0.1:10000",
        "blob_storage_scheme": "http",
        "dfs_storage_authority": "127.0.0.1:10000",
        "dfs_storage_scheme": "http",
    }
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:4000/")
    assert location._azure_options(None, dict(location._env_key("az", "box")))["blob_storage_authority"] == (
        "127.0.0.1:4000"
    )
    assert location.storage_options("az://box/idx") == {"azure_storage_account_name": location.AZURITE_ACCOUNT}
    monkeypatch.delenv("AZURE_STORAGE_USE_EMULATOR")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        location._azure_options(None, dict(location._env_key("az", "box")))
