"""Type stubs of the Rust extension module."""

from typing import Any, Literal

__version__: str

def connector_options(extra_json: str, flow: str) -> str:
    """``kv_connector_extra_config`` (JSON text) as the vLLM connector of ``flow`` (``"pull"``
    or ``"push"``) reads it: every option, defaults filled in, as JSON text; raises
    InvalidArgumentError naming an unknown key or a bad value."""

def ucx_version() -> str:
    """The version of the UCX library the ``ucx`` transport uses in this process, loading it
    (``$KVXFER_UCX_LIBRARY``, else the system's ``libucp.so.0``); raises NotAvailableError."""

def sglang_nixl_registration(
    endpoint: tuple[str, int],
    agent: str,
    metadata: bytes,
    kv_ptrs: list[int],
    kv_item_lens: list[int],
    num_slots: int,
    kv_mem_kind: str,
    aux_ptrs: list[int],
    *,
    gpu_id: int,
    tp: tuple[int, int],
    state_ptrs: list[int] = ...,
    state_item_lens: list[int] = ...,
    state_data_lens: list[int] = ...,
) -> list[bytes]:
    """A decode rank's registration with a stock SGLang nixl prefill rank (SGLang's frames)."""

def sglang_nixl_room(
    room: int,
    endpoint: tuple[str, int],
    agent: str,
    pages: list[int],
    aux_index: int | None,
    required: int,
    state: list[int] = ...,
    prefix_tokens: int = 0,
) -> list[bytes]:
    """A room's destination for a stock SGLang nixl prefill rank (SGLang's frames)."""

def sglang_nixl_abort(room: int, endpoint: tuple[str, int], generation: int) -> list[bytes]:
    """A decode's abort of a room, for a stock SGLang nixl prefill rank."""

def sglang_nixl_from_prefill(
    frames: list[bytes],
) -> tuple[Literal["status"], int, int, int, str] | tuple[Literal["ack"], int, int, int | None]:
    """A stock SGLang nixl prefill rank's ``KV_STATUS`` or ``ABORT_ACK``, decoded."""

class KvxferError(Exception): ...
class NotAvailableError(KvxferError): ...
class NotSupportedError(KvxferError): ...
class OutOfBoundsError(KvxferError): ...
class InvalidMemoryError(KvxferError): ...
class InvalidMetadataError(KvxferError): ...
class UnknownPeerError(KvxferError): ...
class PeerGoneError(KvxferError): ...
class InvalidArgumentError(KvxferError): ...
class TransferFailedError(KvxferError): ...
class TransferTimeoutError(KvxferError): ...
class BackendError(KvxferError): ...
class ShutDownError(KvxferError): ...
class LayoutError(KvxferError): ...
class SideChannelError(KvxferError): ...
class DiscoveryError(KvxferError): ...

Range = tuple[int, int]

class SharedHostMemory:
    def __init__(self, nbytes: int) -> None: ...
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

class Agent:
    def __init__(self, name: str, transport: str = "loopback") -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def transport(self) -> str: ...
    def capabilities(self) -> dict[str, Any]: ...
    def register(self, obj: Any, length: int | None = None, memory: str = "host") -> int: ...
    def deregister(self, handle: int) -> None: ...
    def metadata(self) -> bytes: ...
    def load_peer(self, metadata: bytes) -> int: ...
    def remove_peer(self, peer: int) -> None: ...
    def prepare_local(self, ranges_: list[Range], memory: str = "host") -> int: ...
    def prepare_remote(self, peer: int, ranges_: list[Range], memory: str = "host") -> int: ...
    def release_list(self, list: int) -> None: ...
    def read(
        self,
        peer: int,
        local: list[Range],
        remote: list[Range],
        notification: bytes | None = None,
        memory: str = "host",
    ) -> int: ...
    def write(
        self,
        peer: int,
        local: list[Range],
        remote: list[Range],
        notification: bytes | None = None,
        memory: str = "host",
    ) -> int: ...
    def read_indexed(
        self,
        local: int,
        local_idx: list[int],
        remote: int,
        remote_idx: list[int],
        notification: bytes | None = None,
    ) -> int: ...
    def write_indexed(
        self,
        local: int,
        local_idx: list[int],
        remote: int,
        remote_idx: list[int],
        notification: bytes | None = None,
    ) -> int: ...
    def status(self, xfer: int) -> Literal["in_progress", "done"]: ...
    def wait(self, xfer: int, timeout: float = 30.0) -> None: ...
    def release(self, xfer: int) -> None: ...
    def notify(self, peer: int, message: bytes) -> None: ...
    def notifications(self) -> list[tuple[str, bytes]]: ...
    def shutdown(self) -> None: ...

