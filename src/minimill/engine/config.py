"""Engine settings: one flat dataclass; sizes that depend on the model are derived here."""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass

import torch

from minimill.engine.hardware import auto_dtype
from minimill.engine.kernels import KERNEL_CHOICES
from minimill.engine.params import InvalidRequestError
from minimill.engine.window_pool import WindowLayout
from minimill.models.types import ModelConfig

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# On CPU the KV pool comes out of host RAM, which other processes share: take a modest slice.
_CPU_KV_FRACTION = 0.15
_CPU_KV_MAX_BYTES = 2 << 30
# On an accelerator the KV pool takes most of what is free once the weights are loaded.
_GPU_KV_FRACTION = 0.85
KV_DTYPE_NAMES = ("int8", "int4")


@dataclass(slots=True)
class EngineConfig:
    """Everything the builtin engine can be told; `EngineConfig(model_config=...)` derives sizes."""

    model: str = "smollm2-135m"
    # "auto": what the chip is fast at (hardware.auto_dtype); "float32" for exact comparisons.
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda if available, else cpu
    # "auto": minimill's compiled kernels where they apply, else portable PyTorch (kernels.py).
    kernels: str = "auto"
    # KV cache: "auto" (the model dtype), "int8" (per-token scales, about half the bytes:
    # twice the sequences in the same pool) or "int4" (group-wise, KIVI-style, about 3.5x
    # fewer bytes; kv_int4.py). A float name must be the model dtype.
    kv_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block (int4: always kv_int4.INT4_GROUP)
    max_num_seqs: int = 256  # most requests decoding together
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    kv_cache_memory_bytes: int | None = None  # KV pool size; None: a share of free memory
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes (tests give tiny pools)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # KV tiers under the device pool (kv_tiers.py), used with prefix caching: host RAM, then
    # files under kv_flash_dir, each bounded in bytes (0: no such tier).
    kv_host_bytes: int = 0
    kv_flash_dir: str | None = None
    kv_flash_bytes: int = 0
    num_threads: int | None = None  # CPU threads for torch; None: every core
    pin_threads: bool = True  # CPU: pin the intra-op threads to cores (kernels.py)
    # CPU: back the whole KV pool with memory at start (attention.allocate_kv_cache), so
    # the first requests run at steady-state speed; costs start time and resident memory.
    prefault_kv: bool = False
    # CPU: run a big step as groups of sequences, one group per core (core_split.py).
    split_steps: bool = True
    # CPU, with split_steps: while enough requests run, each core steps its own share of them
    # on its own clock (engine lanes, core.py) instead of waiting for the other every step.
    # MINIMILL_LANES=0 in the environment turns them off by default (serve, worker: measuring).
    lanes: bool = os.environ.get("MINIMILL_LANES", "1") != "0"
    # Pipeline parallelism inside one site (pipeline_runner.py): the decoder layers cut into
    # this many stages, stage 0 in the engine's process, each other in a process of its own.
    pipeline_stages: int = 1
    # Expert parallelism inside one site (expert_parallel.py): a mixture of experts' routed
    # experts spread over this many processes (ranks), rank 0 the engine's; 1: none.
    expert_parallel: int = 1
    # "HOST:PORT": the stages after the first (or the expert-parallel ranks after the first)
    # are not started here but join from other hosts of the site (`minimill stage --connect
    # HOST:PORT`, stage_hosts.py); HOST is this host's address that they reach.
    stages_listen: str | None = None
    # The most each of the engine's processes holds in weights and KV, in GiB (memory_budget.py):
    # the model is cut into as many pipeline stages (pipeline_stages at least) as it takes,
    # each loading only its own weights, its KV pool sized to what the budget leaves.
    max_memory_gb: float | None = None
    # Derived with max_memory_gb: the first layer of each stage after the first (the cut the
    # budget chose; empty: stage_plan.py cuts by cost alone).
    stage_starts: tuple[int, ...] = ()
    dtype_reason: str = ""  # why this dtype (set when dtype was "auto")
    # int4: staging units (kv_int4.INT4_STAGE_UNIT tokens each) per pool block; derived.
    stage_units_per_block: int = 0
    # A model with both sliding-window and full layers keeps a block of its sliding layers
    # only while their window reaches it (window_pool.py); False: every layer's KV for the
    # whole context, as for any other model.
    window_pool: bool = True
    model_config: InitVar[ModelConfig | None] = None

    def __post_init__(self, model_config: ModelConfig | None) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise InvalidRequestError(
                f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype, self.dtype_reason = auto_dtype(torch.device(self.device))
        elif not self.dtype_reason:
            self.dtype_reason = "asked for"
        aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        self.kv_dtype = aliases.get(self.kv_dtype, self.kv_dtype)
        if self.kv_dtype == "auto":
            self.kv_dtype = self.dtype
        if self.kv_dtype not in (*KV_DTYPE_NAMES, self.dtype):
            raise InvalidRequestError(
                f"kv_dtype must be auto, int8, int4 or the model dtype ({self.dtype}), "
                f"got {self.kv_dtype!r}")
        if self.kv_dtype == "int4":
            from minimill.engine.kv_int4 import INT4_GROUP

            # One block is one quantization group (the per-channel K ranges span it).
            self.block_size = INT4_GROUP
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1")
        if self.kv_host_bytes < 0 or self.kv_flash_bytes < 0:
            raise InvalidRequestError("KV tier sizes must be >= 0 bytes")
        if self.max_memory_gb is not None:
            if not self.max_memory_gb > 0:
                raise InvalidRequestError(
                    f"max_memory_gb (--max-memory-gb) must be > 0, got {self.max_memory_gb}")
            if self.kv_cache_memory_bytes is not None:
                raise InvalidRequestError(
                    "give max_memory_gb (--max-memory-gb) or kv_cache_memory_bytes "
                    "(--kv-cache-gb), not both: with a memory budget the KV pool takes what "
                    "the weights leave of it")
        if self.num_threads is None:
            self.num_threads = os.cpu_count() or 1
        self._check_pipeline()
        self._check_expert_parallel()
        if model_config is None:
            return
        self._check_experts_of(model_config)
        if self.pipeline_stages > model_config.num_hidden_layers:
            raise InvalidRequestError(
                f"pipeline_stages {self.pipeline_stages} exceeds the model's "
                f"{model_config.num_hidden_layers} decoder layers")
        if self.kv_dtype == "int4" and model_config.is_mla:
            raise InvalidRequestError(
                f"kv_dtype int4 is not supported for {model_config.architecture}'s latent "
                f"(MLA) cache yet; use int8, {self.dtype} or auto")
        if self.kv_dtype == "int4" and any(model_config.is_sliding(i) for i in
                                           range(model_config.num_hidden_layers)):
            raise InvalidRequestError(
                "kv_dtype int4 does not support sliding-window layers yet; use int8, "
                f"{self.dtype} or auto for {model_config.architecture}")
        if self.max_model_len is None:
            self.max_model_len = model_config.max_position_embeddings
        # int4 stages open blocks in slices of pool blocks (kv_int4.py): the whole budget is
        # blocks, and a sequence alone needs those of a whole open block's units besides its
        # full blocks.
        min_blocks = 1
        if self.kv_dtype == "int4":
            from minimill.engine.kv_int4 import stage_blocks_per_sequence, stage_units_per_block

            self.stage_units_per_block = stage_units_per_block(model_config.head_dim)
            min_blocks += stage_blocks_per_sequence(model_config.head_dim)
        # Every running request must be able to decode in the same step.
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs)
        if self.num_kv_blocks is None:
            budget = self.kv_cache_memory_bytes or self.default_kv_bytes()
            self.num_kv_blocks = max(min_blocks, budget // self.kv_block_bytes(model_config))
        if self.num_kv_blocks < min_blocks:
            raise InvalidRequestError(
                f"num_kv_blocks must be at least {min_blocks} for kv_dtype {self.kv_dtype}")
        # One request alone must always fit, or preemption could never make room for it (its
        # last token's KV is never computed; int4: its open block's staging takes blocks too).
        max_blocks = self.num_kv_blocks - min_blocks + 1
        layout = self.window_layout(model_config)
        if layout is not None:
            # A window block takes a pool block per sliding group: a long request holds its
            # full layers' blocks and at most chunk_bound window blocks; a short one, as
            # many window blocks as full ones.
            from minimill.engine.window_pool import chunk_bound

            groups = layout.window_groups
            bound = chunk_bound(layout.window, self.max_num_batched_tokens, self.block_size)
            long = self.num_kv_blocks - groups * bound
            max_blocks = long if long >= bound else self.num_kv_blocks // (1 + groups)
        self.max_model_len = min(self.max_model_len, max(1, max_blocks) * self.block_size)

    def window_layout(self, model_config: ModelConfig) -> WindowLayout | None:
        """How the pool lays out a model with sliding-window and full layers
        (window_pool.py), or None: one group of every layer."""
        if not self.window_pool or self.kv_dtype == "int4" or self.pipeline_stages > 1:
            return None  # (a pipeline stage's pool holds its own layers, every one)
        return WindowLayout.of(model_config)

    def layer_block_bytes(self, model_config: ModelConfig) -> int:
        """Bytes of one KV block of one layer (K and V, values and scales)."""
        from minimill.engine.attention import block_elems

        dtype = self.kv_torch_dtype
        parts, heads, dim = model_config.kv_layout
        return parts * heads * block_elems(self.block_size, dim, dtype) * dtype.itemsize

    def pool_layers(self, model_config: ModelConfig) -> int:
        """Layers a pool block holds: every layer, or one group's (window_pool.py)."""
        layout = self.window_layout(model_config)
        return model_config.num_hidden_layers if layout is None else layout.group_layers

    def _check_pipeline(self) -> None:
        """Refuse what pipeline stages do not run yet, naming it."""
        if self.pipeline_stages < 1:
            raise InvalidRequestError("pipeline_stages must be at least 1")
        if self.stages_listen is not None and self.pipeline_stages == 1 and (
                self.max_memory_gb is None and self.expert_parallel == 1):
            raise InvalidRequestError(
                "stages_listen (--stages-listen) waits for pipeline stages or expert-parallel "
                "ranks from other hosts: give pipeline_stages (--pipeline-stages) or "
                "expert_parallel (--expert-parallel) of 2 or more")
        if self.pipeline_stages == 1:
            return
        unsupported = [what for what, used in (
            ("KV tiers (kv_host_bytes, kv_flash_dir)",
             bool(self.kv_host_bytes or self.kv_flash_dir)),
            (f"device {self.device} (stages run on CPUs, over gloo)", self.device != "cpu"),
        ) if used]
        if unsupported:
            raise InvalidRequestError(
                f"pipeline_stages > 1 does not support {'; '.join(unsupported)} yet")

    def _check_expert_parallel(self) -> None:
        """Refuse what expert parallelism does not run yet, naming it."""
        if self.expert_parallel < 1:
            raise InvalidRequestError(
                f"expert_parallel (--expert-parallel) must be at least 1, got "
                f"{self.expert_parallel}")
        if self.expert_parallel == 1:
            return
        unsupported = [what for what, used in (
            ("pipeline_stages > 1 (--pipeline-stages)", self.pipeline_stages > 1),
            ("max_memory_gb (--max-memory-gb)", self.max_memory_gb is not None),
            ("kv_dtype int4", self.kv_dtype == "int4"),
            ("KV tiers (kv_host_bytes, kv_flash_dir)",
             bool(self.kv_host_bytes or self.kv_flash_dir)),
            (f"device {self.device} (ranks run on CPUs, over gloo)", self.device != "cpu"),
        ) if used]
        if unsupported:
            raise InvalidRequestError(
                f"expert_parallel (--expert-parallel) > 1 does not support "
                f"{'; '.join(unsupported)} yet")

    def _check_experts_of(self, model_config: ModelConfig) -> None:
        """Expert parallelism needs routed experts to spread, one tensor each."""
        n = self.expert_parallel
        if n == 1:
            return
        if model_config.num_experts == 0:
            raise InvalidRequestError(
                f"expert_parallel (--expert-parallel) {n} needs a mixture of experts; "
                f"{model_config.architecture} is a dense model")
        if n > model_config.num_experts:
            raise InvalidRequestError(
                f"expert_parallel (--expert-parallel) {n} exceeds the model's "
                f"{model_config.num_experts} routed experts")
        if model_config.expert_style == "gpt_oss":
            raise InvalidRequestError(
                "expert_parallel (--expert-parallel) > 1 does not support gpt-oss's experts "
                "(stored as one tensor for all of a layer's experts) yet")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        if self.kv_dtype == "int8":
            return torch.int8
        if self.kv_dtype == "int4":
            return torch.uint8  # two 4-bit values per byte, with float16 ranges
        return DTYPES[self.kv_dtype]

    def kv_block_bytes(self, model_config: ModelConfig) -> int:
        """Bytes of one KV pool block (K and V, values and scales) across the layers it holds:
        every layer's, or one group's (window_pool.py)."""
        return self.pool_layers(model_config) * self.layer_block_bytes(model_config)

    def kv_bytes_per_token(self, model_config: ModelConfig) -> float:
        """Bytes per token of full blocks (int4: sealed; an open block's staging takes one unit
        per INT4_STAGE_UNIT tokens, kv_stage_unit_bytes)."""
        return self.kv_block_bytes(model_config) / self.block_size

    def kv_stage_unit_bytes(self, model_config: ModelConfig) -> int:
        """Bytes of one int4 staging unit (INT4_STAGE_UNIT tokens in int8) across all layers;
        stage_units_per_block of them share one pool block. 0 unless kv_dtype is int4."""
        if self.kv_dtype != "int4":
            return 0
        from minimill.engine.kv_int4 import stage_elems

        return (model_config.num_hidden_layers * 2 * model_config.num_key_value_heads
                * stage_elems(model_config.head_dim))

    def default_kv_bytes(self) -> int:
        """The KV pool's size when none is given: a share of free memory."""
        if self.device.startswith("cuda") and torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(torch.device(self.device))
            return int(free * _GPU_KV_FRACTION)
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 8 << 30
        return int(min(_CPU_KV_MAX_BYTES, total * _CPU_KV_FRACTION))
