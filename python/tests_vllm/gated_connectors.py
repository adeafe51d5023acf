"""KvxferPushConnector with a gate, loaded by vLLM as the KV connector module of a test
prefill: with `KVXFER_TEST_GATE` naming a file, every forward pass that streams a room holds
its layers after the first until that file exists (60 s at most), so that a test can act
while the prefill's WRITEs into a decode's blocks have begun and more are due."""

import os
import time
from typing import Any

from kvxfer.vllm import KvxferPushConnector

__all__ = ["GatedPushConnector"]


class GatedPushConnector(KvxferPushConnector):
    """KvxferPushConnector, its layer posts after the first held at the gate."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        gate = os.environ.get("KVXFER_TEST_GATE")
        # Only a forward pass that streams a room (not vLLM's warm-up runs).
        if gate and self._jobs and self._layer_index.get(layer_name, 0) >= 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
