"""kvxfer's reading of vLLM's KV cache tensors, on the views vLLM itself builds for each
layout (no engine): how `describe_cache` names them, and a transfer between two workers
through that description landing each block exactly where vLLM's views put it.

vLLM's CPU attention runs only LBHNC, so a real CPU engine never offers the cross-layer
layouts (BLHNC, BLNHC): this is where they are checked against vLLM's own stride code."""

import json
import time
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import kvxfer
from kvxfer.vllm import describe_cache

LAYERS, BLOCKS, HEADS, HEAD, TOKENS = 3, 6, 2, 32, 16


def vllm_views(layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """Per-layer views of one allocation, made the way vLLM's KV cache config and model
    runner make them: block-outermost layouts step over every layer's page per block."""
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    page = spec.page_size_bytes
    block_stride = page * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, LAYERS, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=page * LAYERS * BLOCKS,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=0,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
    return dict(zip(names, views, strict=True))


def worker(role: str, desc: dict[str, Any], heads: int = HEADS) -> kvxfer.PullWorker:
    return kvxfer.PullWorker(
        f"{role}-0",
        "loopback",
        dict(desc, total_kv_heads=heads, total_layers=LAYERS),
        engine_id=role,
        tp_rank=0,
        tp_size=1,
        options='{"side_channel_port": 0}',
    )


def finish(w: kvxfer.PullWorker, req: str, side: int) -> list[Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        f = w.get_finished()
        if req in f[side]:
            return list(f[2])
        time.sleep(0.002)
    raise AssertionError(f"{req} never finished")


def move_and_check(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    src_desc: dict[str, Any],
    dst_desc: dict[str, Any],
    heads: int,
) -> None:
    """Moves blocks 4 and 1 of `src` into blocks 0 and 5 of `dst` through a prefill and a
    decode worker made from the descriptions; checks that exactly those blocks landed."""
    p = worker("P", src_desc, heads)
    d = worker("D", dst_desc, heads)
    remote, local = [4, 1], [0, 5]
    port = p.listener_port()
    assert port
    psched = kvxfer.PullScheduler("P", "127.0.0.1", port)
    _, params = psched.request_finished("r", json.dumps({"do_remote_decode": True}), True, remote)
    assert params is not None
    p.start_load_kv(psched.build_step_meta())
    dsched = kvxfer.PullScheduler("D", "127.0.0.1", 0)
    dsched.after_alloc("r", params, local, 2 * TOKENS)
    d.start_load_kv(dsched.build_step_meta())
    assert finish(d, "r", 1) == []
    for name in src:
        s, t = src[name], dst[name]
        for rb, lb in zip(remote, local, strict=True):
            assert torch.equal(t[lb], s[rb]), f"{name}: block {rb} -> {lb}"
        for b in set(range(BLOCKS)) - set(local):
            assert not t[b].any(), f"{name}: block {b} was written"
    finish(p, "r", 0)
    d.shutdown()
    p.shutdown()


@pytest.mark.parametrize(
    ("layout", "kind", "order"),
    [
        (KVCacheLayout.BLHNC, "cross-layer", "HND"),
        (KVCacheLayout.BLNHC, "cross-layer", "NHD"),
        (KVCacheLayout.LBHNC, "packed-kv", "HND"),
    ],
)
def test_vllm_layouts_are_described_and_moved_exactly(
    layout: KVCacheLayout, kind: str, order: str
) -> None:
    src, dst = vllm_views(layout), vllm_views(layout)
    desc = describe_cache(src, HEADS, HEAD, TOKENS)
    assert (desc["kind"], desc["order"]) == (kind, order)
    assert len(desc["bases"]) == (1 if kind == "cross-layer" else LAYERS)
    # Every element distinct across layers, written through vLLM's own views.
    for layer, v in enumerate(src.values()):
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) + layer * 1e6)
    move_and_check(src, dst, desc, describe_cache(dst, HEADS, HEAD, TOKENS), HEADS)


