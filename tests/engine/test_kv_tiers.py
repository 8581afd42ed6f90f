"""KV tiers below the pool: exact round trips, unsound flash files are misses, and a restored
prefix gives the tokens a recompute gives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from minimill.engine.kv_flash import SUFFIX
from minimill.engine.kv_tiers import KvTiers
from minimill.engine.llm import LLM
from minimill.engine.params import SamplingParams
from minimill.models.types import LoadedModel

SHAPE = (3, 2, 2, 64)  # layers, K/V, kv heads, elements: a small block
LAYOUT: dict[str, object] = {"model": "test", "kv_dtype": "bfloat16", "block_shape": list(SHAPE)}
TOKENS = tuple(range(16))


def _block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def _tiers(tmp_path: Path, host_blocks: int = 0, layout: dict[str, object] | None = None,
           dtype: torch.dtype = torch.bfloat16) -> KvTiers:
    nbytes = _block(dtype).numel() * dtype.itemsize
    return KvTiers(layout or LAYOUT, SHAPE, dtype, host_blocks * nbytes, tmp_path / "flash",
                   64 * nbytes)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_host_and_flash_round_trips_are_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    block = _block(torch.float32).mul(40).to(dtype)
    tiers = _tiers(tmp_path, host_blocks=4, dtype=dtype)
    tiers.put(7, TOKENS, block)
    from_host = tiers.fetch(7, TOKENS)
    assert from_host is not None and _bytes(from_host) == _bytes(block)
    tiers.close()
    # A new process: nothing in host RAM, the file is read back.
    again = _tiers(tmp_path, host_blocks=0, dtype=dtype)
    assert 7 in again
    from_flash = again.fetch(7, TOKENS)
    assert from_flash is not None and _bytes(from_flash) == _bytes(block)
    assert again.stats.flash_hits == 1
    assert again.fetch(7, (*TOKENS[:-1], 999)) is None  # other tokens: a miss


def test_host_tier_is_size_bounded_lru(tmp_path: Path) -> None:
    tiers = KvTiers(LAYOUT, SHAPE, torch.bfloat16, 2 * _block(torch.bfloat16).numel() * 2)
    for key in (1, 2, 3):
        tiers.put(key, TOKENS, _block(torch.bfloat16, key))
    assert 1 not in tiers and 2 in tiers and 3 in tiers


def _written(tmp_path: Path) -> Path:
    tiers = _tiers(tmp_path)
    tiers.put(5, TOKENS, _block(torch.bfloat16))
    tiers.close()
    (path,) = (tmp_path / "flash").glob(f"*{SUFFIX}")
    return path


def test_corrupt_file_is_a_miss_and_removed(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    tiers = _tiers(tmp_path)
    assert tiers.fetch(5, TOKENS) is None
    assert tiers.flash is not None and tiers.flash.num_bad_files == 1
    assert not path.exists()


def test_truncated_file_is_a_miss(tmp_path: Path) -> None:
    path = _written(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    assert _tiers(tmp_path).fetch(5, TOKENS) is None


def test_foreign_file_is_a_miss(tmp_path: Path) -> None:
    _written(tmp_path)
    other = {**LAYOUT, "model": "another-model"}
    assert _tiers(tmp_path, layout=other).fetch(5, TOKENS) is None
    # The file was not this layout's: it is gone, and the owner's lookup misses too.
    assert _tiers(tmp_path).fetch(5, TOKENS) is None


def test_flash_tier_is_size_bounded(tmp_path: Path) -> None:
    nbytes = _block(torch.bfloat16).numel() * 2
    tiers = KvTiers(LAYOUT, SHAPE, torch.bfloat16, 0, tmp_path / "flash", 3 * nbytes + 2000)
    for key in range(1, 6):
        tiers.put(key, TOKENS, _block(torch.bfloat16, key))
    tiers.close()
    assert len(list((tmp_path / "flash").glob(f"*{SUFFIX}"))) == 3


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompt(llm: LLM, seed: int, num_tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (num_tokens,), generator=g).tolist()


def test_restore_gives_the_tokens_of_a_recompute(smol_f32: LoadedModel, tmp_path: Path) -> None:
    """A small pool evicts a prompt's blocks; the next request with that prompt loads them from
    host RAM (and, in a new engine, from flash) and generates what a cold engine generates."""
    small = {"dtype": "float32", "num_kv_blocks": 24, "max_model_len": 384}
    cold = LLM(smol_f32, enable_prefix_caching=False, **small)
    prompt = _prompt(cold, 1, 160)  # 10 blocks: 9 reusable (the last token is always computed)
    expected = cold.generate([prompt], GREEDY)[0].output_token_ids

    flash = str(tmp_path / "flash")
    tiered = LLM(smol_f32, kv_host_bytes=64 << 20, kv_flash_dir=flash,
                 kv_flash_bytes=256 << 20, **small)
    assert tiered.generate([prompt], GREEDY)[0].output_token_ids == expected
    for seed in (2, 3):  # these push the first prompt's blocks out of the pool
        tiered.generate([_prompt(tiered, seed, 300)], GREEDY)
    tiers = tiered.engine.tiers
    assert tiers is not None and tiers.stats.saved_blocks >= 9
    out = tiered.generate([prompt], GREEDY)[0]
    assert tiers.stats.host_hits == 9 and tiers.stats.restored_blocks == 9
    assert out.num_cached_tokens == 144
    assert out.output_token_ids == expected
    tiered.close()

    restarted = LLM(smol_f32, kv_host_bytes=0, kv_flash_dir=flash, kv_flash_bytes=256 << 20,
                    **small)
    out = restarted.generate([prompt], GREEDY)[0]
    assert restarted.engine.tiers is not None
    assert restarted.engine.tiers.stats.flash_hits == 9
    assert out.num_cached_tokens == 144 and out.output_token_ids == expected
    restarted.close()


def test_full_blocks_are_written_through_and_a_killed_engines_resume_reloads_them(
        smol_f32: LoadedModel, tmp_path: Path) -> None:
    """With a flash tier every block is written as soon as it is full and computed, prompt and
    generated tokens alike: an engine that never closes (killed) leaves them on flash, and a
    new engine resuming its request (prompt plus the tokens generated so far) reloads that
    context instead of recomputing it, and continues with the tokens of an uninterrupted run."""
    opts = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512}
    prompt = _prompt(LLM(smol_f32, **opts), 4, 40)
    uninterrupted = LLM(smol_f32, enable_prefix_caching=False, **opts).generate(
        [prompt], GREEDY)[0].output_token_ids
    flash = tmp_path / "flash"
    first = LLM(smol_f32, kv_flash_dir=str(flash), kv_flash_bytes=64 << 20, **opts)
    assert first.generate([prompt], GREEDY)[0].output_token_ids == uninterrupted
    tiers = first.engine.tiers
    assert tiers is not None and tiers.flash is not None
    # The computed tokens (the last one sampled is not) fill this many blocks; never closed.
    bs = first.config.block_size
    full_blocks = (len(prompt) + len(uninterrupted) - 1) // bs
    deadline = time.monotonic() + 30
    while len(list(flash.glob(f"*{SUFFIX}"))) < full_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(flash.glob(f"*{SUFFIX}"))) == full_blocks

    resumed_tokens = uninterrupted[:len(uninterrupted) // 2]
    second = LLM(smol_f32, kv_flash_dir=str(flash), kv_flash_bytes=64 << 20, **opts)
    out = second.generate([prompt], GREEDY, resume_token_ids=[resumed_tokens])[0]
    reusable = (len(prompt) + len(resumed_tokens) - 1) // bs
    assert second.engine.tiers is not None
    assert second.engine.tiers.stats.flash_hits == reusable > 0
    assert out.num_cached_tokens == bs * reusable
    assert out.output_token_ids == uninterrupted
    second.close()
