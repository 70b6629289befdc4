"""What `heron serve`'s flags mean once parsed: the engine config, the engine process's CPU threads, the API
keys. Read by the server (api_server.py) when it starts; the flags themselves are declared in cli.py."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from heron.config import EngineConfig, resolve_device
from heron.entrypoints.engine_args import engine_config

logger = logging.getLogger(__name__)


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags plus the server's own model-level ones (chat template, served names)."""
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    names = args.served_model_name
    return engine_config(args, chat_template=template, served_model_name=names[0] if names else None)


def engine_cpu_threads(args: argparse.Namespace, config: EngineConfig) -> int | None:
    """Torch's thread count for the engine process on the CPU (None on a GPU: torch's default), chosen
    deliberately: torch's default of one thread per core makes the engine's threads fight the HTTP side
    (and each other, on a busy machine) for cores, and a descheduled thread stalls every step. With
    data-parallel replicas, the count is each one's."""
    if resolve_device(config.device).type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.cpu_threads is not None:
        threads, why = args.cpu_threads, "--cpu-threads"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads, why = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        dp = config.parallel.data_parallel_size  # replicas share the cores: each gets its part
        threads, why = max(1, min(4, cores - 1) // dp), f"the default min(4, cores - 1) of {cores} cores"
        why += f", shared by {dp} replicas" if dp > 1 else ""
    logger.info("The engine runs torch on %d CPU thread(s) (%s; set --cpu-threads to change it)", threads, why)
    return threads


def api_keys(args: argparse.Namespace) -> list[str]:
    return list(args.api_key or [])
