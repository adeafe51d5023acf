//! etcd v3 calls over the JSON gateway: range, put, delete, leases and watch streams.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::json;

use super::http::{self, Body, HttpError, MAX_BODY};
use super::wire::{
    GatewayError, Kv, LeaseResponse, RangeResponse, Streamed, WatchResponse, WriteResponse, b64,
};
use crate::key::prefix_end;

/// What went wrong with etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint answered.
    #[error("etcd unreachable at {endpoints}: {reason}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: String,
        /// The last failure.
        reason: String,
    },
    /// etcd refused the call.
    #[error("etcd refused {call}: {message} (gRPC code {code})")]
    Refused {
        /// The call.
        call: &'static str,
        /// gRPC status code.
        code: i32,
        /// etcd's text.
        message: String,
    },
    /// An answer that is not what etcd's gateway writes.
    #[error("unexpected answer from etcd to {call}: {detail}")]
    Protocol {
        /// The call.
        call: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The address given is not `etcd://HOST:PORT[,HOST:PORT...]`.
    #[error("invalid etcd address {0:?}: expected etcd://HOST:PORT[,HOST:PORT...]")]
    Address(String),
}

/// gRPC's NOT_FOUND, which etcd answers for a lease that no longer exists.
pub const NOT_FOUND: i32 = 5;

/// A client of one etcd cluster (any of its members' client URLs).
#[derive(Debug)]
pub struct EtcdClient {
    endpoints: Vec<String>,
    timeout: Duration,
    /// The endpoint that answered last: tried first next time.
    current: AtomicUsize,
}

/// A lease's id.
pub type LeaseId = i64;

/// A watch being read.
pub struct WatchStream {
    body: Body,
}

impl EtcdClient {
    /// A client for `address` (`etcd://HOST:PORT[,HOST:PORT...]`; `http://` is taken too),
    /// each call bounded by `timeout`. Nothing is contacted yet.
    pub fn new(address: &str, timeout: Duration) -> Result<EtcdClient, EtcdError> {
        let bad = || EtcdError::Address(address.to_owned());
        let rest = address
            .strip_prefix("etcd://")
            .or_else(|| address.strip_prefix("http://"))
            .ok_or_else(bad)?;
        let endpoints: Vec<String> = rest
            .trim_end_matches('/')
            .split(',')
            .map(|e| e.trim().to_owned())
            .collect();
        for e in &endpoints {
            let (host, port) = e.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) || e.contains('/') {
                return Err(bad());
            }
        }
        Ok(EtcdClient {
            endpoints,
            timeout,
            current: AtomicUsize::new(0),
        })
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Every key under `prefix` and the store's revision they were read at.
    pub fn range_prefix(&self, prefix: &[u8]) -> Result<(i64, Vec<Kv>), EtcdError> {
        let body = json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
        let r: RangeResponse = self.call("range", "/v3/kv/range", &body)?;
        if r.more {
            return Err(EtcdError::Protocol {
                call: "range",
                detail: "a partial answer without a limit".into(),
            });
        }
        Ok((r.header.revision, r.kvs))
    }

    /// Writes `key`, attached to `lease` when it is not 0; returns the new revision.
    pub fn put(&self, key: &[u8], value: &[u8], lease: LeaseId) -> Result<i64, EtcdError> {
        let body = json!({"key": b64(key), "value": b64(value), "lease": lease.to_string()});
        let r: WriteResponse = self.call("put", "/v3/kv/put", &body)?;
        Ok(r.header.revision)
    }

    /// Deletes every key under `prefix`; returns the new revision.
    pub fn delete_prefix(&self, prefix: &[u8]) -> Result<i64, EtcdError> {
        let body = json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
        let r: WriteResponse = self.call("delete", "/v3/kv/deleterange", &body)?;
        Ok(r.header.revision)
    }

