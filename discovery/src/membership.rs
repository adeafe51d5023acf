//! The fleet as the store shows it, and the changes that matter to a peer: an engine becomes
//! whole (every rank of its world registered), or the engine a peer knew is no longer the same
//! (a rank gone, restarted under a new instance, or re-registered with another record).
//!
//! Backend-neutral and clock-free: it is fed the store's keys and values (a full snapshot on
//! every resync, single puts and deletes in between) and never trusts them: a key or record
//! that does not parse is counted and ignored.

use std::collections::{BTreeMap, BTreeSet};

use crate::key::{RankIndex, RankKey, Role};
use crate::record::{RankRecord, World};

/// An engine with every rank of its world registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineView {
    /// The engine's side.
    pub role: Role,
    /// The engine's id.
    pub engine_id: String,
    /// Its parallel sizes.
    pub world: World,
    /// Every rank's record, in (dp, pp, tp) order.
    pub ranks: Vec<(RankIndex, RankRecord)>,
}

impl EngineView {
    /// The record of one rank.
    pub fn rank(&self, rank: RankIndex) -> Option<&RankRecord> {
        self.ranks
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, rec)| rec)
    }
}

/// A change a peer acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The engine is whole: connect to it.
    Ready(EngineView),
    /// The engine last announced ready is not there as it was: drop everything derived from
    /// it and fail what is in flight with it.
    Lost {
        /// The engine's side.
        role: Role,
        /// The engine's id.
        engine_id: String,
        /// What happened, for the log and the failed loads.
        reason: String,
    },
}

type EngineKey = (Role, String);

/// The store's view of the fleet.
#[derive(Debug, Default)]
pub struct Membership {
    engines: BTreeMap<EngineKey, BTreeMap<RankIndex, RankRecord>>,
    /// The engines last announced ready, as they were.
    announced: BTreeMap<EngineKey, EngineView>,
    ignored: u64,
}

impl Membership {
    /// An empty view.
    pub fn new() -> Membership {
        Membership::default()
    }

    /// A key was written.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Vec<Change> {
        let Some((k, rec)) = self.parse(key, value) else {
            // A key we cannot read may have replaced a record we could: forget that one.
            return match RankKey::parse(key) {
                Some(k) => self.delete_parsed(&k),
                None => Vec::new(),
            };
        };
        let ek = (k.role, k.engine_id);
        self.engines
            .entry(ek.clone())
            .or_default()
            .insert(k.rank, rec);
        self.settle(ek)
    }

    /// A key was deleted (or expired with its lease).
    pub fn delete(&mut self, key: &[u8]) -> Vec<Change> {
        match RankKey::parse(key) {
            Some(k) => self.delete_parsed(&k),
            None => Vec::new(),
        }
    }

    /// Replaces the whole view by a snapshot of every key (after a compaction or a lost
    /// stream), with the changes since the last view.
    pub fn resync<'a>(
        &mut self,
        kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    ) -> Vec<Change> {
        let mut engines: BTreeMap<EngineKey, BTreeMap<RankIndex, RankRecord>> = BTreeMap::new();
        for (key, value) in kvs {
            if let Some((k, rec)) = self.parse(key, value) {
                engines
                    .entry((k.role, k.engine_id))
                    .or_default()
                    .insert(k.rank, rec);
            }
        }
        let touched: BTreeSet<EngineKey> =
            self.engines.keys().chain(engines.keys()).cloned().collect();
        self.engines = engines;
        touched.into_iter().flat_map(|ek| self.settle(ek)).collect()
    }

    /// An engine, if it is whole.
    pub fn engine(&self, role: Role, engine_id: &str) -> Option<&EngineView> {
        self.announced.get(&(role, engine_id.to_owned()))
    }

    /// Every whole engine.
    pub fn engines(&self) -> impl Iterator<Item = &EngineView> {
        self.announced.values()
    }

    /// Every engine of `role` with at least one rank registered, whole or not: its id and
    /// the ranks registered so far.
    pub fn registered(
        &self,
        role: Role,
    ) -> impl Iterator<Item = (&str, &BTreeMap<RankIndex, RankRecord>)> {
        self.engines
            .iter()
            .filter(move |((r, _), _)| *r == role)
            .map(|((_, id), ranks)| (id.as_str(), ranks))
    }

    /// Keys or records seen that did not parse (ignored).
    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    fn parse(&mut self, key: &[u8], value: &[u8]) -> Option<(RankKey, RankRecord)> {
        let parsed = RankKey::parse(key)
            .and_then(|k| RankRecord::decode(value, k.rank).ok().map(|r| (k, r)));
        if parsed.is_none() {
            self.ignored = self.ignored.saturating_add(1);
            tracing::warn!(key = %String::from_utf8_lossy(key), "discovery: ignored a key or record this version cannot read");
        }
        parsed
    }

    fn delete_parsed(&mut self, k: &RankKey) -> Vec<Change> {
        let ek = (k.role, k.engine_id.clone());
        if let Some(ranks) = self.engines.get_mut(&ek) {
            ranks.remove(&k.rank);
            if ranks.is_empty() {
                self.engines.remove(&ek);
            }
        }
        self.settle(ek)
    }

    /// Compares what `ek` is now with what was announced, and announces the difference.
    fn settle(&mut self, ek: EngineKey) -> Vec<Change> {
        let now = self.engines.get(&ek).and_then(|ranks| whole(&ek, ranks));
        let before = self.announced.get(&ek);
        if before == now.as_ref() {
            return Vec::new();
        }
        let mut changes = Vec::new();
        if let Some(before) = self.announced.remove(&ek) {
            changes.push(Change::Lost {
                role: ek.0,
                engine_id: ek.1.clone(),
                reason: lost_reason(&before, self.engines.get(&ek)),
            });
        }
        if let Some(now) = now {
            self.announced.insert(ek, now.clone());
            changes.push(Change::Ready(now));
        }
        changes
    }
}

