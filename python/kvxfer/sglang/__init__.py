"""kvxfer as an SGLang disaggregation backend (``--disaggregation-transfer-backend kvxfer``).

SGLang (0.5.23 and later) loads the general plugins installed under the ``sglang.srt.plugins``
entry-point group at the start of every process; kvxfer's package declares :func:`register`
there, so installing kvxfer next to SGLang is all it takes. :func:`register` adds ``kvxfer`` to
the backend choices SGLang's argument parser accepts and, through SGLang's ``HookRegistry``,
extends its ``TransferBackend`` enum with ``KVXFER`` and routes ``get_kv_class`` for it to the
classes in :mod:`kvxfer.sglang.conn`. Every other backend is untouched. ``SGLANG_PLUGINS``, when
set, must name ``kvxfer``.
"""

from __future__ import annotations

import enum
from typing import Any

BACKEND = "kvxfer"
"""The value of ``--disaggregation-transfer-backend`` that selects kvxfer."""


def _with_kvxfer(original: type[enum.Enum]) -> type[enum.Enum]:
    """`original` (SGLang's ``TransferBackend``) with a ``KVXFER`` member added."""
    if BACKEND in original._value2member_map_:
        return original
    members = [(m.name, m.value) for m in original] + [("KVXFER", BACKEND)]
    extended = enum.Enum(  # type: ignore[misc]
        original.__name__, members, module=original.__module__, qualname=original.__qualname__
    )
    extended.__doc__ = original.__doc__
    return extended


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """SGLang's ``get_kv_class``, answering for the ``kvxfer`` backend."""
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or (
        class_type == KVClassType.KVARGS
    ):
        return original(transfer_backend, class_type)
    from kvxfer.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvxferKVManager,
        KVClassType.SENDER: conn.KvxferKVSender,
        KVClassType.RECEIVER: conn.KvxferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvxferKVBootstrapServer,
    }[class_type]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see the module's documentation)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.TransferBackend",
        _with_kvxfer(utils.TransferBackend),
        HookType.REPLACE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND
    )
