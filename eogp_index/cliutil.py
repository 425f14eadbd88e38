"""What every ``eogp`` command group shares: clean failures, ``--json`` output, torchrun workers."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any, Callable

import click

from eogp_index.errors import ConfigError, EOGPError


def fail_cleanly(func: Callable) -> Callable:
    """Turn library errors into ``click`` errors: a message and exit status 1, no traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except EOGPError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON, or hand it to ``human`` for a readable rendering."""
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def torchrun_rank() -> int:
    """This worker's rank in a ``torchrun`` job (0 outside one), from the environment torchrun sets."""
    return int(os.environ.get("RANK", "0"))


def under_torchrun(flag: bool) -> bool:
    """Whether a command runs as one of several ``torchrun`` workers (or was told to with ``--distributed``)."""
    return flag or int(os.environ.get("WORLD_SIZE", "1")) > 1


distributed_option = click.option(
    "--distributed",
    is_flag=True,
    help="Run as one worker of a torchrun job (implied when torchrun starts more than one).",
)


@contextlib.contextmanager
def process_group():
    """The torchrun job's process group, for one command, when torchrun started several workers.

    Gloo, whatever the device: what the workers exchange is small (top-k lists), and Gloo also
    runs where NCCL does not (CPU-only machines, tests).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield
        return
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def worker_device(device: str) -> str:
    """``device``, with ``auto`` meaning this worker's own GPU (``cuda:LOCAL_RANK``) when there is one."""
    if device != "auto":
        return device
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise ConfigError(
            f"this is torchrun worker {local_rank} on its node, which has {gpus} GPU(s): give torchrun "
            f"--nproc_per_node {gpus} (one worker per GPU), or --device cpu"
        )
    return f"cuda:{local_rank}"
