"""Which blocks of each KV cache group a push room moves (kvxfer.vllm_groups), without
vLLM."""

import pytest

from kvxfer.vllm_groups import decode_pages, prefill_pages, state_page


def test_the_decode_names_each_groups_blocks_past_its_prefix_without_nulls() -> None:
    # The first block's tokens are cached here; blocks up to position 3 are loaded (a fifth
    # is allocated past them). Group 0 (full attention) takes positions 1-3; group 1 (a
    # window) freed its first two blocks (null) and takes positions 2-3.
    pages, counts = decode_pages([[11, 12, 13, 14, 15], [0, 0, 22, 23, 24]], 1, 4)
    assert (pages, counts) == ([12, 13, 14, 22, 23], [3, 2])
    with pytest.raises(ValueError, match="group 1: 2 blocks, the prompt needs 4"):
        decode_pages([[1, 2, 3, 4], [5, 6]], 0, 4)
    with pytest.raises(ValueError, match="a null block among"):
        decode_pages([[1, 2, 3], [5, 0, 6]], 0, 3)


def test_the_prefill_writes_its_blocks_at_the_decodes_positions() -> None:
    groups = [[1, 2, 3, 4], [0, 6, 7, 8]]
    # Every block of group 0, the window's last two of group 1, ending at block 4.
    assert prefill_pages(groups, [4, 2], 4) == [1, 2, 3, 4, 7, 8]
    # A decode that holds a prefix: the last blocks before `end`, not the first held ones.
    assert prefill_pages(groups, [2, 1], 3) == [2, 3, 7]
    with pytest.raises(ValueError, match="which this prefill freed"):
        prefill_pages(groups, [4, 4], 4)
    with pytest.raises(ValueError, match="names 1 KV cache groups, this engine has 2"):
        prefill_pages(groups, [4], 4)
    with pytest.raises(ValueError, match="ending at block 5"):
        prefill_pages(groups, [1, 1], 5)


def test_a_state_group_moves_its_state_page_whatever_its_position() -> None:
    # Group 0 holds Mamba state: its page is the last block before one speculative slot.
    assert state_page([0, 0, 7, 8], 1) == [7]
    assert state_page([0, 7], 0) == [7]
    assert state_page([0, 0], 0) == []
    groups = [[0, 0, 31, 32], [11, 12, 13]]
    pages, counts = decode_pages(groups, 0, 3, scratch=[1, None])
    assert (pages, counts) == ([31, 11, 12, 13], [1, 3])
    assert prefill_pages([[0, 41], [1, 2, 3]], counts, 3, scratch=[0, None]) == [41, 1, 2, 3]
    with pytest.raises(ValueError, match="no state page"):
        decode_pages([[0, 0], [1, 2]], 0, 2, scratch=[0, None])
    with pytest.raises(ValueError, match="takes 2 state pages"):
        prefill_pages([[0, 41], [1, 2, 3]], [2, 3], 3, scratch=[0, None])
