"""SGLang's KVArgs as kvxfer.sglang.layout describes them (no SGLang needed)."""

import enum
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.sglang.layout import UnsupportedLayout, describe, flat_indices, state_indices


class StateType(str, enum.Enum):  # the values of SGLang's StateType
    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"


def kv_args(**kw: Any) -> SimpleNamespace:
    """An MHA pool of 3 layers: K buffers at 0x1000.., V buffers at 0x9000.., 10 pages of
    2 tokens x 2 heads x 16 bytes, and two aux buffers."""
    a = SimpleNamespace(
        page_size=2,
        kv_data_ptrs=[0x1000, 0x2000, 0x3000, 0x9000, 0xA000, 0xB000],
        kv_data_lens=[640] * 6,
        kv_item_lens=[64] * 6,
        aux_data_ptrs=[0x50000, 0x60000],
        aux_data_lens=[64 * 8, 512 * 8],
        aux_item_lens=[64, 512],
        state_types=[],
    )
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def mha(a: SimpleNamespace, **kw: Any) -> Any:
    args: dict[str, Any] = dict(is_mla=False, kv_heads=2, total_kv_heads=4, total_layers=3)
    args.update(kw)
    return describe(a, **args)


def test_an_mha_pool_becomes_split_kv_with_k_and_v_interleaved_per_layer() -> None:
    b = mha(kv_args(), first_layer=0, memory="gpu:1")
    assert b.layout == {
        "kind": "split-kv",
        "order": "nhd",
        "dtype": "u8",
        "num_layers": 3,
        "kv_heads": 2,
        "head_dim": 16,
        "tokens_per_block": 2,
        "num_blocks": 10,
        "bases": [0x1000, 0x9000, 0x2000, 0xA000, 0x3000, 0xB000],
        "total_kv_heads": 4,
        "total_layers": 3,
        "first_layer": 0,
        "memory": "gpu:1",
    }
    assert b.aux == [(0x50000, 64, 8), (0x60000, 512, 8)]
    assert (b.state, b.state_kind) == ([], "none")


def test_an_mla_pool_is_one_latent_region_per_layer() -> None:
    a = kv_args(kv_data_ptrs=[0x1000, 0x2000], kv_data_lens=[1152] * 2, kv_item_lens=[576] * 2)
    b = describe(a, is_mla=True, kv_heads=8, total_kv_heads=8, total_layers=2)
    assert (b.layout["kind"], b.layout["bases"], b.layout["num_layers"]) == (
        "mla",
        [0x1000, 0x2000],
        2,
    )
    assert (b.layout["kv_heads"], b.layout["total_kv_heads"], b.layout["head_dim"]) == (1, 1, 288)
    assert b.layout["num_blocks"] == 2


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"kv_data_lens": [650] * 6}, "does not hold items"),
        ({"kv_item_lens": [0] * 6}, "does not hold items"),
        ({"kv_data_ptrs": [1, 2, 3]}, "3 pointers"),
        ({"kv_data_lens": [640] * 5 + [1280]}, "different sizes"),
        (
            {"kv_data_ptrs": [1, 2, 3], "kv_data_lens": [640] * 3, "kv_item_lens": [64] * 3},
            "K and V",
        ),
        ({"kv_item_lens": [66] * 6, "kv_data_lens": [660] * 6}, "heads"),
        ({"num_draft_entries": 2}, "draft"),
        ({"kv_data_ptrs": [], "kv_data_lens": [], "kv_item_lens": []}, "no KV buffers"),
        ({"state_types": [StateType.DSA]}, "one Mamba or SWA"),
        ({"state_types": [StateType.SWA, StateType.MAMBA]}, "one Mamba or SWA"),
    ],
)
def test_buffers_it_cannot_describe_are_refused_with_the_reason(
    change: dict[str, Any], why: str
) -> None:
    with pytest.raises(UnsupportedLayout, match=why):
        mha(kv_args(**change))


@pytest.mark.parametrize(("kind", "name"), [(StateType.MAMBA, "mamba"), (StateType.SWA, "window")])
def test_one_mamba_or_swa_state_is_described(kind: StateType, name: str) -> None:
    a = kv_args(
        state_types=[kind],
        state_data_ptrs=[[0x70000, 0x80000]],
        state_data_lens=[[96, 48]],
        state_item_lens=[[32, 16]],
    )
    b = mha(a)
    assert (b.state, b.state_kind) == ([(0x70000, 32, 3), (0x80000, 16, 3)], name)


def test_indices_become_lists_of_ints() -> None:
    assert flat_indices(np.array([3, 1, 2], dtype=np.int32)) == [3, 1, 2]
    assert flat_indices((5, 6)) == [5, 6]
    assert flat_indices(None) == []
    assert state_indices(None) == [] and state_indices([]) == []
    assert state_indices([None, np.array([4], dtype=np.int64)]) == [4]
    assert state_indices([None]) == []
    with pytest.raises(UnsupportedLayout):
        state_indices([np.array([1]), np.array([2])])
