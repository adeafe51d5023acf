"""A CPU stand-in for the ``sgl_kernel`` ops SGLang 0.5.23's CPU engine imports, for the tests.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few ``*_cpu`` ops from its kernel package at
module load, unguarded; PyPI has no CPU build of that package. Every fused CPU kernel SGLang
*calls* in our runs is behind ``cpu_has_amx_support()`` (False on a CPU without AMX), so only two
ops run: writing a batch's KV slots into the request-to-token table, and copying KV rows between
slots. They are written here in plain torch and ctypes. The speculative-decoding ops exist so
their modules import; calling one raises. Any other name is an AttributeError, so nothing is
faked silently. SGLang itself is not modified.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+kvxfer-tests"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: ``req_to_token[row_i, start_i:end_i]`` takes the next
    ``end_i - start_i`` slots of ``out_cache_loc`` (requests in order, as SGLang's triton
    kernel ``assign_req_to_token_pool`` lays them out)."""
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = max(0, end - start)
        if n:
            req_to_token[row, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer (base address, bytes per slot), slot ``tgt_loc[i]`` takes a copy of
    slot ``src_loc[i]``."""
    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True) if t != s]
    for base, row in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for t, s in pairs:
            ctypes.memmove(base + t * row, base + s * row, row)


def _unavailable(name: str) -> Callable[..., Any]:
    def op(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel stand-in: {name} (speculative decoding) is not here")

    op.__name__ = name
    return op


rotate_input_ids_cpu = _unavailable("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
build_draft_decode_metadata_cpu = _unavailable("build_draft_decode_metadata_cpu")
assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")


def __getattr__(name: str) -> Any:
    raise AttributeError(f"sgl_kernel stand-in has no {name!r}")
