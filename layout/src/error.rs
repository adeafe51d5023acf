//! The one error type of the layout crate.

use thiserror::Error;

/// Everything that can be wrong with layout parameters. Every variant carries the values
/// involved so that a message names what to fix.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A size or count that must be positive was zero.
    #[error("{field} must be non-zero")]
    Zero {
        /// The parameter's name.
        field: &'static str,
    },
    /// A computed size or address does not fit in 64 bits.
    #[error("{what} overflows 64-bit arithmetic")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// An index is outside its valid range `0..limit`.
    #[error("{what} {index} is out of range (must be below {limit})")]
    OutOfRange {
        /// What kind of index.
        what: &'static str,
        /// The index given.
        index: u64,
        /// The exclusive upper bound.
        limit: u64,
    },
    /// A parameter exceeds a configured bound that protects against huge allocations.
    #[error("{what} is {value}, above the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// The value given or computed.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// Two quantities that must divide evenly do not.
    #[error("{what}: {dividend} is not divisible by {divisor}")]
    NotDivisible {
        /// What the division is for.
        what: &'static str,
        /// The number being divided.
        dividend: u64,
        /// The divisor.
        divisor: u64,
    },
    /// Source and destination disagree on a property that must match.
    #[error("{field} differs: source {source_value}, destination {dest_value}")]
    Mismatch {
        /// The property.
        field: &'static str,
        /// The source side's value.
        source_value: String,
        /// The destination side's value.
        dest_value: String,
    },
    /// Two lists that must have equal length do not.
    #[error("{what}: lengths differ ({left} vs {right})")]
    LengthMismatch {
        /// What the lists are.
        what: &'static str,
        /// Length of the first list.
        left: usize,
        /// Length of the second list.
        right: usize,
    },
    /// A combination of parameters that is well-formed but not supported.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Two memory ranges that must be disjoint overlap.
    #[error("{what}: ranges {first} and {second} overlap")]
    Overlap {
        /// What the ranges are.
        what: &'static str,
        /// Index of the first range.
        first: usize,
        /// Index of the second range.
        second: usize,
    },
    /// A block id appears twice where each may appear once.
    #[error("{what}: block {block} appears more than once")]
    DuplicateBlock {
        /// Which list.
        what: &'static str,
        /// The repeated block id.
        block: u32,
    },
}

/// Result alias of this crate.
pub type Result<T, E = LayoutError> = std::result::Result<T, E>;

/// Checked multiply that names what overflowed.
pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

/// Checked add that names what overflowed.
pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_add(b).ok_or(LayoutError::Overflow { what })
}

/// Error unless `value` is non-zero.
pub(crate) fn nonzero(value: u64, field: &'static str) -> Result<u64> {
    if value == 0 {
        Err(LayoutError::Zero { field })
    } else {
        Ok(value)
    }
}

/// Error unless `index < limit`.
pub(crate) fn in_range(index: u64, limit: u64, what: &'static str) -> Result<()> {
    if index < limit {
        Ok(())
    } else {
        Err(LayoutError::OutOfRange { what, index, limit })
    }
}
