"""Azurite's blob service on loopback for the Azure tests: the variables that point Lance's object
store and pyarrow's AzureFileSystem at it, a container, and the local cache of remote indexes in
a folder of the test's. Azurite is an npm package: ``npm install -g azurite`` puts
``azurite-blob`` on the PATH; without it the tests skip and say so."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

INSTALL = "make azurite (npm install --prefix .azurite azurite), or npm install -g azurite"
#: Where `make azurite` installs it (the repository's .azurite/, ignored by git).
LOCAL = Path(__file__).resolve().parents[1] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


def azurite_command() -> str:
    """The ``azurite-blob`` that `make azurite` installed, else the one on the PATH; skips the
    test naming the install command without either."""
    found = str(LOCAL) if LOCAL.is_file() else shutil.which("azurite-blob")
    if found is None:
        pytest.skip(f"Azurite is not installed: {INSTALL}")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"azurite-blob exited with {process.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"azurite-blob did not listen on 127.0.0.1:{port} within 60 s: {log.read_text()[-2000:]}")


def blob_filesystem(endpoint: str):
    """A pyarrow AzureFileSystem on Azurite at ``endpoint``, set up here rather than by the index's
    code, so that a test checks what the index wrote with a view of its own."""
    import pyarrow.fs as pafs

    from eogp_index.data import location

    authority = endpoint.removeprefix("http://")
    return pafs.AzureFileSystem(
        account_name=location.AZURITE_ACCOUNT,
        account_key=location.AZURITE_KEY,
        blob_storage_authority=authority,
        blob_storage_scheme="http",
        dfs_storage_authority=authority,
        dfs_storage_scheme="http",
    )


@contextlib.contextmanager
def azurite_server(container: str, workdir: Path) -> Iterator[str]:
    """Starts Azurite's blob service (in memory), sets the variables until the block ends and
    creates ``container``; yields the blob endpoint URL."""
    from eogp_index.data import location

    command = azurite_command()
    port = _free_port()
    log = workdir / "azurite.log"
    options = ["--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
    # the Azure SDK inside pyarrow may speak a newer API version than this Azurite knows
    options += ["--skipApiVersionCheck", "--loose"]
    with open(log, "wb") as out:  # run in workdir: whatever Azurite writes stays in the test's folder
        process = subprocess.Popen([command, *options], stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_for(port, process, log)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
            patch.setenv("AZURITE_BLOB_STORAGE_URL", endpoint)
            patch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
            patch.delenv("AZURE_STORAGE_ACCOUNT_KEY", raising=False)
            patch.setenv(location.CACHE_ENV, str(workdir / "cache"))
            blob_filesystem(endpoint).create_dir(container)
            yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