class PullScheduler:
    def __init__(self, engine_id: str, host: str, port: int, tp_size: int = 1) -> None: ...
    def tokens_to_load(
        self,
        req_id: str,
        params_json: str | None,
        prompt_len: int,
        num_computed_tokens: int,
    ) -> tuple[int, bool]: ...
    def after_alloc(
        self,
        req_id: str,
        params_json: str,
        uncomputed_blocks: list[int] | list[list[int]],
        num_external_tokens: int,
        load_end: int | None = None,
        content: int | None = None,
    ) -> str: ...
    def refuse_load(
        self, req_id: str, uncomputed_blocks: list[int] | list[list[int]], reason: str
    ) -> None: ...
    def build_step_meta(self) -> str: ...
    def request_finished(
        self,
        req_id: str,
        params_json: str | None,
        length_capped: bool,
        block_ids: list[int] | list[list[int]],
        content: int | None = None,
    ) -> tuple[bool, str | None]: ...

FailedLoad = tuple[str, list[int], str, Literal["fail", "recompute"]]

class PullWorker:
    """One TP rank's worker. Settings left ``None`` keep kvxfer-core's defaults (side channel
    ``127.0.0.1:5600``, lease 30 s, transfer timeout 30 s, handshake timeout 5 s)."""

    def __init__(
        self,
        agent_name: str,
        transport: str,
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        kind: str,
        order: str,
        dtype: str,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        num_blocks: int,
        bases: list[int] | list[Any],
        total_kv_heads: int,
        total_layers: int,
        first_layer: int = 0,
        memory: str = "host",
        side_channel_host: str | None = None,
        side_channel_port: int | None = None,
        dp_rank_local: int = 0,
        backend_name: str = "kvxfer",
        lease: float | None = None,
        heartbeat_interval: float | None = None,
        transfer_timeout: float | None = None,
        handshake_timeout: float | None = None,
        failure_policy: Literal["fail", "recompute"] = "fail",
        enforce_compat: bool = True,
        prepared_lists: bool = True,
        vllm_compat: str | None = None,
        groups: list[list[int]] | None = None,
        state_groups: list[int] | None = None,
        digest: bool = False,
    ) -> None: ...
    def listener_port(self) -> int | None: ...
    def instance(self) -> int: ...
    def layout_digest(self) -> str: ...
    def engine_lost(self, engine_id: str, reason: str) -> None: ...
    def start_load_kv(self, meta_json: str) -> list[str]: ...
    def get_finished(self, wait: float = 0.0) -> tuple[list[str], list[str], list[FailedLoad]]: ...
    def take_metrics(self) -> dict[str, float]: ...
    def shutdown(self) -> None: ...

Buffers = list[tuple[Any, int, int]]
"""``(base, item_len, items)`` per aux or state buffer: ``base`` an address, or an object
with ``data_ptr()`` or ``__array_interface__`` (a tensor, an array), which is then kept
alive as long as the rank that registered it."""

class PushRegistry:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None: ...
    @property
    def port(self) -> int: ...
    @property
    def instance(self) -> int: ...
    def shutdown(self) -> None: ...

