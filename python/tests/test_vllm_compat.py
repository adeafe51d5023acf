"""`kvxfer.vllm_compat` reads vLLM's compatibility factors from an engine config (here a
stand-in with the attributes vLLM's config has), without importing vLLM."""

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer.vllm_compat import NIXL_CONNECTOR_VERSION, compat_factors, compat_json


def config(**sched: Any) -> SimpleNamespace:
    model = SimpleNamespace(
        model="/models/llama",
        dtype="torch.bfloat16",
        get_total_num_kv_heads=lambda: 8,
        get_head_size=lambda: 128,
        get_total_num_hidden_layers=lambda: 32,
    )
    return SimpleNamespace(
        model_config=model,
        scheduler_config=SimpleNamespace(**sched),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=None,
    )


def test_factors_come_from_the_engine_config_as_vllm_reads_them() -> None:
    f = compat_factors(config(disable_hybrid_kv_cache_manager=False), "0.32.0", "CPU_ATTN")
    assert f == {
        "vllm_version": "0.32.0",
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": "/models/llama",
        "dtype": "torch.bfloat16",
        "num_kv_heads": 8,
        "head_size": 128,
        "num_hidden_layers": 32,
        "attn_backend_name": "CPU_ATTN",
        "cache_dtype": "auto",
        "is_hma_enabled": True,
        "speculative_config": None,
        "transfer_mode": "pull",
    }
    off = compat_factors(config(disable_hybrid_kv_cache_manager=True), "0.32.0", "X")
    assert off["is_hma_enabled"] is False


def test_eagle_is_refused_and_other_speculators_hash_as_none() -> None:
    c = config()
    c.speculative_config = SimpleNamespace(use_eagle=lambda: True)
    with pytest.raises(ValueError, match="EAGLE"):
        compat_factors(c, "0.32.0", "CPU_ATTN")
    c.speculative_config = SimpleNamespace(use_eagle=lambda: False)
    assert compat_factors(c, "0.32.0", "CPU_ATTN")["speculative_config"] is None


def test_the_worker_argument_and_a_warning_for_another_vllm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.kvxfer"):
        text = compat_json(config(), "0.33.1", "CPU_ATTN", ["a", "b"], False)
    assert "0.33.1" in caplog.text and "version 14" in caplog.text
    arg = json.loads(text)
    assert arg["enforce_hash"] is False and arg["region_names"] == ["a", "b"]
    assert arg["factors"]["vllm_version"] == "0.33.1"
    assert arg["serve_decodes"] is True
    off = json.loads(compat_json(config(), "0.32.0", "CPU_ATTN", [], True, serve_decodes=False))
    assert off["serve_decodes"] is False
