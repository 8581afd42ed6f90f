"""Turns a SchedulerOutput into tensors, runs the model, samples: `execute() -> ModelOutput`.

Owns the device, the weights (through DecoderModel) and the KV cache tensor. Tokens are laid
out decodes first (ordered by context length), then prompt chunks (ordered by chunk length),
so attention groups of similar sizes are contiguous rows of the flat batch.
"""

from __future__ import annotations

import torch

from minimill.engine.attention import SeqSpan, build_metadata
from minimill.engine.config import EngineConfig
from minimill.engine.model import DecoderModel
from minimill.engine.sampler import sample
from minimill.engine.scheduler import ModelOutput, ScheduledSequence, SchedulerOutput
from minimill.models.types import LoadedModel


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        assert config.num_kv_blocks is not None and config.max_model_len is not None
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = loaded.config
        self.model_config = mc
        self.model = DecoderModel(mc, loaded.weights, config.torch_dtype, self.device,
                                  config.max_model_len)
        # [layers, kv_heads, blocks, block_size, K/V, head_dim]; zeros so that masked-out
        # padding never reads NaN from never-written memory.
        self.kv_cache = torch.zeros(
            mc.num_hidden_layers, mc.num_key_value_heads, config.num_kv_blocks,
            config.block_size, 2, mc.head_dim, dtype=config.torch_dtype, device=self.device)
        self._kv_workspace = torch.empty(0, dtype=config.torch_dtype, device=self.device)

    def _workspace(self, numel: int) -> torch.Tensor:
        if self._kv_workspace.numel() < numel:
            # Grow with headroom: contexts get longer one token per step.
            self._kv_workspace = torch.empty(numel + numel // 4, dtype=self.config.torch_dtype,
                                             device=self.device)
        return self._kv_workspace

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Compute the scheduled tokens' KV and sample for sequences that reached their end."""
        entries = output.scheduled
        order = sorted(range(len(entries)), key=lambda i: _layout_key(entries[i]))
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        last_row = [0] * len(entries)
        for i in order:
            e = entries[i]
            start = e.seq.num_computed_tokens
            spans.append(SeqSpan(len(input_ids), e.num_new_tokens, start, e.seq.block_table))
            input_ids.extend(e.seq.token_ids[start:start + e.num_new_tokens])
            positions.extend(range(start, start + e.num_new_tokens))
            last_row[i] = len(input_ids) - 1
        sampling = [e for e in entries if e.sample]
        logits_rows = [last_row[i] for i, e in enumerate(entries) if e.sample]
        mc = self.model_config
        meta = build_metadata(spans, self.config.block_size, mc.num_key_value_heads,
                              mc.num_attention_heads // mc.num_key_value_heads,
                              self.config.torch_dtype, self.device)
        meta.workspace = self._workspace(meta.workspace_numel(mc.num_key_value_heads,
                                                              mc.head_dim))
        dev = self.device
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta, self.kv_cache, torch.tensor(logits_rows, dtype=torch.long, device=dev))
        if not sampling:
            return ModelOutput([], [])
        tokens, logprobs = sample(logits, [e.seq.params for e in sampling],
                                  [e.seq.seed for e in sampling],
                                  [e.seq.num_output_tokens for e in sampling])
        return ModelOutput(tokens, logprobs)


def _layout_key(entry: ScheduledSequence) -> tuple[int, int]:
    if entry.num_new_tokens == 1:
        return (0, entry.seq.num_computed_tokens)
    return (1, entry.num_new_tokens)
