"""What kvxfer needs to speak vLLM 0.32.0's NixlConnector handshake (connector version 14)
with stock vLLM engines in a mixed fleet: the compatibility factors vLLM hashes, read from
the engine config the same way vLLM's connector reads them, and the regions' layer names.

No vLLM import here: the config is read by attribute, so this is unit-tested with a
stand-in config.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("vllm.kvxfer")

#: The NixlConnector protocol version kvxfer speaks (vLLM 0.32.0's). A stock peer of a
#: vLLM with another version hashes it in, so its hash never matches ours: refused.
NIXL_CONNECTOR_VERSION = 14
#: The vLLM release whose protocol that is.
SPOKEN_VLLM = "0.32.0"


def refuse_speculative(vllm_config: Any) -> None:
    """vLLM hashes the settings of hidden-state speculators (EAGLE, MTP: `use_eagle()`) and
    null for any other speculative method; kvxfer does not move a draft model's state, so
    the former is refused here rather than hashed differently from vLLM."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and spec.use_eagle():
        raise ValueError("EAGLE-style speculative decoding is not supported with stock peers")


def compat_factors(vllm_config: Any, vllm_version: str, attn_backend_name: str) -> dict[str, Any]:
    """The factors of vLLM's `compute_nixl_compatibility_hash`, each read where vLLM's
    connector reads it (see kvxfer-core's `wire::vllm::CompatFactors`)."""
    refuse_speculative(vllm_config)
    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    return {
        "vllm_version": vllm_version,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model.model,
        "dtype": str(model.dtype),
        "num_kv_heads": model.get_total_num_kv_heads(),
        "head_size": model.get_head_size(),
        "num_hidden_layers": model.get_total_num_hidden_layers(),
        "attn_backend_name": attn_backend_name,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "is_hma_enabled": not getattr(sched, "disable_hybrid_kv_cache_manager", False),
        "speculative_config": None,
        "transfer_mode": "pull",
    }


def compat_json(
    vllm_config: Any,
    vllm_version: str,
    attn_backend_name: str,
    region_names: list[str],
    enforce_hash: bool,
    serve_decodes: bool = True,
) -> str:
    """`PullWorker(vllm_compat=...)`: the factors, whether a differing hash is refused, the
    layer name of each region, and whether stock decodes may pull from this engine."""
    if vllm_version != SPOKEN_VLLM:
        log.warning(
            "kvxfer speaks vLLM %s's NixlConnector protocol (version %d); stock peers of this "
            "vLLM %s are paired only if their compatibility hash matches",
            SPOKEN_VLLM,
            NIXL_CONNECTOR_VERSION,
            vllm_version,
        )
    return json.dumps(
        {
            "factors": compat_factors(vllm_config, vllm_version, attn_backend_name),
            "enforce_hash": enforce_hash,
            "region_names": region_names,
            "serve_decodes": serve_decodes,
        }
    )
