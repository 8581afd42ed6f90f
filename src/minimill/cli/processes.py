"""The commands that run a factory's long-lived processes: `serve` (the control plane and a
local worker) and `worker` (a site joining a fleet), with the engine and box options they
share. Argument handling only, as in cli/main.py, which registers them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from minimill.cli.options import (
    DEFAULT_MODEL,
    DTYPE_HELP,
    LOCAL_SITE_USD_PER_HOUR,
    BoxMaxCpuOption,
    BoxMaxDiskOption,
    BoxMaxExecOption,
    BoxMaxMemoryOption,
    BoxMaxProcessesOption,
    DbOption,
    KvDtypeOption,
    box_caps,
)

if TYPE_CHECKING:
    from minimill.fleet.kv_options import KvOptions

KvCacheGbOption = typer.Option(None, "--kv-cache-gb", help="Builtin engine: the device KV pool "
                               "in GiB (default: a share of free memory).")
KvHostGbOption = typer.Option(0.0, "--kv-host-gb", help="Builtin engine: GiB of host RAM that "
                              "keep KV blocks evicted from the pool (0: none).")
KvFlashDirOption = typer.Option(None, "--kv-flash-dir", help="Builtin engine: a directory "
                                "that keeps evicted KV blocks on flash, across restarts.")
KvFlashGbOption = typer.Option(8.0, "--kv-flash-gb", help="Builtin engine: most GiB the "
                               "--kv-flash-dir tier holds (least recently used go first).")
PrefixCachingOption = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                   help="Builtin engine: reuse the KV of prompt prefixes "
                                   "computed before (the KV tiers need it).")


KvPrefaultOption = typer.Option(False, "--kv-prefault/--no-kv-prefault",
                                help="Builtin engine on CPU: back the whole KV pool with memory "
                                "at start, so the first requests run at steady-state speed "
                                "(a long-running factory wants this); costs start time and "
                                "the pool's size in resident memory from the start.")


def _kv_options(cache_gb: float | None, host_gb: float, flash_dir: str | None,
                flash_gb: float, prefix_caching: bool, kv_dtype: str,
                prefault: bool) -> KvOptions:
    from minimill.fleet.kv_options import KvOptions

    kv = KvOptions(cache_gb, host_gb, flash_dir, flash_gb, prefix_caching, kv_dtype, prefault)
    try:
        kv.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return kv


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    db: str | None = DbOption,
    workers: int = typer.Option(1, min=1, help="API processes serving the port and the store "
                                "(more than 1 needs --db postgresql://...); the local worker "
                                "and the janitor's ticks stay one."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model the local worker serves."),
    dtype: str = typer.Option("auto", help="Engine dtype of the local worker: " + DTYPE_HELP),
    kv_dtype: str = KvDtypeOption,
    local_worker: bool = typer.Option(True, help="Start one local worker process."),
    price_per_hour: float = typer.Option(
        LOCAL_SITE_USD_PER_HOUR, help="What the local site costs in $/hour (cost only; "
        "tenants are billed by `minimill prices`)."),
    boxes: int = typer.Option(4, min=0, help="Boxes (sandboxes) the local worker holds at "
                              "once; none where bubblewrap isolation is unavailable."),
    insecure_no_sandbox: bool = typer.Option(
        False, "--insecure-no-sandbox", help="Let the local worker run boxes and agents' "
        "harnesses without bubblewrap isolation where it is unavailable."),
    agents: int = typer.Option(8, min=0, envvar="MINIMILL_LOCAL_AGENTS",
                               help="Durable agents (harnesses) the local worker runs at "
                               "once; none where harnesses cannot be sandboxed."),
    box_max_memory_mb: int | None = BoxMaxMemoryOption,
    box_max_processes: int | None = BoxMaxProcessesOption,
    box_max_cpu_s: int | None = BoxMaxCpuOption,
    box_max_exec_s: int | None = BoxMaxExecOption,
    box_max_disk_mb: int | None = BoxMaxDiskOption,
    kv_cache_gb: float | None = KvCacheGbOption,
    kv_host_gb: float = KvHostGbOption,
    kv_flash_dir: str | None = KvFlashDirOption,
    kv_flash_gb: float = KvFlashGbOption,
    prefix_caching: bool = PrefixCachingOption,
    kv_prefault: bool = KvPrefaultOption,
    webhook_allow_private: bool = typer.Option(
        False, "--webhook-allow-private", help="Let webhooks reach loopback, link-local and "
        "private addresses (refused by default; also MINIMILL_WEBHOOK_ALLOW_PRIVATE=1)."),
    tenant_requests_per_minute: int | None = typer.Option(
        None, min=0, help="Every tenant's requests per minute, unless `minimill tenants set` "
        "gives it its own (default: unlimited; also MINIMILL_TENANT_REQUESTS_PER_MINUTE)."),
    tenant_tokens_per_minute: int | None = typer.Option(
        None, min=0, help="Every tenant's tokens per minute (prompt plus max_tokens; "
        "MINIMILL_TENANT_TOKENS_PER_MINUTE)."),
    tenant_max_concurrent_realtime: int | None = typer.Option(
        None, min=0, help="Realtime requests a tenant may have in progress at once "
        "(MINIMILL_TENANT_MAX_CONCURRENT_REALTIME)."),
    tenant_max_boxes: int | None = typer.Option(
        None, min=0, help="Boxes a tenant may keep (MINIMILL_TENANT_MAX_BOXES)."),
    tenant_max_agents: int | None = typer.Option(
        None, min=0, help="Unfinished agents a tenant may have (MINIMILL_TENANT_MAX_AGENTS)."),
    tenant_max_stored_bytes: int | None = typer.Option(
        None, min=0, help="Bytes of files a tenant may keep (MINIMILL_TENANT_MAX_STORED_BYTES)."),
    tenant_share_prefix_cache: bool = typer.Option(
        False, "--tenant-share-prefix-cache", help="Let every tenant's cached prompt prefixes "
        "serve other tenants (off: each tenant's are its own unless `minimill tenants set "
        "NAME --share-prefix-cache`)."),
) -> None:
    """Serve the OpenAI-compatible API (control plane) plus one local worker process."""
    from minimill.serve.run import run_serve

    kv = _kv_options(kv_cache_gb, kv_host_gb, kv_flash_dir, kv_flash_gb, prefix_caching,
                     kv_dtype, kv_prefault)
    # The control plane's settings and the local worker both read the caps from here.
    os.environ.update(box_caps(box_max_memory_mb, box_max_processes, box_max_cpu_s,
                               box_max_exec_s, box_max_disk_mb))
    tenant_defaults = {
        "REQUESTS_PER_MINUTE": tenant_requests_per_minute,
        "TOKENS_PER_MINUTE": tenant_tokens_per_minute,
        "MAX_CONCURRENT_REALTIME": tenant_max_concurrent_realtime,
        "MAX_BOXES": tenant_max_boxes, "MAX_AGENTS": tenant_max_agents,
        "MAX_STORED_BYTES": tenant_max_stored_bytes,
        "SHARE_PREFIX_CACHE": 1 if tenant_share_prefix_cache else None}
    os.environ.update({f"MINIMILL_TENANT_{k}": str(v) for k, v in tenant_defaults.items()
                       if v is not None})
    run_serve(host=host, port=port, db=db, model=model, dtype=dtype, local_worker=local_worker,
              price_per_hour=price_per_hour, kv=kv, boxes=boxes,
              insecure_no_sandbox=insecure_no_sandbox, agents=agents,
              webhook_allow_private=webhook_allow_private, workers=workers)


def worker(
    server: str = typer.Option(..., help="Control plane URL, e.g. http://host:8000."),
    site: str = typer.Option(..., help="This site's name."),
    token: str = typer.Option(..., envvar="MINIMILL_SITE_TOKEN", help="Site token."),
    price_per_hour: float | None = typer.Option(
        None, help="What this site costs in $/hour (default: as the site was registered; "
        "cost only, never what tenants are billed)."),
    chip: str | None = typer.Option(
        None, help="Chip name, for the registry (default: as the site was registered)."),
    engine: str = typer.Option("builtin", help="'builtin', an OpenAI-compatible base URL, "
                               "'none' (a box host serving no tokens), or 'fake:TOKENS_PER_S' "
                               "(a test double for fleet tests: no model, made-up tokens at "
                               "that site rate)."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model to serve."),
    dtype: str = typer.Option("auto", help="Builtin engine dtype: " + DTYPE_HELP),
    kv_dtype: str = KvDtypeOption,
    capacity: int = typer.Option(256, help="Most requests in flight."),
    boxes: int = typer.Option(0, min=0, help="Boxes (sandboxes) this site holds at once."),
    box_dir: Path | None = typer.Option(None, help="Where box workspaces live (default: "
                                        "under the system temp directory); emptied at start."),
    box_snapshot_interval_s: float = typer.Option(
        30.0, min=0.1, help="Snapshot a changed box at most this often (what losing this "
        "site may cost a box)."),
    insecure_no_sandbox: bool = typer.Option(
        False, "--insecure-no-sandbox", help="Run boxes and agents' harnesses without "
        "bubblewrap isolation where it is unavailable (they then see this host's files)."),
    agents: int = typer.Option(0, min=0, help="Durable agents (harnesses) this site runs at "
                               "once, each in a sandboxed process."),
    box_max_memory_mb: int | None = BoxMaxMemoryOption,
    box_max_processes: int | None = BoxMaxProcessesOption,
    box_max_cpu_s: int | None = BoxMaxCpuOption,
    box_max_exec_s: int | None = BoxMaxExecOption,
    box_max_disk_mb: int | None = BoxMaxDiskOption,
    kv_cache_gb: float | None = KvCacheGbOption,
    kv_host_gb: float = KvHostGbOption,
    kv_flash_dir: str | None = KvFlashDirOption,
    kv_flash_gb: float = KvFlashGbOption,
    prefix_caching: bool = PrefixCachingOption,
    kv_prefault: bool = KvPrefaultOption,
    pipeline_stages: int = typer.Option(
        1, "--pipeline-stages", min=1, help="Builtin engine on CPUs: cut the model's layers "
        "into this many stages, each in a process of its own on its own core, microbatches "
        "in flight through them (docs/engine.md)."),
    expert_parallel: int = typer.Option(
        1, "--expert-parallel", min=1, help="Builtin engine on CPUs, mixture-of-experts "
        "models: spread the routed experts over this many processes, each reading only its "
        "share of them; each sequence's attention runs on one of them, and every MoE layer "
        "exchanges tokens with their experts' processes by all_to_all (docs/engine.md)."),
    max_memory_gb: float | None = typer.Option(
        None, "--max-memory-gb", help="Builtin engine: the most each of its processes holds "
        "in weights and KV, in GiB; a model over it is cut into as many pipeline stages as "
        "it takes (--pipeline-stages at least), each reading only its own layers "
        "(docs/engine.md)."),
    stages_listen: str | None = typer.Option(
        None, "--stages-listen", metavar="ADDRESS:PORT", help="Builtin engine: the pipeline's "
        "stages (or expert-parallel ranks) after the first run on other hosts of the site "
        "(`minimill stage --connect ADDRESS:PORT` there); wait for them at this host's "
        "ADDRESS. Off loopback, set MINIMILL_STAGE_SECRET to one secret on every host."),
) -> None:
    """Join a fleet: pull work from the control plane under leases and run it."""
    from minimill.boxes.host_setup import BoxOptions
    from minimill.site.worker import run_worker
    from minimill.transport.box_protocol import DEFAULT_BOX_CAPS, BoxLimits

    kv = _kv_options(kv_cache_gb, kv_host_gb, kv_flash_dir, kv_flash_gb, prefix_caching,
                     kv_dtype, kv_prefault)
    run_worker(server=server, site=site, token=token, price_per_hour=price_per_hour, chip=chip,
               engine=engine, model=model, dtype=dtype, capacity=capacity, kv=kv,
               boxes=BoxOptions(slots=boxes, box_dir=box_dir,
                                insecure_no_sandbox=insecure_no_sandbox,
                                snapshot_interval_s=box_snapshot_interval_s,
                                caps=BoxLimits.model_construct(
                                    memory_mb=box_max_memory_mb or DEFAULT_BOX_CAPS.memory_mb,
                                    max_processes=(box_max_processes
                                                   or DEFAULT_BOX_CAPS.max_processes),
                                    cpu_s=box_max_cpu_s or DEFAULT_BOX_CAPS.cpu_s,
                                    timeout_s=float(box_max_exec_s or DEFAULT_BOX_CAPS.timeout_s),
                                    disk_mb=box_max_disk_mb or DEFAULT_BOX_CAPS.disk_mb)),
               agents=agents, pipeline_stages=pipeline_stages,
               expert_parallel=expert_parallel, max_memory_gb=max_memory_gb,
               stages_listen=stages_listen)


def stage(
    connect: str = typer.Option(..., "--connect", metavar="ADDRESS:PORT", help="Where the "
                                "site's first stage waits for its stages (its worker's "
                                "--stages-listen)."),
    model: str | None = typer.Option(None, help="The model on this host, by name or path "
                                     "(default: as the first stage names it); it must be "
                                     "the same model."),
    threads: int | None = typer.Option(None, min=1, help="CPU threads for this stage "
                                       "(default: every core of this host)."),
    once: bool = typer.Option(False, "--once", help="Leave when the first pipeline ends, "
                              "instead of waiting for the next first stage (a restarted "
                              "worker) at the same address."),
) -> None:
    """Run one pipeline stage of a site whose first stage is on another host (`worker
    --pipeline-stages N --stages-listen ADDRESS:PORT`): it loads only its own layers and
    runs every microbatch through them. Off loopback, MINIMILL_STAGE_SECRET must be the
    worker's."""
    import logging
    import sys

    from minimill.engine.params import InvalidRequestError
    from minimill.engine.stage_session import serve_stages

    logging.basicConfig(level=os.environ.get("MINIMILL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s stage %(levelname)s %(message)s", stream=sys.stderr)
    try:
        raise SystemExit(serve_stages(connect, model, threads, once))
    except InvalidRequestError as exc:
        raise typer.BadParameter(str(exc), param_hint="--connect") from None
