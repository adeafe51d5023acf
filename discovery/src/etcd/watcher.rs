//! Mirrors the keys under a prefix into a [`Membership`] and passes on its changes: a range
//! first, then a watch from the revision after it. After a compaction, a lost stream or an
//! unreachable etcd it ranges again (with back-off) and reports what changed meanwhile, so a
//! listener never misses a restart because it happened while the stream was down. While etcd
//! is unreachable the last view stays: running transfers are not failed for an outage of
//! the store.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded, unbounded};

use super::client::{EtcdClient, EtcdError, WatchItem};
use crate::key::{RankIndex, Role};
use crate::membership::{Change, EngineView, Membership};
use crate::record::RankRecord;

/// How long one read of the stream waits before the thread checks whether to stop.
const POLL: Duration = Duration::from_millis(100);
/// A silent stream this long makes the watcher check that etcd still answers: a cut
/// connection can stay silent for as long as TCP retries.
const PROBE_AFTER: Duration = Duration::from_secs(2);
/// The first pause before a resync after a failure; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// How the watch is doing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchStatus {
    /// Whether the stream is open on current data.
    pub connected: bool,
    /// The last revision seen.
    pub revision: i64,
    /// Full ranges made (1 after start).
    pub resyncs: u64,
    /// Of which after a compaction.
    pub compactions: u64,
    /// Events received.
    pub events: u64,
    /// The last failure.
    pub last_error: Option<String>,
}

struct Shared {
    membership: Membership,
    status: WatchStatus,
}