class PushPrefill:
    def __init__(
        self,
        agent_name: str,
        transport: str,
        layout: dict[str, Any],
        *,
        registry: tuple[str, int],
        tp_rank: int,
        tp_size: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        aux: Buffers = ...,
        state: Buffers = ...,
        state_kind: Literal["none", "mamba", "window"] = "none",
        host: str = "127.0.0.1",
        port: int = 0,
        bootstrap_timeout: float = 300.0,
        request_timeout: float = 2.0,
        idle_decode_timeout: float = 600.0,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def register(
        self,
        url: str,
        cluster: str,
        engine_id: str,
        bootstrap: tuple[str, int],
        instance: int,
        ttl: float = 10.0,
    ) -> Registration: ...
    def add_room(
        self,
        room: int,
        total_pages: int,
        aux_index: int | None = None,
        state_indices: list[int] = ...,
    ) -> None: ...
    def destinations_ready(self, room: int) -> bool: ...
    def decode_prefix(self, room: int) -> int | None: ...
    def decode_group_pages(self, room: int) -> list[int] | None: ...
    def send(self, room: int, pages: list[int], state_indices: list[int] | None = None) -> None: ...
    def send_layers(
        self, room: int, pages: list[int], first_layer: int, num_layers: int, completes: bool
    ) -> None: ...
    def status(self, room: int) -> int | None: ...
    def error(self, room: int) -> str | None: ...
    def abort(self, room: int) -> None: ...
    def remove_room(self, room: int) -> None: ...
    def poll(self) -> None: ...
    def refused(self) -> int: ...
    def stock_message(self, frames: list[bytes]) -> None: ...
    def take_stock_outbox(self) -> list[tuple[str, int, list[bytes]]]: ...
    def take_metrics(self) -> dict[str, float]: ...
    def shutdown(self) -> None: ...

class PushDecode:
    def __init__(
        self,
        agent_name: str,
        transport: str,
        layout: dict[str, Any],
        *,
        tp_rank: int,
        tp_size: int,
        aux: Buffers = ...,
        state: Buffers = ...,
        state_kind: Literal["none", "mamba", "window"] = "none",
        waiting_timeout: float = 300.0,
        bootstrap_timeout: float = 30.0,
        heartbeat_interval: float = 5.0,
        max_heartbeat_failures: int = 2,
        request_timeout: float = 2.0,
        discovery: tuple[str, str] | None = None,
        digest: bool = False,
    ) -> None: ...
    def add_room(
        self,
        room: int,
        registry: tuple[str, int],
        pages: list[int],
        aux_index: int | None = None,
        state_indices: list[int] = ...,
        prefix_tokens: int = 0,
        group_pages: list[int] | None = None,
    ) -> None: ...
    def status(self, room: int) -> int | None: ...
    def error(self, room: int) -> str | None: ...
    def abort(self, room: int) -> None: ...
    def remove_room(self, room: int) -> None: ...
    def drained(self, room: int) -> bool: ...
    def forget(self, room: int) -> None: ...
    def undrained(self) -> int: ...
    def take_metrics(self) -> dict[str, float]: ...
    def poll(self) -> None: ...
    def native_metadata(self) -> bytes: ...
    def unknown_notifications(self) -> int: ...
    def shutdown(self) -> None: ...

class Registration:
    def __init__(
        self,
        url: str,
        cluster: str,
        role: Literal["prefill", "decode"],
        engine_id: str,
        rank: tuple[int, int, int],
        world: tuple[int, int, int],
        endpoint: str,
        instance: int,
        layout: str,
        ttl: float = 10.0,
    ) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...

class FleetWatch:
    def __init__(
        self, url: str, cluster: str, role: Literal["prefill", "decode"] = "prefill"
    ) -> None: ...
    def changes(self) -> list[tuple[str, str, str]]: ...
    def engine(self, engine_id: str) -> list[tuple[tuple[int, int, int], str, int]] | None: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