    /// Compacts the history before `revision` (tests and tools).
    pub fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        let body = json!({"revision": revision.to_string(), "physical": true});
        let _: serde_json::Value = self.call("compaction", "/v3/kv/compaction", &body)?;
        Ok(())
    }

    /// A new lease of `ttl` seconds.
    pub fn grant(&self, ttl: i64) -> Result<LeaseId, EtcdError> {
        let r: LeaseResponse = self.call("lease grant", "/v3/lease/grant", &json!({"TTL": ttl}))?;
        if !r.error.is_empty() || r.id == 0 {
            return Err(EtcdError::Refused {
                call: "lease grant",
                code: 0,
                message: r.error,
            });
        }
        Ok(r.id)
    }

    /// Renews `lease` once; returns its time to live, 0 when it no longer exists.
    pub fn keep_alive(&self, lease: LeaseId) -> Result<i64, EtcdError> {
        let body = json!({"ID": lease.to_string()});
        let r: Streamed<LeaseResponse> =
            self.call("lease keep-alive", "/v3/lease/keepalive", &body)?;
        match (r.result, r.error) {
            (Some(l), _) => Ok(l.ttl.max(0)),
            (None, Some(e)) if e.code == NOT_FOUND => Ok(0),
            (None, e) => Err(refused("lease keep-alive", e)),
        }
    }

    /// Ends `lease` and deletes its keys; a lease already gone is no error.
    pub fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        let body = json!({"ID": lease.to_string()});
        match self.call::<serde_json::Value>("lease revoke", "/v3/lease/revoke", &body) {
            Err(EtcdError::Refused {
                code: NOT_FOUND, ..
            })
            | Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Watches every key under `prefix` from `start_revision` on. The stream's first answer
    /// confirms the watch (`created`); a start revision already compacted away is answered
    /// with `canceled` and the oldest revision kept.
    pub fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, EtcdError> {
        let body = json!({"create_request": {
            "key": b64(prefix),
            "range_end": b64(&prefix_end(prefix)),
            "start_revision": start_revision.to_string(),
        }});
        let bytes = serde_json::to_vec(&body).expect("json");
        let body = self.each_endpoint("watch", |addr| {
            http::post(addr, "/v3/watch", &bytes, self.timeout)
        })?;
        Ok(WatchStream { body })
    }

    fn call<R: DeserializeOwned>(
        &self,
        call: &'static str,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<R, EtcdError> {
        let bytes = serde_json::to_vec(body).expect("json");
        let answer = self.each_endpoint(call, |addr| {
            http::post(addr, path, &bytes, self.timeout)?.read_all(MAX_BODY)
        })?;
        serde_json::from_slice(&answer).map_err(|e| EtcdError::Protocol {
            call,
            detail: e.to_string(),
        })
    }

    /// Runs `f` on each endpoint in turn, from the last that answered, until one answers.
    /// Transport failures move on to the next; an HTTP error status is etcd's answer.
    fn each_endpoint<R>(
        &self,
        call: &'static str,
        mut f: impl FnMut(&str) -> Result<R, HttpError>,
    ) -> Result<R, EtcdError> {
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..n {
            // `n` > 0: an address always names an endpoint.
            let at = first.wrapping_add(i).checked_rem(n).unwrap_or(0);
            match f(&self.endpoints[at]) {
                Ok(r) => {
                    self.current.store(at, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(HttpError::Status { status, body }) => {
                    // The gateway's JSON error where it is one.
                    return Err(match serde_json::from_str::<GatewayError>(&body) {
                        Ok(e) if e.code != 0 => refused(call, Some(e)),
                        _ => EtcdError::Protocol {
                            call,
                            detail: format!("HTTP {status}: {body}"),
                        },
                    });
                }
                Err(e) => last = format!("{}: {e}", self.endpoints[at]),
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints.join(","),
            reason: last,
        })
    }
}

fn refused(call: &'static str, e: Option<GatewayError>) -> EtcdError {
    let e = e.unwrap_or(GatewayError {
        code: 0,
        message: "no result and no error".into(),
    });
    EtcdError::Refused {
        call,
        code: e.code,
        message: e.message,
    }
}

/// What a watch stream delivered.
#[derive(Debug)]
pub enum WatchItem {
    /// Changes (possibly none: a progress note), and the revision the answer was made at.
    Changes(WatchResponse),
    /// No answer within the read timeout; the stream is still open.
    Idle,
    /// The stream ended or failed: watch again (after a fresh range).
    Lost(String),
}

impl WatchStream {
    /// Waits up to `wait` for the next answer.
    pub fn next(&mut self, wait: Duration) -> WatchItem {
        if let Err(e) = self.body.set_read_timeout(wait) {
            return WatchItem::Lost(e.to_string());
        }
        match self.body.next_line() {
            Ok(Some(line)) if line.iter().all(u8::is_ascii_whitespace) => WatchItem::Idle,
            Ok(Some(line)) => match serde_json::from_slice::<Streamed<WatchResponse>>(&line) {
                Ok(Streamed {
                    result: Some(r), ..
                }) => WatchItem::Changes(r),
                Ok(Streamed { error: Some(e), .. }) => WatchItem::Lost(format!(
                    "etcd ended the watch: {} (code {})",
                    e.message, e.code
                )),
                Ok(_) => WatchItem::Lost("an empty watch answer".into()),
                Err(e) => WatchItem::Lost(format!("a malformed watch answer: {e}")),
            },
            Ok(None) => WatchItem::Lost("etcd closed the watch".into()),
            Err(HttpError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                WatchItem::Idle
            }
            Err(e) => WatchItem::Lost(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked() {
        let t = Duration::from_secs(1);
        let c = EtcdClient::new("etcd://127.0.0.1:2379,host-b:2379/", t).unwrap();
        assert_eq!(c.endpoints(), ["127.0.0.1:2379", "host-b:2379"]);
        assert!(EtcdClient::new("http://[::1]:2379", t).is_ok());
        for bad in [
            "127.0.0.1:2379",
            "etcd://",
            "etcd://host",
            "etcd://host:0",
            "etcd://host:99999",
            "etcd://:2379",
            "etcd://h:1,",
            "etcd://h:1/path",
            "https://h:1",
        ] {
            assert!(
                matches!(EtcdClient::new(bad, t), Err(EtcdError::Address(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn nothing_listening_is_a_clear_unreachable_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let c =
            EtcdClient::new(&format!("etcd://127.0.0.1:{port}"), Duration::from_secs(1)).unwrap();
        let e = c.grant(10).unwrap_err();
        assert!(matches!(e, EtcdError::Unreachable { .. }));
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("etcd unreachable at 127.0.0.1:{port}:")),
            "{text}"
        );
    }
}
