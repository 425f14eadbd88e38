"""moto's S3 server on loopback for the object-storage tests: the AWS variables pointing at it,
a bucket, and the local cache of remote indexes in a folder of the test's."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def s3_server(bucket: str, cache_dir: Path) -> Iterator[str]:
    """Starts the server, sets the variables (until the block ends) and creates ``bucket``;
    yields the endpoint URL. Set before a Ray cluster starts, its workers inherit the variables."""
    import boto3
    from moto.server import ThreadedMotoServer

    from eogp_index.data import location

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
                location.CACHE_ENV: str(cache_dir),
            }.items():
                patch.setenv(name, value)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            yield endpoint
    finally:
        server.stop()
