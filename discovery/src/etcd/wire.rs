//! The JSON etcd's gateway speaks (protobuf's JSON mapping): 64-bit integers are strings,
//! bytes are base64, fields at their default value are left out.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Deserializer};

/// Base64 for the gateway's bytes fields.
pub fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// An int64 field: a string, or a number from a lenient server; absent is 0.
pub fn int64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        S(String),
        N(i64),
    }
    match Either::deserialize(d)? {
        Either::S(s) => s.parse().map_err(serde::de::Error::custom),
        Either::N(n) => Ok(n),
    }
}

/// A bytes field.
pub fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    STANDARD.decode(s).map_err(serde::de::Error::custom)
}

/// Every answer's header.
#[derive(Debug, Default, Deserialize)]
pub struct Header {
    /// The store's revision when the answer was made.
    #[serde(default, deserialize_with = "int64")]
    pub revision: i64,
}

/// A key and its value.
#[derive(Debug, Default, Deserialize)]
pub struct Kv {
    /// The key.
    #[serde(default, deserialize_with = "bytes")]
    pub key: Vec<u8>,
    /// The value (empty in a delete event).
    #[serde(default, deserialize_with = "bytes")]
    pub value: Vec<u8>,
    /// The revision of its last change.
    #[serde(default, deserialize_with = "int64")]
    pub mod_revision: i64,
    /// The lease it is attached to (0: none).
    #[serde(default, deserialize_with = "int64")]
    pub lease: i64,
}

/// A range answer.
#[derive(Debug, Deserialize)]
pub struct RangeResponse {
    /// Header.
    #[serde(default)]
    pub header: Header,
    /// The keys.
    #[serde(default)]
    pub kvs: Vec<Kv>,
    /// Whether more keys matched than were returned.
    #[serde(default)]
    pub more: bool,
}

/// A put or delete answer.
#[derive(Debug, Deserialize)]
pub struct WriteResponse {
    /// Header.
    #[serde(default)]
    pub header: Header,
}

/// A lease grant or keep-alive answer.
#[derive(Debug, Deserialize)]
pub struct LeaseResponse {
    /// The lease.
    #[serde(rename = "ID", default, deserialize_with = "int64")]
    pub id: i64,
    /// Its time to live in seconds; 0 (absent) when the lease no longer exists.
    #[serde(rename = "TTL", default, deserialize_with = "int64")]
    pub ttl: i64,
    /// Set when a grant was refused.
    #[serde(default)]
    pub error: String,
}

/// A streamed message: `{"result": ...}` or `{"error": ...}`.
#[derive(Debug, Deserialize)]
pub struct Streamed<T> {
    /// The message.
    pub result: Option<T>,
    /// The stream's error, as the gateway reports it.
    pub error: Option<GatewayError>,
}

/// An error the gateway reports in place of an answer.
#[derive(Debug, Deserialize)]
pub struct GatewayError {
    /// gRPC status code.
    #[serde(default)]
    pub code: i32,
    /// Text.
    #[serde(default)]
    pub message: String,
}

/// One change in a watch answer.
#[derive(Debug, Deserialize)]
pub struct Event {
    /// `DELETE`, or absent for a put.
    #[serde(default, rename = "type")]
    pub kind: String,
    /// The key after the change (only key and revision for a delete).
    #[serde(default)]
    pub kv: Kv,
}

/// A watch answer.
#[derive(Debug, Deserialize)]
pub struct WatchResponse {
    /// Header: its revision is the store's when the answer was made.
    #[serde(default)]
    pub header: Header,
    /// The watch was made.
    #[serde(default)]
    pub created: bool,
    /// The watch ended (compaction, or the server's choice).
    #[serde(default)]
    pub canceled: bool,
    /// Set when the start revision was compacted away: the oldest revision still kept.
    #[serde(default, deserialize_with = "int64")]
    pub compact_revision: i64,
    /// Why it was canceled.
    #[serde(default)]
    pub cancel_reason: String,
    /// The changes, in revision order.
    #[serde(default)]
    pub events: Vec<Event>,
}

#[cfg(test)]
mod tests {
    use super::*;

    // Answers as etcd 3.4.23's gateway wrote them (captured on this machine).
    #[test]
    fn reads_what_etcd_3_4_writes() {
        let r: RangeResponse = serde_json::from_str(r#"{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952","revision":"2","raft_term":"2"},"kvs":[{"key":"L2svYQ==","create_revision":"2","mod_revision":"2","version":"1","value":"dg==","lease":"2324035780819688455"}],"count":"1"}"#).unwrap();
        assert_eq!(r.header.revision, 2);
        assert_eq!(r.kvs[0].key, b"/k/a");
        assert_eq!(r.kvs[0].value, b"v");
        assert_eq!(r.kvs[0].lease, 2324035780819688455);
        let empty: RangeResponse = serde_json::from_str(r#"{"header":{"revision":"3"}}"#).unwrap();
        assert!(empty.kvs.is_empty());

        let l: Streamed<LeaseResponse> = serde_json::from_str(
            r#"{"result":{"header":{"revision":"3"},"ID":"2324035780819688455"}}"#,
        )
        .unwrap();
        let l = l.result.unwrap();
        assert_eq!((l.id, l.ttl), (2324035780819688455, 0));

        let w: Streamed<WatchResponse> = serde_json::from_str(r#"{"result":{"header":{"revision":"6"},"events":[{"type":"DELETE","kv":{"key":"L3cvYQ==","mod_revision":"6"}}]}}"#).unwrap();
        let w = w.result.unwrap();
        assert_eq!(w.events[0].kind, "DELETE");
        assert_eq!(w.events[0].kv.mod_revision, 6);
        let c: Streamed<WatchResponse> = serde_json::from_str(r#"{"result":{"header":{"cluster_id":"3","raft_term":"2"},"canceled":true,"compact_revision":"5"}}"#).unwrap();
        let c = c.result.unwrap();
        assert!(c.canceled);
        assert_eq!(c.compact_revision, 5);
    }

    #[test]
    fn bad_numbers_and_bytes_are_errors() {
        assert!(serde_json::from_str::<Header>(r#"{"revision":"x"}"#).is_err());
        assert!(serde_json::from_str::<Header>(r#"{"revision":"99999999999999999999"}"#).is_err());
        assert!(serde_json::from_str::<Kv>(r#"{"key":"!!"}"#).is_err());
        assert_eq!(
            serde_json::from_str::<Header>(r#"{"revision":7}"#)
                .unwrap()
                .revision,
            7
        );
    }
}
