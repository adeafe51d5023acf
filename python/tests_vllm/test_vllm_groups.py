"""KvxferConnector's reading of vLLM's KV cache groups, on vLLM's own spec classes (no engine):
which groups it moves and which it refuses at start-up, and which blocks of a group a load
reads."""

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvxfer.vllm import CacheGroup, cache_groups, remote_blocks, state_block, window_blocks

BLOCK = 32


def attention(window: int | None = None, block: int = BLOCK, **kw: int) -> FullAttentionSpec:
    common = {"block_size": block, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=window, **kw)


def config(*specs: object, transfer: tuple[bool, ...] | None = None) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{i}.attn", f"model.layers.{i + len(specs)}.attn"],
            spec,  # type: ignore[arg-type]
            enable_kv_transfer=(transfer or (True,) * len(specs))[i],
        )
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_full_and_sliding_window_groups_are_read_in_layer_order() -> None:
    groups = cache_groups(config(attention(), attention(window=64)), BLOCK)
    assert groups == [
        CacheGroup(("model.layers.0.attn", "model.layers.2.attn"), None),
        CacheGroup(("model.layers.1.attn", "model.layers.3.attn"), 64),
    ]
    # A group vLLM does not transfer is not moved.
    only = cache_groups(config(attention(), attention(window=64), transfer=(True, False)), BLOCK)
    assert [g.window for g in only] == [None]


def mamba(mode: str = "none", scratch: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=1024,
        shapes=((3, 288), (8, 32, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
        num_speculative_blocks=scratch,
    )


def test_mamba_groups_move_their_state() -> None:
    groups = cache_groups(config(mamba(), mamba(scratch=2)), BLOCK)
    assert groups == [
        CacheGroup(("model.layers.0.attn", "model.layers.2.attn"), None, state=True),
        CacheGroup(("model.layers.1.attn", "model.layers.3.attn"), None, True, 2),
    ]


def test_mamba_beside_attention_moves_both_groups() -> None:
    groups = cache_groups(config(mamba(), attention()), BLOCK)
    assert [(g.state, g.window) for g in groups] == [(True, None), (False, None)]


def test_a_state_group_moves_its_running_states_block() -> None:
    assert state_block([0, 0, 9], 0) == [9]
    # vLLM's speculative scratch slots follow the running state.
    assert state_block([4, 5, 6], 2) == [4]
    # Before vLLM allocated the scratch slots, the one block is the state.
    assert state_block([7], 2) == [7]
    assert state_block([], 1) == []


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (mamba("align"), "mamba_cache_mode 'align'"),
        (attention(block=16), "16-token blocks, the engine's are 32"),
        (attention(window=64, extra_retained_tokens=3), "retains 3 extra tokens"),
    ],
)
def test_groups_kvxfer_cannot_move_are_refused_naming_why(spec: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        cache_groups(config(attention(), spec), BLOCK)


def test_a_sliding_window_group_reads_only_its_windows_blocks() -> None:
    ids = [0, 0, 11, 12, 13]  # vLLM's null blocks where it freed out-of-window blocks
    assert window_blocks(ids, None, 150, BLOCK) == [11, 12, 13]
    # 150 tokens loaded: token 150's window (64) starts at token 87, in block 2 of 0..4.
    assert window_blocks([1, 2, 3, 4, 5], 64, 150, BLOCK) == [3, 4, 5]
    # 95 loaded: its window starts at token 32: blocks 1 and 2.
    assert window_blocks([1, 2, 3], 64, 95, BLOCK) == [2, 3]
    # 94 loaded: its window starts at token 31: all three.
    assert window_blocks([1, 2, 3], 64, 94, BLOCK) == [1, 2, 3]
    # A prompt shorter than the window reads every block.
    assert window_blocks([7, 8], 64, 40, BLOCK) == [7, 8]


def test_the_prefills_lists_lose_their_last_block_to_end_where_the_decodes_do() -> None:
    assert remote_blocks([[1, 2, 3], [5, 6]], 1) == [[1, 2], [5]]
    assert remote_blocks([1, 2, 3], 1) == [[1, 2]]
    assert remote_blocks([[1, 2]], 0) == [[1, 2]]


def test_a_prefills_null_blocks_are_never_paired() -> None:
    """A stock prefill clips a sliding-window group to its last blocks, null ones (id 0)
    included: 95 tokens, window 64 gives [0, b1, b2]. Paired as they are, the decode would
    read block 0 into the first block of its window; without them the load has one block
    too few and fails, naming the group."""
    assert remote_blocks([[4, 5, 6], [0, 8, 9]], 0) == [[4, 5, 6], [8, 9]]
    assert remote_blocks([[0, 0, 7]], 1) == [[]]
