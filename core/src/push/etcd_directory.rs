//! Push mode's registry through etcd: each prefill rank registers a record (its mailbox as
//! the endpoint, the engine's bootstrap address and what its registry would answer, under
//! `push`), and a decode finds the prefill its rooms name by that bootstrap address among
//! the cluster's prefill engines. "All ranks registered" is the engine being whole in etcd;
//! "alive" is its ranks' leases holding.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvxfer_discovery::etcd::{EtcdClient, EtcdError, Watcher};
use kvxfer_discovery::key::role_prefix;
use kvxfer_discovery::{
    EngineView, Membership, PushRank, RankIndex, RankKey, RankRecord, Role, World,
};

use super::directory::{Addr, PrefillDirectory};
use super::messages::{FromRegistry, RankInfo};

/// How often [`EtcdDirectory::resolve`] looks again.
const POLL: Duration = Duration::from_millis(20);

/// A cluster's push prefills as etcd shows them.
pub struct EtcdDirectory {
    watcher: Watcher,
    cluster: String,
    /// For a read of etcd itself when the watch does not show an address yet.
    client: Arc<EtcdClient>,
    /// Lookups refused because two engines named one bootstrap address.
    ambiguous: AtomicU64,
}

impl std::fmt::Debug for EtcdDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDirectory")
            .field("cluster", &self.cluster)
            .finish()
    }
}

impl EtcdDirectory {
    /// Watches `cluster`'s prefill engines (a first read of them before returning).
    pub fn start(client: Arc<EtcdClient>, cluster: &str) -> Result<EtcdDirectory, EtcdError> {
        let (watcher, _changes) =
            Watcher::start(Arc::clone(&client), role_prefix(cluster, Role::Prefill))?;
        Ok(EtcdDirectory {
            watcher,
            cluster: cluster.to_owned(),
            client,
            ambiguous: AtomicU64::new(0),
        })
    }

    /// Lookups refused so far because more than one engine's ranks named the bootstrap
    /// address asked for.
    pub fn ambiguous_matches(&self) -> u64 {
        self.ambiguous.load(Ordering::Relaxed)
    }

