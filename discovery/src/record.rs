//! The value stored under a rank's key: where to reach the rank and which process it is.
//!
//! Only what a peer needs to find the rank and notice a restart: the transfer metadata itself
//! stays on the side channel, fetched at handshake time.

use serde::{Deserialize, Serialize};

use crate::key::RankIndex;

/// The largest record accepted from the store.
pub const MAX_RECORD: usize = 4096;
/// The longest endpoint or layout digest accepted.
pub const MAX_FIELD: usize = 256;

/// The engine's parallel sizes: how many ranks make it whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct World {
    /// Data-parallel size.
    pub dp: u32,
    /// Pipeline stages.
    pub pp: u32,
    /// Tensor-parallel size.
    pub tp: u32,
}

impl World {
    /// One rank.
    pub const SINGLE: World = World {
        dp: 1,
        pp: 1,
        tp: 1,
    };

    /// Ranks in the engine, `None` when the product does not fit (a record naming such a
    /// world is refused).
    pub fn ranks(&self) -> Option<u32> {
        self.dp.checked_mul(self.pp)?.checked_mul(self.tp)
    }

    /// Whether `rank` lies in this world.
    pub fn contains(&self, rank: RankIndex) -> bool {
        rank.dp < self.dp && rank.pp < self.pp && rank.tp < self.tp
    }
}

/// One rank's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankRecord {
    /// A random id of the process that registered: a new one means the rank restarted.
    #[serde(with = "hex_u64")]
    pub instance: u64,
    /// The rank's side-channel endpoint, `host:port`.
    pub endpoint: String,
    /// A digest of the rank's cache layout, compared before any handshake.
    pub layout: String,
    /// The engine's parallel sizes.
    pub world: World,
}

/// Why a stored record was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Larger than [`MAX_RECORD`].
    #[error("record of {0} bytes (at most {MAX_RECORD})")]
    TooLarge(usize),
    /// Not the JSON this version writes.
    #[error("record is not valid: {0}")]
    Malformed(String),
    /// A field out of bounds.
    #[error("record field {0} is out of bounds")]
    Field(&'static str),
}

impl RankRecord {
    /// The stored bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record always serializes")
    }

    /// Parses and checks stored bytes for the rank at `rank`.
    pub fn decode(bytes: &[u8], rank: RankIndex) -> Result<RankRecord, RecordError> {
        if bytes.len() > MAX_RECORD {
            return Err(RecordError::TooLarge(bytes.len()));
        }
        let r: RankRecord =
            serde_json::from_slice(bytes).map_err(|e| RecordError::Malformed(e.to_string()))?;
        r.check()?;
        if !r.world.contains(rank) {
            return Err(RecordError::Field("world (the key's rank lies outside it)"));
        }
        Ok(r)
    }

    /// Checks the fields' bounds (also before registering our own).
    pub fn check(&self) -> Result<(), RecordError> {
        if self.endpoint.is_empty() || self.endpoint.len() > MAX_FIELD {
            return Err(RecordError::Field("endpoint"));
        }
        if self.layout.len() > MAX_FIELD {
            return Err(RecordError::Field("layout"));
        }
        match self.world.ranks() {
            Some(n) if n > 0 && n <= crate::MAX_RANKS => Ok(()),
            _ => Err(RecordError::Field("world")),
        }
    }
}

mod hex_u64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() != 16 {
            return Err(serde::de::Error::custom("instance: 16 hex digits"));
        }
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: RankIndex = RankIndex {
        dp: 0,
        pp: 0,
        tp: 0,
    };

    fn rec() -> RankRecord {
        RankRecord {
            instance: 0x0123_4567_89ab_cdef,
            endpoint: "10.0.0.1:5600".into(),
            layout: "sha256:abcd".into(),
            world: World {
                dp: 1,
                pp: 2,
                tp: 4,
            },
        }
    }

    #[test]
    fn round_trips_in_the_documented_form() {
        let bytes = rec().encode();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"instance":"0123456789abcdef","endpoint":"10.0.0.1:5600","layout":"sha256:abcd","world":{"dp":1,"pp":2,"tp":4}}"#
        );
        assert_eq!(RankRecord::decode(&bytes, R0).unwrap(), rec());
    }

    #[test]
    fn bad_records_are_refused() {
        let big = vec![b' '; MAX_RECORD + 1];
        assert_eq!(
            RankRecord::decode(&big, R0),
            Err(RecordError::TooLarge(MAX_RECORD + 1))
        );
        for bad in [
            &b"not json"[..],
            br#"{"instance":"12","endpoint":"a:1","layout":"","world":{"dp":1,"pp":1,"tp":1}}"#,
            br#"{"instance":"zz23456789abcdef","endpoint":"a:1","layout":"","world":{"dp":1,"pp":1,"tp":1}}"#,
            br#"{"instance":"0123456789abcdef","endpoint":"a:1","layout":"","world":{"dp":1,"pp":1,"tp":1},"x":1}"#,
            br#"{"instance":"0123456789abcdef","endpoint":"","layout":"","world":{"dp":1,"pp":1,"tp":1}}"#,
            br#"{"instance":"0123456789abcdef","endpoint":"a:1","layout":"","world":{"dp":0,"pp":1,"tp":1}}"#,
            br#"{"instance":"0123456789abcdef","endpoint":"a:1","layout":"","world":{"dp":65536,"pp":65536,"tp":2}}"#,
            br#"{"instance":"0123456789abcdef","endpoint":"a:1","layout":"","world":{"dp":1,"pp":1,"tp":-1}}"#,
        ] {
            assert!(RankRecord::decode(bad, R0).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let mut r = rec();
        r.endpoint = "x".repeat(MAX_FIELD + 1);
        assert_eq!(r.check(), Err(RecordError::Field("endpoint")));
        let mut r = rec();
        r.layout = "x".repeat(MAX_FIELD + 1);
        assert_eq!(r.check(), Err(RecordError::Field("layout")));
        let mut r = rec();
        r.world = World {
            dp: 1,
            pp: 1,
            tp: crate::MAX_RANKS + 1,
        };
        assert_eq!(r.check(), Err(RecordError::Field("world")));
        r.world.tp = crate::MAX_RANKS;
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn a_rank_outside_the_records_world_is_refused() {
        let bytes = rec().encode();
        for rank in [
            RankIndex {
                dp: 1,
                pp: 0,
                tp: 0,
            },
            RankIndex {
                dp: 0,
                pp: 2,
                tp: 0,
            },
            RankIndex {
                dp: 0,
                pp: 0,
                tp: 4,
            },
        ] {
            assert!(RankRecord::decode(&bytes, rank).is_err(), "{rank}");
        }
        assert!(
            RankRecord::decode(
                &bytes,
                RankIndex {
                    dp: 0,
                    pp: 1,
                    tp: 3
                }
            )
            .is_ok()
        );
    }
}
