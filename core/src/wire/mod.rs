//! Wire formats shared by the connectors: what crosses a process boundary. Every decoder
//! refuses input above a size limit before decoding, never panics, and never allocates more
//! than the input justifies.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod handshake;
pub mod params;
pub mod pull_notes;
pub mod push_messages;
pub mod sglang_nixl;
pub mod vllm;
pub mod vllm_peer;

use thiserror::Error;

/// Why bytes from a peer were refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// The message is larger than the configured limit.
    #[error("message of {size} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The bytes do not decode as the expected message.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was expected.
        what: &'static str,
        /// The decoder's reason.
        reason: String,
    },
    /// The message decodes but its content is inconsistent.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// What was expected.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Refuses `bytes` above `limit` before any decoding.
pub fn check_size(bytes: &[u8], limit: usize) -> Result<(), WireError> {
    if bytes.len() > limit {
        Err(WireError::TooLarge {
            size: bytes.len(),
            limit,
        })
    } else {
        Ok(())
    }
}