    /// The bootstrap address of push prefill `engine_id`, once it is whole, waiting up to
    /// `wait` for it.
    pub fn resolve(&self, engine_id: &str, wait: Duration) -> Result<Addr, String> {
        let deadline = Instant::now().checked_add(wait);
        loop {
            let whole = self.watcher.engine(Role::Prefill, engine_id);
            if let Some((_, rank)) = whole.as_ref().and_then(|v| v.ranks.first()) {
                return parse_addr(&push_of(rank)?.bootstrap);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(format!(
                    "prefill engine {engine_id:?} is not registered (all its ranks) in etcd \
                     cluster {:?} after {wait:?}",
                    self.cluster
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// The whole engine whose ranks all name `addr` as their bootstrap address; an error
    /// when several do.
    fn whole(&self, addr: &str) -> Result<Option<EngineView>, String> {
        let engines = self.watcher.engines();
        self.only_one(addr, engines.into_iter())
    }

    /// The one prefill engine of `engines` whose ranks all name `addr`. Two engines naming
    /// one address is an error, logged and counted: whoever may write to etcd could
    /// otherwise register an engine that captures another's rooms (and the decodes' memory
    /// keys sent to its mailboxes), and the first match in key order would win.
    fn only_one<V: std::borrow::Borrow<EngineView>>(
        &self,
        addr: &str,
        engines: impl Iterator<Item = V>,
    ) -> Result<Option<V>, String> {
        let mut found = engines.filter(|v| {
            let v = v.borrow();
            v.role == Role::Prefill
                && !v.ranks.is_empty()
                && v.ranks.iter().all(|(_, r)| names(r, addr))
        });
        let first = found.next();
        let Some(second) = found.next() else {
            return Ok(first);
        };
        let first = first
            .map(|v| v.borrow().engine_id.clone())
            .unwrap_or_default();
        let why = format!(
            "prefill engines {first:?} and {:?} in {} both name bootstrap address {addr}: \
             refused as ambiguous",
            second.borrow().engine_id,
            self.source()
        );
        self.ambiguous.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("{why}");
        Err(why)
    }
}

impl PrefillDirectory for EtcdDirectory {
    fn query(&self, addr: &Addr, _timeout: Duration) -> Result<FromRegistry, String> {
        let want = format!("{}:{}", addr.0, addr.1);
        if let Some(v) = self.whole(&want)? {
            return layout(&v);
        }
        if let Some(answer) = not_ready(self.watcher.registered(Role::Prefill), &want) {
            return Ok(answer);
        }
        // No rank names it in the watch. A registration made a moment ago may not have
        // reached the watch yet: etcd itself decides (its answer only for this query; the
        // watch catches up for the next). No rank there either is an error, not a wait:
        // nothing registered there, or the prefill moved (a restarted SGLang prefill's
        // registry has a new port).
        let (_, kvs) = self
            .client
            .range_prefix(role_prefix(&self.cluster, Role::Prefill).as_bytes())
            .map_err(|e| format!("{}: {e}", self.source()))?;
        let mut fresh = Membership::new();
        for kv in &kvs {
            fresh.put(&kv.key, &kv.value);
        }
        if let Some(v) = self.only_one(&want, fresh.engines())? {
            return layout(v);
        }
        let registered = fresh.registered(Role::Prefill).map(|(id, ranks)| {
            let ranks: Vec<(RankIndex, RankRecord)> =
                ranks.iter().map(|(k, r)| (*k, r.clone())).collect();
            (id.to_owned(), ranks)
        });
        not_ready(registered.collect(), &want).ok_or_else(|| {
            format!(
                "no prefill rank in {} names bootstrap address {want}",
                self.source()
            )
        })
    }
    fn alive(&self, addr: &Addr, _timeout: Duration) -> bool {
        self.whole(&format!("{}:{}", addr.0, addr.1))
            .is_ok_and(|v| v.is_some())
    }
    fn source(&self) -> String {
        format!("etcd cluster {:?}", self.cluster)
    }
}

/// How far the registration of the engine at `addr` got (the engine with the most ranks
/// naming it), when any of its ranks is registered.
fn not_ready(
    engines: Vec<(String, Vec<(RankIndex, RankRecord)>)>,
    addr: &str,
) -> Option<FromRegistry> {
    engines
        .into_iter()
        .filter_map(|(_, ranks)| {
            let mine: Vec<_> = ranks.iter().filter(|(_, r)| names(r, addr)).collect();
            let world = mine.first()?.1.world.ranks()?;
            Some((u32::try_from(mine.len()).unwrap_or(u32::MAX), world))
        })
        .max()
        .map(|(registered, expected)| FromRegistry::NotReady {
            registered,
            expected,
        })
}

/// Whether `r` is a push rank of the engine known by bootstrap address `addr`.
fn names(r: &RankRecord, addr: &str) -> bool {
    r.push.as_ref().is_some_and(|p| p.bootstrap == addr)
}

fn push_of(r: &RankRecord) -> Result<&PushRank, String> {
    r.push
        .as_ref()
        .ok_or_else(|| format!("rank at {} registered no push fields", r.endpoint))
}

fn parse_addr(s: &str) -> Result<Addr, String> {
    s.rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
        .ok_or_else(|| format!("a malformed address {s:?} (host:port)"))
}

/// What the engine's bootstrap registry would answer: every rank, and one instance that
/// changes when any rank's process restarts.
fn layout(v: &EngineView) -> Result<FromRegistry, String> {
    let mut ranks = Vec::with_capacity(v.ranks.len());
    // FNV-1a over the ranks' instances, in rank order.
    let mut instance: u64 = 0xcbf2_9ce4_8422_2325;
    for (index, r) in &v.ranks {
        let p = push_of(r)?;
        let (host, port) = parse_addr(&r.endpoint)?;
        let info = RankInfo {
            agent: p.agent.clone(),
            tp_size: v.world.tp,
            tp_rank: index.tp,
            pp_size: v.world.pp,
            pp_rank: index.pp,
            dp_size: v.world.dp,
            dp_rank: index.dp,
            host,
            port,
            page_size: p.page_size,
            dtype: p.dtype.clone(),
            first_layer: p.first_layer,
            num_layers: p.num_layers,
        };
        info.check()
            .map_err(|e| format!("etcd record of rank {index}: {e}"))?;
        instance = (instance ^ r.instance).wrapping_mul(0x0100_0000_01b3);
        ranks.push(info);
    }
    Ok(FromRegistry::Layout { instance, ranks })
}

/// The records push prefill ranks `ranks` (of one engine, all in this process: one
/// `instance`) register under `engine_id`, named by bootstrap address `bootstrap`.
pub fn push_records(
    cluster: &str,
    engine_id: &str,
    bootstrap: &Addr,
    instance: u64,
    ranks: &[RankInfo],
) -> Result<Vec<(RankKey, RankRecord)>, String> {
    ranks
        .iter()
        .map(|info| {
            info.check()?;
            let index = RankIndex {
                dp: info.dp_rank,
                pp: info.pp_rank,
                tp: info.tp_rank,
            };
            let key = RankKey::new(cluster, Role::Prefill, engine_id, index)
                .map_err(|e| e.to_string())?;
            let record = RankRecord {
                instance,
                endpoint: format!("{}:{}", info.host, info.port),
                layout: String::new(),
                world: World {
                    dp: info.dp_size,
                    pp: info.pp_size,
                    tp: info.tp_size,
                },
                push: Some(PushRank {
                    bootstrap: format!("{}:{}", bootstrap.0, bootstrap.1),
                    agent: info.agent.clone(),
                    page_size: info.page_size,
                    dtype: info.dtype.clone(),
                    first_layer: info.first_layer,
                    num_layers: info.num_layers,
                }),
            };
            record.check().map_err(|e| e.to_string())?;
            Ok((key, record))
        })
        .collect()
}
