//! `--discovery etcd://HOST:PORT --engine-id ID` for `kvxfer serve` and `kvxfer bench`: the
//! served prefill registers its ranks under one lease. In pull mode the bench's decode
//! resolves the engine id to rank 0's side channel, waits for it while it is away, and fails
//! the loads in flight from an instance that discovery reports gone or restarted. In push
//! mode it resolves the engine id to its bootstrap address, and its rooms learn the ranks
//! ("all registered") and the prefill's liveness from etcd instead of the bootstrap registry.

use std::time::Duration;

use super::config::BenchError;

/// Where the fleet is registered and which engine this is (or reads from).
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// `etcd://HOST:PORT[,HOST:PORT...]`.
    pub url: String,
    /// The cluster name (key prefix): engines only see their own cluster.
    pub cluster: String,
    /// `serve`: this prefill's engine id; `bench`: the prefill engine to read from.
    pub engine_id: String,
    /// The registration lease's time to live.
    pub ttl: Duration,
}

/// How long each etcd call may take.
#[cfg(feature = "etcd")]
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

#[cfg(feature = "etcd")]
mod imp {
    use std::sync::Arc;
    use std::time::Duration;

    use crossbeam_channel::Receiver;
    use kvxfer_core::pull::PullWorker;
    use kvxfer_core::push::{EtcdDirectory, PushPrefill, push_records};
    use kvxfer_discovery::etcd::{EtcdClient, Registrar, Watcher};
    use kvxfer_discovery::key::role_prefix;
    use kvxfer_discovery::{Change, RankIndex, RankKey, RankRecord, Role, World};

    use super::{BenchError, CALL_TIMEOUT, DiscoveryConfig};
    use crate::transports::AnyTransport;

    fn client(d: &DiscoveryConfig) -> Result<Arc<EtcdClient>, BenchError> {
        let c =
            EtcdClient::new(&d.url, CALL_TIMEOUT).map_err(|e| BenchError::Config(e.to_string()))?;
        Ok(Arc::new(c))
    }

    fn discovery_error(e: impl std::fmt::Display) -> BenchError {
        BenchError::Config(format!("discovery: {e}"))
    }

    /// Registers every prefill rank (one process: one lease) at `host`.
    pub fn register(
        d: &DiscoveryConfig,
        workers: &[PullWorker<AnyTransport>],
        host: &str,
    ) -> Result<Registrar, BenchError> {
        let tp = u32::try_from(workers.len()).map_err(discovery_error)?;
        let mut ranks = Vec::new();
        for (r, w) in (0u32..).zip(workers) {
            let rank = RankIndex {
                dp: 0,
                pp: 0,
                tp: r,
            };
            let key = RankKey::new(&d.cluster, Role::Prefill, &d.engine_id, rank)
                .map_err(discovery_error)?;
            let port = w
                .listener_port()
                .ok_or_else(|| discovery_error("a rank without a listener"))?;
            let record = RankRecord {
                instance: w.instance(),
                endpoint: format!("{host}:{port}"),
                layout: w.layout_digest().to_owned(),
                world: World { dp: 1, pp: 1, tp },
                push: None,
            };
            ranks.push((key, record));
        }
        Registrar::start(client(d)?, d.ttl, ranks).map_err(discovery_error)
    }

    /// Registers every push prefill rank (one process: one lease) under the instance id of
    /// the process's bootstrap registry, named by that registry's address `bootstrap`.
    pub fn register_push(
        d: &DiscoveryConfig,
        workers: &[PushPrefill<AnyTransport>],
        bootstrap: (&str, u16),
        instance: u64,
    ) -> Result<Registrar, BenchError> {
        let infos: Vec<_> = workers.iter().map(|w| w.rank_info().clone()).collect();
        let addr = (bootstrap.0.to_owned(), bootstrap.1);
        let records = push_records(&d.cluster, &d.engine_id, &addr, instance, &infos)
            .map_err(discovery_error)?;
        Registrar::start(client(d)?, d.ttl, records).map_err(discovery_error)
    }

    /// A push decode's directory of the cluster's prefills.
    pub fn push_directory(d: &DiscoveryConfig) -> Result<Arc<EtcdDirectory>, BenchError> {
        let dir = EtcdDirectory::start(client(d)?, &d.cluster).map_err(discovery_error)?;
        Ok(Arc::new(dir))
    }

    /// The decode's view of the prefill engine it reads from.
    pub struct Resolver {
        watcher: Watcher,
        changes: Receiver<Change>,
        engine_id: String,
    }

    impl Resolver {
        /// Starts watching the cluster's prefill engines.
        pub fn start(d: &DiscoveryConfig) -> Result<Resolver, BenchError> {
            let prefix = role_prefix(&d.cluster, Role::Prefill);
            let (watcher, changes) = Watcher::start(client(d)?, prefix).map_err(discovery_error)?;
            Ok(Resolver {
                watcher,
                changes,
                engine_id: d.engine_id.clone(),
            })
        }