def test_a_cross_layer_cache_in_another_layer_order_is_refused() -> None:
    views = vllm_views(KVCacheLayout.BLHNC)
    names = list(views)
    swapped = {names[0]: views[names[1]], names[1]: views[names[0]], names[2]: views[names[2]]}
    with pytest.raises(ValueError, match="cross-layer page"):
        describe_cache(swapped, HEADS, HEAD, TOKENS)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "name"),
    [("auto", "float32"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_an_fp8_cache_is_named_by_its_format_not_its_uint8_tensors(
    kv_cache_dtype: str, name: str
) -> None:
    views = vllm_views(KVCacheLayout.LBHNC)
    if kv_cache_dtype != "auto":
        # vLLM's fp8 caches are uint8 tensors, the layout otherwise the same.
        views = {n: v.view(torch.uint8).reshape(*v.shape[:-1], -1) for n, v in views.items()}
        head = HEAD * 4  # a float32 element is 4 fp8 elements
    else:
        head = HEAD
    assert describe_cache(views, HEADS, head, TOKENS, kv_cache_dtype)["dtype"] == name


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_per_token_head", "nvfp4", "turboquant_k8v4"])
def test_a_cache_whose_bytes_hold_more_than_elements_is_refused_by_name(
    kv_cache_dtype: str,
) -> None:
    views = vllm_views(KVCacheLayout.LBHNC)
    views = {n: v.view(torch.uint8).reshape(*v.shape[:-1], -1) for n, v in views.items()}
    with pytest.raises(ValueError, match=f"kv_cache_dtype '{kv_cache_dtype}'.*not supported"):
        describe_cache(views, HEADS, HEAD * 4, TOKENS, kv_cache_dtype)


def mla_views(shape_of_block: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Per-layer MLA caches as vLLM allocates them: `[blocks, *shape_of_block]`."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, *shape_of_block)
        for i in range(LAYERS)
    }


@pytest.mark.parametrize("block", [(TOKENS, 576), (1, TOKENS, 576)])
def test_an_mla_cache_is_one_latent_region_per_layer(block: tuple[int, ...]) -> None:
    """vLLM's GPU MLA backends allocate `[blocks, tokens, latent]`, its CPU one with a head
    dimension of 1 between: both are the same bytes."""
    src, dst = mla_views(block), mla_views(block)
    desc = describe_cache(src, 1, 576, TOKENS, mla=True)
    assert (desc["kind"], desc["kv_heads"], desc["head_dim"]) == ("mla", 1, 576)
    assert desc["bases"] == [v.data_ptr() for v in src.values()]
    for layer, v in enumerate(src.values()):
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) + layer * 1e6)
    move_and_check(src, dst, desc, describe_cache(dst, 1, 576, TOKENS, mla=True), 1)


def test_an_mla_cache_of_another_latent_width_is_refused() -> None:
    with pytest.raises(ValueError, match="expected an MLA cache"):
        describe_cache(mla_views((TOKENS, 512)), 1, 576, TOKENS, mla=True)


@pytest.mark.parametrize(
    "view",
    [
        lambda: torch.zeros(BLOCKS, 576, TOKENS).transpose(1, 2),  # latents across tokens
        lambda: torch.zeros(BLOCKS, TOKENS + 1, 576)[:, :TOKENS],  # blocks with a gap after
    ],
)
def test_an_mla_cache_whose_blocks_are_not_back_to_back_latents_is_refused(view: Any) -> None:
    views = {f"model.layers.{i}.self_attn.attn": view() for i in range(LAYERS)}
    with pytest.raises(ValueError, match="contiguous"):
        describe_cache(views, 1, 576, TOKENS, mla=True)


def test_an_fp8_setting_over_wider_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' \\(float32 tensors\\)"):
        describe_cache(vllm_views(KVCacheLayout.LBHNC), HEADS, HEAD, TOKENS, "fp8")
