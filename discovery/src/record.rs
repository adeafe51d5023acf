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
    /// Push mode: what a decode needs to send this rank its rooms; absent in pull mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<PushRank>,
}

/// A push-mode prefill rank: the rest of what its bootstrap registry would answer. The rank's
/// mailbox is the record's `endpoint`; its TP and PP rank and sizes are the key's and the
/// world's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushRank {
    /// The prefill engine's bootstrap address, `host:port`: what a decode's requests name it
    /// by (SGLang's `bootstrap_host` and `bootstrap_port`).
    pub bootstrap: String,
    /// The rank's transport agent name.
    pub agent: String,
    /// Tokens per page.
    pub page_size: u32,
    /// KV dtype name.
    pub dtype: String,
    /// First global layer of the rank's pipeline stage.
    pub first_layer: u32,
    /// Layers of the stage.
    pub num_layers: u32,
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
        if let Some(p) = &self.push {
            let bounded = |f: &str| !f.is_empty() && f.len() <= MAX_FIELD;
            if !bounded(&p.bootstrap) {
                return Err(RecordError::Field("push.bootstrap"));
            }
            if !bounded(&p.agent) {
                return Err(RecordError::Field("push.agent"));
            }
            if !bounded(&p.dtype) {
                return Err(RecordError::Field("push.dtype"));
            }
            if p.first_layer.checked_add(p.num_layers).is_none() {
                return Err(RecordError::Field("push.num_layers"));
            }
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
            push: None,
        }
    }

    fn push() -> PushRank {
        PushRank {
            bootstrap: "10.0.0.1:8998".into(),
            agent: "p0".into(),
            page_size: 16,
            dtype: "bf16".into(),
            first_layer: 8,
            num_layers: 8,
        }
    }

    #[test]
    fn a_push_rank_round_trips_and_its_fields_are_bounded() {
        let mut r = rec();
        r.push = Some(push());
        let bytes = r.encode();
        assert!(
            std::str::from_utf8(&bytes).unwrap().ends_with(
                r#""push":{"bootstrap":"10.0.0.1:8998","agent":"p0","page_size":16,"dtype":"bf16","first_layer":8,"num_layers":8}}"#
            ),
            "{}",
            String::from_utf8_lossy(&bytes)
        );
        assert_eq!(RankRecord::decode(&bytes, R0).unwrap(), r);
        type Bad = (fn(&mut PushRank), &'static str);
        let bad: [Bad; 7] = [
            (|p| p.bootstrap.clear(), "push.bootstrap"),
            (
                |p| p.bootstrap = "x".repeat(MAX_FIELD + 1),
                "push.bootstrap",
            ),
            (|p| p.agent.clear(), "push.agent"),
            (|p| p.agent = "x".repeat(MAX_FIELD + 1), "push.agent"),
            (|p| p.dtype.clear(), "push.dtype"),
            (|p| p.dtype = "x".repeat(MAX_FIELD + 1), "push.dtype"),
            (|p| p.first_layer = u32::MAX, "push.num_layers"),
        ];
        for (spoil, field) in bad {
            let mut p = push();
            spoil(&mut p);
            r.push = Some(p);
            assert_eq!(r.check(), Err(RecordError::Field(field)));
            assert!(RankRecord::decode(&serde_json::to_vec(&r).unwrap(), R0).is_err());
        }
        let mut p = push();
        (p.first_layer, p.num_layers) = (u32::MAX - 1, 1);
        r.push = Some(p);
        assert_eq!(r.check(), Ok(()), "the last layer may be u32::MAX - 1");
        let unknown = br#"{"instance":"0123456789abcdef","endpoint":"a:1","layout":"","world":{"dp":1,"pp":1,"tp":1},"push":{"bootstrap":"a:1","agent":"p","page_size":1,"dtype":"f","first_layer":0,"num_layers":1,"x":1}}"#;
        assert!(RankRecord::decode(unknown, R0).is_err());
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
