"""kvxfer: moves KV-cache blocks between prefill and decode engines.

The work happens in Rust (``kvxfer._kvxfer``); this package re-exports it:

- :class:`Agent` — one transport agent (``loopback``, ``ucx`` or ``nixl``): register memory,
  exchange metadata, READ/WRITE with notifications, poll status, drain notifications.
- :class:`PullScheduler` and :class:`PullWorker` — the two halves of the pull connector
  (decode READs the prefill's blocks); what crosses between them is JSON text.
- :class:`PushRegistry`, :class:`PushPrefill` and :class:`PushDecode` — the push connector
  (prefill WRITEs into decode): a prefill instance's bootstrap registry and one rank of each
  side. :mod:`kvxfer.sglang` runs them as SGLang's ``kvxfer`` transfer backend.
- :class:`Registration` and :class:`FleetWatch` — fleet discovery through etcd: a
  process's rank registered under its own lease, and a watch of one role's engines.
- :class:`SharedHostMemory` — a host cache in kvxfer shared memory: same-host ``ucx`` agents
  map each other's and copy directly instead of going through the kernel per block.
- :func:`connector_options` — the vLLM connectors' ``kv_connector_extra_config``, validated,
  with every default filled in.
- :func:`ucx_version` — the UCX library the ``ucx`` transport uses in this process, and
  :mod:`kvxfer.ucx` to choose it.
- The exceptions, all subclasses of :class:`KvxferError`.
"""

from kvxfer._amx import request_tile_state

# Before the extension can start any thread (see kvxfer._amx): an engine's AMX kernels then
# keep working in this process.
request_tile_state()

from kvxfer._kvxfer import (  # noqa: E402
    Agent,
    BackendError,
    DiscoveryError,
    FleetWatch,
    InvalidArgumentError,
    InvalidMemoryError,
    InvalidMetadataError,
    KvxferError,
    LayoutError,
    NotAvailableError,
    NotSupportedError,
    OutOfBoundsError,
    PeerGoneError,
    PullScheduler,
    PullWorker,
    PushDecode,
    PushPrefill,
    PushRegistry,
    Registration,
    SharedHostMemory,
    ShutDownError,
    SideChannelError,
    TransferFailedError,
    TransferTimeoutError,
    UnknownPeerError,
    __version__,
    connector_options,
    ucx_version,
)

__all__ = [
    "Agent",
    "BackendError",
    "DiscoveryError",
    "FleetWatch",
    "InvalidArgumentError",
    "InvalidMemoryError",
    "InvalidMetadataError",
    "KvxferError",
    "LayoutError",
    "NotAvailableError",
    "NotSupportedError",
    "OutOfBoundsError",
    "PeerGoneError",
    "PullScheduler",
    "PullWorker",
    "PushDecode",
    "PushPrefill",
    "PushRegistry",
    "Registration",
    "SharedHostMemory",
    "ShutDownError",
    "SideChannelError",
    "TransferFailedError",
    "TransferTimeoutError",
    "UnknownPeerError",
    "__version__",
    "connector_options",
    "ucx_version",
]