/// Watches one prefix; dropping it stops the watch.
pub struct Watcher {
    shared: Arc<Mutex<Shared>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Ranges `prefix` (failing with etcd's or the connection's error when that first range
    /// does), then watches it on a thread. The receiver gets every change, starting with one
    /// `Ready` per engine already whole.
    pub fn start(
        client: Arc<EtcdClient>,
        prefix: String,
    ) -> Result<(Watcher, Receiver<Change>), EtcdError> {
        let (tx, rx) = unbounded();
        let shared = Arc::new(Mutex::new(Shared {
            membership: Membership::new(),
            status: WatchStatus::default(),
        }));
        let revision = resync(&client, &prefix, &shared, &tx)?;
        let (stop, stopped) = bounded(1);
        let run = Run {
            client,
            prefix,
            shared: shared.clone(),
            tx,
        };
        let thread = std::thread::Builder::new()
            .name("kvx-etcd-watch".into())
            .spawn(move || run.run(revision, &stopped))
            .map_err(|e| EtcdError::Protocol {
                call: "watch",
                detail: format!("cannot start the watch thread: {e}"),
            })?;
        Ok((
            Watcher {
                shared,
                stop: Some(stop),
                thread: Some(thread),
            },
            rx,
        ))
    }

    /// An engine, if it is whole.
    pub fn engine(&self, role: Role, engine_id: &str) -> Option<EngineView> {
        self.lock().membership.engine(role, engine_id).cloned()
    }

    /// Every whole engine.
    pub fn engines(&self) -> Vec<EngineView> {
        self.lock().membership.engines().cloned().collect()
    }

    /// Every engine of `role` with a rank registered, whole or not, with those ranks.
    pub fn registered(&self, role: Role) -> Vec<(String, Vec<(RankIndex, RankRecord)>)> {
        let shared = self.lock();
        shared
            .membership
            .registered(role)
            .map(|(id, ranks)| {
                let ranks = ranks.iter().map(|(k, r)| (*k, r.clone())).collect();
                (id.to_owned(), ranks)
            })
            .collect()
    }

    /// How the watch is doing.
    pub fn status(&self) -> WatchStatus {
        self.lock().status.clone()
    }

    /// Keys or records seen that could not be read.
    pub fn ignored(&self) -> u64 {
        self.lock().membership.ignored()
    }

    /// Waits up to `timeout` for `engine_id` to be whole (push mode's "all ranks registered").
    pub fn wait_engine(
        &self,
        role: Role,
        engine_id: &str,
        timeout: Duration,
    ) -> Option<EngineView> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if let Some(v) = self.engine(role, engine_id) {
                return Some(v);
            }
            let left = deadline.map_or(POLL, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                return None;
            }
            std::thread::sleep(POLL.min(left));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Ranges the prefix into the membership, sends what changed; returns the revision read at.
/// The range runs without the lock: lookups keep the last view while etcd is slow to answer.
fn resync(
    client: &EtcdClient,
    prefix: &str,
    shared: &Mutex<Shared>,
    tx: &Sender<Change>,
) -> Result<i64, EtcdError> {
    let (revision, kvs) = client.range_prefix(prefix.as_bytes())?;
    let mut shared = shared.lock().unwrap_or_else(PoisonError::into_inner);
    let changes = shared
        .membership
        .resync(kvs.iter().map(|kv| (&kv.key[..], &kv.value[..])));
    shared.status.revision = revision;
    shared.status.resyncs = shared.status.resyncs.saturating_add(1);
    shared.status.connected = true;
    for c in changes {
        let _ = tx.send(c);
    }
    Ok(revision)
}

struct Run {
    client: Arc<EtcdClient>,
    prefix: String,
    shared: Arc<Mutex<Shared>>,
    tx: Sender<Change>,
}

enum Ended {
    Stopped,
    /// Resync, then watch again.
    Lost(String),
    Compacted,
}

impl Run {
    fn run(self, mut revision: i64, stop: &Receiver<()>) {
        let mut backoff = FIRST_BACKOFF;
        let pause = |backoff: &mut Duration| {
            let stopped = !matches!(stop.recv_timeout(*backoff), Err(RecvTimeoutError::Timeout));
            *backoff = backoff.saturating_mul(2).min(MAX_BACKOFF);
            stopped
        };
        loop {
            let (ended, healthy) = self.watch(revision.saturating_add(1), stop);
            if healthy {
                backoff = FIRST_BACKOFF;
            }
            match ended {
                Ended::Stopped => return,
                Ended::Compacted => {
                    tracing::info!(prefix = %self.prefix, "discovery: watch history compacted: resyncing");
                    self.update(|s| s.compactions = s.compactions.saturating_add(1));
                }
                Ended::Lost(why) => {
                    tracing::warn!(prefix = %self.prefix, %why, "discovery: watch lost: resyncing");
                    self.update(|s| {
                        s.connected = false;
                        s.last_error = Some(why);
                    });
                    // A stream that opens and dies at once must not spin.
                    if pause(&mut backoff) {
                        return;
                    }
                }
            }
            // Range again until etcd answers, keeping the last view meanwhile.
            loop {
                match resync(&self.client, &self.prefix, &self.shared, &self.tx) {
                    Ok(rev) => {
                        revision = rev;
                        break;
                    }
                    Err(e) => {
                        self.update(|s| {
                            s.connected = false;
                            s.last_error = Some(e.to_string());
                        });
                        if pause(&mut backoff) {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Reads one watch stream until it ends; also says whether it was healthy (delivered
    /// events, or stayed open past a probe), which resets the back-off.
    fn watch(&self, from: i64, stop: &Receiver<()>) -> (Ended, bool) {
        let mut stream = match self.client.watch(self.prefix.as_bytes(), from) {
            Ok(s) => s,
            Err(e) => return (Ended::Lost(e.to_string()), false),
        };
        let mut healthy = false;
        let mut quiet_since = Instant::now();
        loop {
            if !matches!(stop.try_recv(), Err(crossbeam_channel::TryRecvError::Empty)) {
                return (Ended::Stopped, healthy);
            }
            match stream.next(POLL) {
                WatchItem::Changes(r) => {
                    quiet_since = Instant::now();
                    if r.compact_revision > 0 {
                        return (Ended::Compacted, healthy);
                    }
                    if r.canceled {
                        let why = format!("etcd canceled the watch: {}", r.cancel_reason);
                        return (Ended::Lost(why), healthy);
                    }
                    healthy |= !r.events.is_empty();
                    self.apply(r);
                }
                WatchItem::Idle => {
                    if quiet_since.elapsed() >= PROBE_AFTER {
                        // A cheap range of nothing: does etcd still answer?
                        if let Err(e) = self.client.range_prefix(b"\0kvxfer-probe\0") {
                            return (Ended::Lost(e.to_string()), healthy);
                        }
                        healthy = true;
                        quiet_since = Instant::now();
                    }
                }
                WatchItem::Lost(why) => return (Ended::Lost(why), healthy),
            }
        }
    }

    fn apply(&self, r: super::wire::WatchResponse) {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let mut changes = Vec::new();
        for ev in &r.events {
            changes.extend(if ev.kind == "DELETE" {
                shared.membership.delete(&ev.kv.key)
            } else {
                shared.membership.put(&ev.kv.key, &ev.kv.value)
            });
        }
        let s = &mut shared.status;
        s.events = s.events.saturating_add(r.events.len() as u64);
        s.revision = s.revision.max(r.header.revision);
        s.connected = true;
        // Sent under the lock: whoever sees the new view finds its changes queued.
        for c in changes {
            let _ = self.tx.send(c);
        }
    }

    fn update(&self, f: impl FnOnce(&mut WatchStatus)) {
        f(&mut self
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .status);
    }
}