        /// Rank 0's side channel once the engine is whole, waiting up to `wait`.
        pub fn endpoint(&self, wait: Duration) -> Result<(String, u16), BenchError> {
            let view = self
                .watcher
                .wait_engine(Role::Prefill, &self.engine_id, wait)
                .ok_or_else(|| {
                    discovery_error(format!(
                        "prefill engine {:?} is not registered (all its ranks) after {wait:?}",
                        self.engine_id
                    ))
                })?;
            let rank0 = RankIndex {
                dp: 0,
                pp: 0,
                tp: 0,
            };
            let endpoint = &view
                .rank(rank0)
                .ok_or_else(|| discovery_error("no rank 0"))?
                .endpoint;
            let (host, port) = endpoint
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
                .ok_or_else(|| discovery_error(format!("a malformed endpoint {endpoint:?}")))?;
            Ok((host, port))
        }

        /// The engine read from.
        pub fn engine_id(&self) -> &str {
            &self.engine_id
        }

        /// Rank 0's instance id while the engine is whole.
        pub fn instance(&self) -> Option<u64> {
            let view = self.watcher.engine(Role::Prefill, &self.engine_id)?;
            view.rank(RankIndex {
                dp: 0,
                pp: 0,
                tp: 0,
            })
            .map(|r| r.instance)
        }

        /// After requests failed on `instance`, waits (as a router would before sending it
        /// more) until discovery shows something else — the engine gone or a new instance —
        /// or `wait` passes with the same instance still registered (a failure that was not
        /// the engine's death).
        pub fn settle(&self, instance: Option<u64>, wait: Duration) {
            let deadline = std::time::Instant::now() + wait;
            while self.instance() == instance && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }

        /// Why the engine was lost since the last call, if it was (each loss once).
        pub fn lost(&self) -> Vec<String> {
            self.changes
                .try_iter()
                .filter_map(|c| match c {
                    Change::Lost {
                        engine_id, reason, ..
                    } if engine_id == self.engine_id => Some(reason),
                    _ => None,
                })
                .collect()
        }
    }
}

#[cfg(not(feature = "etcd"))]
mod imp {
    use std::time::Duration;

    use kvxfer_core::pull::PullWorker;

    use super::{BenchError, DiscoveryConfig};
    use crate::transports::AnyTransport;

    fn unsupported() -> BenchError {
        BenchError::Config("--discovery needs kvxfer built with `--features etcd`".into())
    }

    /// Without the etcd feature: refused.
    pub struct Registrar;

    /// Without the etcd feature: refused.
    pub fn register(
        _: &DiscoveryConfig,
        _: &[PullWorker<AnyTransport>],
        _: &str,
    ) -> Result<Registrar, BenchError> {
        Err(unsupported())
    }

    /// Without the etcd feature: refused.
    pub fn register_push(
        _: &DiscoveryConfig,
        _: &[kvxfer_core::push::PushPrefill<AnyTransport>],
        _: (&str, u16),
        _: u64,
    ) -> Result<Registrar, BenchError> {
        Err(unsupported())
    }

    /// Without the etcd feature: refused.
    pub fn push_directory(_: &DiscoveryConfig) -> Result<std::sync::Arc<Directory>, BenchError> {
        Err(unsupported())
    }

    /// Without the etcd feature: never made.
    #[derive(Debug)]
    pub struct Directory;

    impl kvxfer_core::push::PrefillDirectory for Directory {
        fn query(
            &self,
            _: &kvxfer_core::push::Addr,
            _: Duration,
        ) -> Result<kvxfer_core::push::messages::FromRegistry, String> {
            Err("never made".into())
        }
        fn alive(&self, _: &kvxfer_core::push::Addr, _: Duration) -> bool {
            false
        }
        fn source(&self) -> String {
            String::new()
        }
    }

    impl Directory {
        /// Never reached.
        pub fn resolve(&self, _: &str, _: Duration) -> Result<kvxfer_core::push::Addr, String> {
            Err("never made".into())
        }
    }

    /// Without the etcd feature: refused.
    pub struct Resolver;

    impl Resolver {
        /// Refused.
        pub fn start(_: &DiscoveryConfig) -> Result<Resolver, BenchError> {
            Err(unsupported())
        }
        /// Never reached.
        pub fn endpoint(&self, _: Duration) -> Result<(String, u16), BenchError> {
            Err(unsupported())
        }
        /// Never reached.
        pub fn engine_id(&self) -> &str {
            ""
        }
        /// Never reached.
        pub fn instance(&self) -> Option<u64> {
            None
        }
        /// Never reached.
        pub fn settle(&self, _: Option<u64>, _: Duration) {}
        /// Never reached.
        pub fn lost(&self) -> Vec<String> {
            Vec::new()
        }
    }
}

pub(super) use imp::{Resolver, push_directory, register, register_push};

/// Refuses to register an address peers cannot reach: the host a served prefill binds is the
/// one its records name.
pub(super) fn check_registered_host(host: &str) -> Result<(), BenchError> {
    let unspecified = host
        .trim_matches(|c| c == '[' || c == ']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if unspecified {
        return Err(BenchError::Config(format!(
            "with --discovery, --host is registered for peers to reach: give an address of \
             this host, not {host}"
        )));
    }
    Ok(())
}

/// Refuses what discovery does not combine with.
pub(super) fn check(d: &DiscoveryConfig, connect: bool) -> Result<(), BenchError> {
    if connect {
        return Err(BenchError::Config(
            "--discovery and --connect both name the prefill: give one".into(),
        ));
    }
    if d.engine_id.is_empty() {
        return Err(BenchError::Config("--discovery needs --engine-id".into()));
    }
    Ok(())
}
