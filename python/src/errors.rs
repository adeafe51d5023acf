//! Python exceptions for kvxfer's errors: one base class, one subclass per kind of failure,
//! so callers can catch what they can act on.

use kvxfer_core::TransportError;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{PyErr, create_exception};

create_exception!(
    _kvxfer,
    KvxferError,
    PyException,
    "Base class of every kvxfer error."
);
create_exception!(
    _kvxfer,
    NotAvailableError,
    KvxferError,
    "A transport, library or device is missing."
);
create_exception!(
    _kvxfer,
    NotSupportedError,
    KvxferError,
    "The transport cannot do this."
);
create_exception!(
    _kvxfer,
    OutOfBoundsError,
    KvxferError,
    "A range lies outside registered memory."
);
create_exception!(
    _kvxfer,
    InvalidMemoryError,
    KvxferError,
    "Memory that cannot be registered (unmapped, empty, overlapping)."
);
create_exception!(
    _kvxfer,
    InvalidMetadataError,
    KvxferError,
    "Peer metadata that does not decode."
);
create_exception!(
    _kvxfer,
    UnknownPeerError,
    KvxferError,
    "A peer that was never loaded or was removed."
);
create_exception!(
    _kvxfer,
    PeerGoneError,
    KvxferError,
    "A peer that died or was replaced."
);
create_exception!(
    _kvxfer,
    InvalidArgumentError,
    KvxferError,
    "An id, index, list or size that is wrong for this call."
);
create_exception!(
    _kvxfer,
    TransferFailedError,
    KvxferError,
    "A transfer ended failed."
);
create_exception!(
    _kvxfer,
    TransferTimeoutError,
    KvxferError,
    "A wait ran past its bound."
);
create_exception!(
    _kvxfer,
    BackendError,
    KvxferError,
    "The transport library reported an error."
);
create_exception!(
    _kvxfer,
    ShutDownError,
    KvxferError,
    "The object was shut down."
);
create_exception!(
    _kvxfer,
    LayoutError,
    KvxferError,
    "A cache layout that is invalid."
);
create_exception!(
    _kvxfer,
    SideChannelError,
    KvxferError,
    "The side channel could not start."
);

create_exception!(
    _kvxfer,
    DiscoveryError,
    KvxferError,
    "The discovery store (etcd) is unreachable, refused, or answered what it should not."
);

/// The Python exception for a transport error.
pub fn transport(e: TransportError) -> PyErr {
    let msg = e.to_string();
    match e {
        TransportError::NotSupported(_) => NotSupportedError::new_err(msg),
        TransportError::NotAvailable { .. } => NotAvailableError::new_err(msg),
        TransportError::OutOfBounds { .. } => OutOfBoundsError::new_err(msg),
        TransportError::InvalidRegistration(_) => InvalidMemoryError::new_err(msg),
        TransportError::InvalidMetadata(_) => InvalidMetadataError::new_err(msg),
        TransportError::UnknownPeer(_) => UnknownPeerError::new_err(msg),
        TransportError::PeerGone(_) => PeerGoneError::new_err(msg),
        TransportError::UnknownList(_)
        | TransportError::WrongList(..)
        | TransportError::UnknownTransfer(_)
        | TransportError::IndexOutOfRange { .. }
        | TransportError::Mismatch(_)
        | TransportError::TooLarge { .. } => InvalidArgumentError::new_err(msg),
        TransportError::Backend(_) => BackendError::new_err(msg),
    }
}

/// Adds every exception class to the module.
pub fn add_all(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvxferError", py.get_type::<KvxferError>())?;
    m.add("NotAvailableError", py.get_type::<NotAvailableError>())?;
    m.add("NotSupportedError", py.get_type::<NotSupportedError>())?;
    m.add("OutOfBoundsError", py.get_type::<OutOfBoundsError>())?;
    m.add("InvalidMemoryError", py.get_type::<InvalidMemoryError>())?;
    m.add(
        "InvalidMetadataError",
        py.get_type::<InvalidMetadataError>(),
    )?;
    m.add("UnknownPeerError", py.get_type::<UnknownPeerError>())?;
    m.add("PeerGoneError", py.get_type::<PeerGoneError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("TransferFailedError", py.get_type::<TransferFailedError>())?;
    m.add(
        "TransferTimeoutError",
        py.get_type::<TransferTimeoutError>(),
    )?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("ShutDownError", py.get_type::<ShutDownError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("SideChannelError", py.get_type::<SideChannelError>())?;
    m.add("DiscoveryError", py.get_type::<DiscoveryError>())?;
    Ok(())
}
