//! The bootstrap registry the prefill side runs: its ranks register, decode asks for the
//! prefill's parallel layout and rank endpoints, and gets "not ready" until every rank has
//! registered. A restarted prefill runs a new registry with a new instance id, which tells
//! decode to drop what it cached about the old one.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::messages::{FromRegistry, MAX_MESSAGE_BYTES, RankInfo, ToRegistry, decode, encode};
use crate::sidechannel::auth::Destination;
use crate::sidechannel::{MessageServer, request_bytes};

/// A running registry; dropping it stops serving.
pub struct BootstrapRegistry {
    server: MessageServer,
    instance: u64,
}

type Key = (u32, u32, u32);

/// A random identity, so that a decode can tell a restarted prefill from the one it knew.
fn fresh_instance() -> u64 {
    rand::random()
}

fn answer(ranks: &Mutex<BTreeMap<Key, RankInfo>>, instance: u64, bytes: &[u8]) -> FromRegistry {
    let msg = match decode::<ToRegistry>(bytes, "registry request") {
        Ok(m) => m,
        Err(e) => {
            return FromRegistry::Error {
                reason: e.to_string(),
            };
        }
    };
    let mut ranks = ranks.lock().unwrap_or_else(|e| e.into_inner());
    match msg {
        ToRegistry::Health => FromRegistry::Ok,
        ToRegistry::Register(info) => {
            if let Err(reason) = info.check() {
                return FromRegistry::Error { reason };
            }
            if let Some(other) = ranks.values().next() {
                let same = (
                    other.tp_size,
                    other.pp_size,
                    other.dp_size,
                    other.page_size,
                    &other.dtype,
                ) == (
                    info.tp_size,
                    info.pp_size,
                    info.dp_size,
                    info.page_size,
                    &info.dtype,
                );
                if !same {
                    return FromRegistry::Error {
                        reason:
                            "rank disagrees with the registered layout (sizes, page size or dtype)"
                                .into(),
                    };
                }
            }
            // Re-registration of a rank replaces it.
            ranks.insert((info.dp_rank, info.pp_rank, info.tp_rank), info);
            FromRegistry::Ok
        }
        ToRegistry::Query => {
            let Some(first) = ranks.values().next() else {
                return FromRegistry::NotReady {
                    registered: 0,
                    expected: 0,
                };
            };
            let expected = first
                .tp_size
                .saturating_mul(first.pp_size)
                .saturating_mul(first.dp_size);
            if (ranks.len() as u32) < expected {
                return FromRegistry::NotReady {
                    registered: ranks.len() as u32,
                    expected,
                };
            }
            FromRegistry::Layout {
                instance,
                ranks: ranks.values().cloned().collect(),
            }
        }
    }
}

impl BootstrapRegistry {
    /// Serves the registry on `host:port` (0 picks a free port).
    pub fn bind(host: &str, port: u16) -> Result<Self, String> {
        let instance = fresh_instance();
        let ranks: Arc<Mutex<BTreeMap<Key, RankInfo>>> = Arc::default();
        let server = MessageServer::bind(
            host,
            port,
            MAX_MESSAGE_BYTES,
            Destination::registry,
            Box::new(move |bytes| encode(&answer(&ranks, instance, bytes))),
        )?;
        Ok(BootstrapRegistry { server, instance })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// This prefill instance's id.
    pub fn instance(&self) -> u64 {
        self.instance
    }
}

/// Sends one registry request and decodes the reply (`Err` on timeout or garbage).
pub fn ask_registry(
    host: &str,
    port: u16,
    msg: &ToRegistry,
    timeout: Duration,
) -> Result<FromRegistry, String> {
    let to = Destination::registry(port);
    let reply = request_bytes(host, port, &to, &encode(msg), timeout, MAX_MESSAGE_BYTES)
        .map_err(|e| e.to_string())?;
    decode(&reply, "registry reply").map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(tp_rank: u32, pp_rank: u32) -> RankInfo {
        RankInfo {
            agent: format!("p{tp_rank}"),
            tp_size: 2,
            tp_rank,
            pp_size: 1,
            pp_rank,
            dp_size: 1,
            dp_rank: 0,
            host: "127.0.0.1".into(),
            port: 1000 + tp_rank as u16,
            page_size: 16,
            dtype: "bf16".into(),
            first_layer: 0,
            num_layers: 4,
        }
    }

    #[test]
    fn every_registry_has_its_own_instance() {
        assert_ne!(fresh_instance(), fresh_instance());
    }

    #[test]
    fn not_ready_until_every_rank_registered() {
        let reg = BootstrapRegistry::bind("127.0.0.1", 0).unwrap();
        let t = Duration::from_secs(5);
        let ask = |m: &ToRegistry| ask_registry("127.0.0.1", reg.port(), m, t).unwrap();
        assert_eq!(
            ask(&ToRegistry::Query),
            FromRegistry::NotReady {
                registered: 0,
                expected: 0
            }
        );
        assert_eq!(ask(&ToRegistry::Register(rank(0, 0))), FromRegistry::Ok);
        assert_eq!(
            ask(&ToRegistry::Query),
            FromRegistry::NotReady {
                registered: 1,
                expected: 2
            }
        );
        let mut odd = rank(1, 0);
        odd.page_size = 32;
        assert!(matches!(
            ask(&ToRegistry::Register(odd)),
            FromRegistry::Error { .. }
        ));
        assert_eq!(ask(&ToRegistry::Register(rank(1, 0))), FromRegistry::Ok);
        match ask(&ToRegistry::Query) {
            FromRegistry::Layout { instance, ranks } => {
                assert_eq!(instance, reg.instance());
                assert_eq!(ranks.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ask(&ToRegistry::Health), FromRegistry::Ok);
        // Garbage gets an error reply, and the registry keeps serving.
        let junk = request_bytes(
            "127.0.0.1",
            reg.port(),
            &Destination::registry(reg.port()),
            b"\xc1junk",
            t,
            MAX_MESSAGE_BYTES,
        )
        .unwrap();
        assert!(matches!(
            decode::<FromRegistry>(&junk, "r").unwrap(),
            FromRegistry::Error { .. }
        ));
        assert_eq!(ask(&ToRegistry::Health), FromRegistry::Ok);
    }
}