/// The engine's view when every rank of one world is registered (and no rank outside it).
fn whole(ek: &EngineKey, ranks: &BTreeMap<RankIndex, RankRecord>) -> Option<EngineView> {
    let world = ranks.values().next()?.world;
    let all_agree = ranks.values().all(|r| r.world == world);
    let count = u32::try_from(ranks.len()).ok()?;
    (all_agree && Some(count) == world.ranks()).then(|| EngineView {
        role: ek.0,
        engine_id: ek.1.clone(),
        world,
        ranks: ranks.iter().map(|(k, v)| (*k, v.clone())).collect(),
    })
}

fn lost_reason(before: &EngineView, now: Option<&BTreeMap<RankIndex, RankRecord>>) -> String {
    for (rank, old) in &before.ranks {
        match now.and_then(|n| n.get(rank)) {
            None => return format!("rank {rank} deregistered (its lease expired or it stopped)"),
            Some(new) if new.instance != old.instance => {
                return format!(
                    "rank {rank} restarted (instance {:016x} -> {:016x})",
                    old.instance, new.instance
                );
            }
            Some(new) if new != old => return format!("rank {rank} registered a new record"),
            Some(_) => {}
        }
    }
    "its ranks no longer form one world".into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(engine: &str, tp: u32) -> Vec<u8> {
        RankKey::new("c", Role::Prefill, engine, RankIndex { dp: 0, pp: 0, tp })
            .unwrap()
            .to_key()
            .into_bytes()
    }

    fn rec(instance: u64, tp_size: u32) -> Vec<u8> {
        RankRecord {
            instance,
            endpoint: format!("h:{instance}"),
            layout: "L".into(),
            world: World {
                dp: 1,
                pp: 1,
                tp: tp_size,
            },
            push: None,
        }
        .encode()
    }

    fn ready(c: &Change) -> &str {
        match c {
            Change::Ready(v) => &v.engine_id,
            other => panic!("expected Ready, got {other:?}"),
        }
    }

    fn lost(c: &Change) -> (&str, &str) {
        match c {
            Change::Lost {
                engine_id, reason, ..
            } => (engine_id, reason),
            other => panic!("expected Lost, got {other:?}"),
        }
    }

    #[test]
    fn an_engine_is_ready_once_every_rank_registered() {
        let mut m = Membership::new();
        assert!(m.put(&key("p", 0), &rec(1, 2)).is_empty());
        assert!(m.engine(Role::Prefill, "p").is_none());
        let c = m.put(&key("p", 1), &rec(2, 2));
        assert_eq!(c.len(), 1);
        assert_eq!(ready(&c[0]), "p");
        let v = m.engine(Role::Prefill, "p").unwrap();
        assert_eq!(v.ranks.len(), 2);
        assert_eq!(
            v.rank(RankIndex {
                dp: 0,
                pp: 0,
                tp: 1
            })
            .unwrap()
            .instance,
            2
        );
        assert!(m.engine(Role::Decode, "p").is_none());
        // The same record written again changes nothing.
        assert!(m.put(&key("p", 1), &rec(2, 2)).is_empty());
    }

    #[test]
    fn registered_lists_partial_engines_of_one_role() {
        let mut m = Membership::new();
        m.put(&key("p", 0), &rec(1, 2));
        let d = RankKey::new(
            "c",
            Role::Decode,
            "d",
            RankIndex {
                dp: 0,
                pp: 0,
                tp: 0,
            },
        );
        m.put(d.unwrap().to_key().as_bytes(), &rec(2, 1));
        let listed = |m: &Membership| -> Vec<(String, Vec<u32>)> {
            m.registered(Role::Prefill)
                .map(|(id, r)| (id.to_owned(), r.keys().map(|k| k.tp).collect()))
                .collect()
        };
        assert_eq!(listed(&m), vec![("p".to_owned(), vec![0])]);
        m.put(&key("p", 1), &rec(3, 2));
        assert_eq!(listed(&m), vec![("p".to_owned(), vec![0, 1])]);
        m.delete(&key("p", 0));
        m.delete(&key("p", 1));
        assert!(
            listed(&m).is_empty(),
            "an engine with no rank left is not listed"
        );
        assert_eq!(m.registered(Role::Decode).count(), 1);
    }

    #[test]
    fn a_rank_gone_loses_the_engine_and_its_return_readies_it() {
        let mut m = Membership::new();
        m.put(&key("p", 0), &rec(1, 1));
        let c = m.delete(&key("p", 0));
        assert_eq!(c.len(), 1);
        let (e, why) = lost(&c[0]);
        assert_eq!(e, "p");
        assert!(why.contains("rank 0.0.0 deregistered"), "{why}");
        assert!(m.engine(Role::Prefill, "p").is_none());
        assert!(m.delete(&key("p", 0)).is_empty());
        assert_eq!(ready(&m.put(&key("p", 0), &rec(3, 1))[0]), "p");
    }

    #[test]
    fn a_new_instance_is_a_loss_then_a_new_engine() {
        let mut m = Membership::new();
        m.put(&key("p", 0), &rec(1, 1));
        let c = m.put(&key("p", 0), &rec(9, 1));
        assert_eq!(c.len(), 2);
        let (_, why) = lost(&c[0]);
        assert!(
            why.contains("restarted (instance 0000000000000001 -> 0000000000000009)"),
            "{why}"
        );
        assert_eq!(ready(&c[1]), "p");
        assert_eq!(m.engine(Role::Prefill, "p").unwrap().ranks[0].1.instance, 9);
    }

    #[test]
    fn a_rank_of_a_multi_rank_engine_restarting_loses_the_engine_until_it_is_back() {
        let mut m = Membership::new();
        m.put(&key("p", 0), &rec(1, 2));
        m.put(&key("p", 1), &rec(2, 2));
        let c = m.delete(&key("p", 1));
        assert_eq!(lost(&c[0]).0, "p");
        assert_eq!(c.len(), 1);
        assert!(m.engine(Role::Prefill, "p").is_none());
        assert_eq!(ready(&m.put(&key("p", 1), &rec(5, 2))[0]), "p");
    }

    #[test]
    fn disagreeing_worlds_never_make_an_engine() {
        let mut m = Membership::new();
        m.put(&key("p", 0), &rec(1, 2));
        // Rank 1 claims a world of 3 ranks: two registered, neither world complete.
        assert!(m.put(&key("p", 1), &rec(2, 3)).is_empty());
        assert!(m.engine(Role::Prefill, "p").is_none());
    }

    #[test]
    fn unreadable_keys_and_records_are_ignored_and_counted() {
        let mut m = Membership::new();
        assert!(
            m.put(b"/kvxfer/v1/c/engines/prefill/p/ranks/x", &rec(1, 1))
                .is_empty()
        );
        assert!(m.put(&key("p", 0), b"{}").is_empty());
        assert!(m.put(&key("p", 3), &rec(1, 2)).is_empty()); // rank outside its world
        assert!(m.delete(b"\xff").is_empty());
        assert_eq!(m.ignored(), 3);
        // A record replaced by garbage is no longer trusted.
        m.put(&key("q", 0), &rec(1, 1));
        assert_eq!(lost(&m.put(&key("q", 0), b"garbage")[0]).0, "q");
    }

    #[test]
    fn a_resync_reports_only_what_changed() {
        let mut m = Membership::new();
        m.put(&key("same", 0), &rec(1, 1));
        m.put(&key("gone", 0), &rec(2, 1));
        m.put(&key("restarted", 0), &rec(3, 1));
        let (k1, k3, k4) = (key("same", 0), key("restarted", 0), key("new", 0));
        let (v1, v3, v4) = (rec(1, 1), rec(33, 1), rec(4, 1));
        let c = m.resync([(&k1[..], &v1[..]), (&k3[..], &v3[..]), (&k4[..], &v4[..])]);
        let mut seen: Vec<String> = c
            .iter()
            .map(|c| match c {
                Change::Ready(v) => format!("ready {}", v.engine_id),
                Change::Lost { engine_id, .. } => format!("lost {engine_id}"),
            })
            .collect();
        seen.sort();
        assert_eq!(
            seen,
            [
                "lost gone",
                "lost restarted",
                "ready new",
                "ready restarted"
            ]
        );
        assert_eq!(m.engines().count(), 3);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, u8, u8),
        Delete(u8, u8),
        Resync,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3u8, 0..3u8, 0..4u8).prop_map(|(e, r, i)| Op::Put(e, r, i)),
            (0..3u8, 0..3u8).prop_map(|(e, r)| Op::Delete(e, r)),
            Just(Op::Resync),
        ]
    }

    proptest! {
        /// Against a plain map of the store: the changes replayed by a listener always leave
        /// it knowing exactly the engines the store holds whole, with their current records,
        /// whether it saw single events or resyncs.
        #[test]
        fn changes_track_the_store(ops in proptest::collection::vec(op(), 1..60)) {
            let mut store: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            let mut m = Membership::new();
            let mut listener: BTreeMap<String, EngineView> = BTreeMap::new();
            for op in ops {
                let changes = match op {
                    Op::Put(e, r, i) => {
                        // Engine e has e+1 ranks; instance i.
                        let (k, v) = (key(&format!("e{e}"), u32::from(r)), rec(u64::from(i), u32::from(e) + 1));
                        store.insert(k.clone(), v.clone());
                        m.put(&k, &v)
                    }
                    Op::Delete(e, r) => {
                        let k = key(&format!("e{e}"), u32::from(r));
                        store.remove(&k);
                        m.delete(&k)
                    }
                    Op::Resync => m.resync(store.iter().map(|(k, v)| (&k[..], &v[..]))),
                };
                for c in changes {
                    match c {
                        Change::Ready(v) => {
                            prop_assert!(!listener.contains_key(&v.engine_id), "ready twice without a loss");
                            listener.insert(v.engine_id.clone(), v);
                        }
                        Change::Lost { engine_id, .. } => {
                            prop_assert!(listener.remove(&engine_id).is_some(), "lost what was not ready");
                        }
                    }
                }
                let mut expect = Membership::new();
                expect.resync(store.iter().map(|(k, v)| (&k[..], &v[..])));
                let want: BTreeMap<String, EngineView> =
                    expect.engines().map(|v| (v.engine_id.clone(), v.clone())).collect();
                prop_assert_eq!(&listener, &want);
            }
        }
    }
}
