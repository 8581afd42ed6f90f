"""A pipeline stage or expert-parallel rank on another host of the site: `minimill stage
--connect ADDRESS:PORT` (stage_hosts.py has stage 0's side and the handshake). Each stage 0
that comes to the address in turn gets this host as one of its stages, each time in a fresh
process that loads only its own share of the model, joins the groups and runs steps until
stage 0 stops the pipeline or is gone."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from minimill.engine import pipeline_link as link
from minimill.engine.expert_rank import load_rank, serve_rank
from minimill.engine.expert_share import ExpertShare
from minimill.engine.params import EngineError
from minimill.engine.pipeline_stage import StageLoop, load_stage
from minimill.engine.stage_hosts import (
    ASSIGNMENT_KEY,
    BEAT_S,
    NEXT_RANK_KEY,
    NONCE_KEY,
    RETRY_S,
    STOP_KEY,
    Assignment,
    own_address,
    parse_address,
    proof,
    stage_secret,
    store_key,
)
from minimill.models.registry import KNOWN_MODELS, resolve_model
from minimill.models.types import ModelConfig

log = logging.getLogger(__name__)


def serve_stages(connect: str, model: str | None = None, threads: int | None = None,
                 once: bool = False) -> int:
    """`minimill stage`: be a stage of the pipeline whose stage 0 listens at `connect`, for
    each stage 0 that comes there in turn (only the first with `once`). Each time runs in a
    fresh process; returns its exit status when `once`."""
    parse_address(connect)
    context = multiprocessing.get_context("spawn")
    current: list[Any] = []

    def stop(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # once: the exit must not be interrupted
        for process in current:
            process.kill()
            process.join(10)  # gone (and reaped) before this process is
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    while True:
        process = context.Process(target=_session, name="minimill-stage",
                                  args=(connect, model, threads, os.getpid()))
        current[:] = [process]
        process.start()
        process.join()
        code = process.exitcode or 0
        if once:
            return code
        log.info("stage: the pipeline ended (status %d); waiting for stage 0 at %s again",
                 code, connect)
        time.sleep(RETRY_S)


def _session(connect: str, model: str | None, threads: int | None, parent: int) -> None:
    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s stage %(levelname)s %(message)s", stream=sys.stderr)
    threading.Thread(target=_watch_parent, args=(parent,), name="minimill-stage-parent",
                     daemon=True).start()
    sys.exit(_run_session(connect, model, threads))


def _watch_parent(parent: int) -> None:
    """A session never outlives its `minimill stage` (killed, it cannot stop its child)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _connect(host: str, port: int) -> Any:
    """A client of stage 0's store, once stage 0 listens (asked with a plain connection
    first: the store's client logs a C++ stack trace at every refused attempt)."""
    said = False
    while True:
        try:
            socket.create_connection((host, port), timeout=RETRY_S * 5).close()
            return dist.TCPStore(host, port, None, False, timedelta(seconds=RETRY_S * 5))
        except Exception:
            if not said:
                log.info("stage: waiting for stage 0 at %s:%d", host, port)
                said = True
            time.sleep(RETRY_S)


def _run_session(connect: str, model: str | None, threads: int | None) -> int:
    host, port = parse_address(connect)
    store = _connect(host, port)
    rank = int(store.add(NEXT_RANK_KEY, 1))
    assignment = link.loads(store.get(ASSIGNMENT_KEY))
    if not isinstance(assignment, Assignment):
        log.error("stage: %s sent no assignment", connect)
        return 2
    if rank >= assignment.num_stages:
        log.error("stage: stage 0 at %s has all %d of its stages", connect,
                  assignment.num_stages - 1)
        return 2
    store.set(store_key("proof", rank), proof(stage_secret(), store.get(NONCE_KEY), rank))
    keep = assignment.keeps[rank]
    config = assignment.config
    config.num_threads = threads or os.cpu_count() or 1
    model = model or _model_here(assignment)
    expected = assignment.model_config

    def same_model(found: ModelConfig) -> None:
        if found != expected:
            raise EngineError(f"{model} on {socket.gethostname()} is not the model stage 0 "
                              f"runs ({expected.architecture}, {expected.num_hidden_layers} "
                              f"layers, hidden {expected.hidden_size})")

    try:
        if isinstance(keep, ExpertShare):
            runner, exchange, memory, experts = load_rank(model, config, keep, same_model,
                                                         auto_pull=True)
            what = f"experts {keep.local.start}-{keep.local.stop - 1}"
        else:
            runner, memory = load_stage(model, config, keep, same_model, auto_pull=True)
            experts, what = [], f"layers {keep.layers.start}-{keep.layers.stop - 1}"
    except Exception as exc:
        log.error("stage %d: %s: %s", rank, type(exc).__name__, exc)
        store.set(store_key("ready", rank), link.dumps(("error", f"{type(exc).__name__}: {exc}")))
        return 1
    ready = ("ready", os.getpid(), memory, socket.gethostname(), experts)
    store.set(store_key("ready", rank), link.dumps(ready))
    log.info("stage %d of %d: %s of %s", rank, assignment.num_stages - 1, what, model)
    threading.Thread(target=_beat, args=(host, port, rank), name="minimill-stage-beat",
                     daemon=True).start()
    address = own_address(host, port)
    try:
        groups = link.join(rank, assignment.num_stages, port, store, host=host,
                           address=address)
        if isinstance(keep, ExpertShare):
            serve_rank(runner, exchange, groups, address)
        else:
            StageLoop(runner, groups).run()
    except Exception as exc:  # stage 0 went away mid-step
        log.warning("stage %d: the link to stage 0 broke: %s", rank, exc)
        os._exit(1)  # gloo's threads may still hold the broken link: no teardown
    log.info("stage %d: stage 0 stopped the pipeline", rank)
    os._exit(0)


def _model_here(assignment: Assignment) -> str:
    """The model as stage 0 named it (a known name, or a path or cached name that exists
    here), else the path stage 0 read it from."""
    if assignment.model in KNOWN_MODELS:
        return assignment.model
    try:
        resolve_model(assignment.model)
        return assignment.model
    except Exception:
        return assignment.source


def _beat(host: str, port: int, rank: int) -> None:
    """Tell stage 0 this stage lives; leave when stage 0 says stop or is gone."""
    try:
        store = dist.TCPStore(host, port, None, False, link.STORE_TIMEOUT)
        while True:
            store.add(store_key("beat", rank), 1)
            if store.check([STOP_KEY]):
                log.info("stage %d: stage 0 ended the pipeline", rank)
                os._exit(0)
            time.sleep(BEAT_S)
    except Exception as exc:
        log.warning("stage %d: stage 0 is gone: %s", rank, exc)
        os._exit(1)
