//! State one loopback agent shares with its peers and its copy workers: registered regions
//! (pinned by in-flight copies), the notification inbox, and liveness. Agents find each other
//! through a process-wide directory keyed by the uid in their metadata; callers never see it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use kvxfer_core::transport::checks::new_region;
use kvxfer_core::transport::{Deregister, RegistrationId};
use kvxfer_core::{AddrRange, MemoryKind, Notification, TransportError};

/// A registered region. Copies pin it (`inflight`) so deregistration can wait for them.
#[derive(Debug)]
pub struct Region {
    pub id: u64,
    pub kind: MemoryKind,
    pub range: AddrRange,
    alive: AtomicBool,
    inflight: AtomicUsize,
    idle_lock: Mutex<()>,
    idle: Condvar,
}

impl Region {
    /// Pins the region for a copy; fails if it was deregistered.
    pub fn pin(self: &Arc<Self>) -> Option<Pin> {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.alive.load(Ordering::SeqCst) {
            Some(Pin(Arc::clone(self)))
        } else {
            self.unpin();
            None
        }
    }

    fn unpin(&self) {
        if self.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _guard = self.idle_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.idle.notify_all();
        }
    }
}

/// Keeps a region registered while a copy uses it.
#[derive(Debug)]
pub struct Pin(Arc<Region>);

impl Drop for Pin {
    fn drop(&mut self) {
        self.0.unpin();
    }
}

/// What an agent shares.
#[derive(Debug)]
pub struct AgentShared {
    pub name: String,
    pub uid: u64,
    regions: RwLock<Vec<Arc<Region>>>,
    inbox: Mutex<Vec<Notification>>,
    alive: AtomicBool,
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

fn directory() -> &'static Mutex<HashMap<u64, Weak<AgentShared>>> {
    static DIR: OnceLock<Mutex<HashMap<u64, Weak<AgentShared>>>> = OnceLock::new();
    DIR.get_or_init(|| Mutex::new(HashMap::new()))
}

impl AgentShared {
    /// A new agent, entered in the directory.
    pub fn new(name: &str) -> Arc<Self> {
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let agent = Arc::new(AgentShared {
            name: name.to_string(),
            uid,
            regions: RwLock::new(Vec::new()),
            inbox: Mutex::new(Vec::new()),
            alive: AtomicBool::new(true),
        });
        let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
        dir.retain(|_, w| w.strong_count() > 0);
        dir.insert(uid, Arc::downgrade(&agent));
        agent
    }

    /// Finds a live agent by uid.
    pub fn lookup(uid: u64) -> Option<Arc<Self>> {
        let dir = directory().lock().unwrap_or_else(|e| e.into_inner());
        dir.get(&uid)
            .and_then(Weak::upgrade)
            .filter(|a| a.is_alive())
    }

    /// True until the agent is dropped or made to vanish.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Removes the agent from the directory; its peers' transfers to it fail from now on.
    pub fn vanish(&self) {
        self.alive.store(false, Ordering::SeqCst);
        let mut dir = directory().lock().unwrap_or_else(|e| e.into_inner());
        dir.remove(&self.uid);
    }

    /// Adds a region; refuses empty ranges, wrap-around and overlaps.
    pub fn add_region(
        &self,
        id: u64,
        kind: MemoryKind,
        range: AddrRange,
    ) -> Result<(), TransportError> {
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        new_region(range, regions.iter().map(|r| r.range))?;
        let region = Arc::new(Region {
            id,
            kind,
            range,
            alive: AtomicBool::new(true),
            inflight: AtomicUsize::new(0),
            idle_lock: Mutex::new(()),
            idle: Condvar::new(),
        });
        let at = regions.partition_point(|r| r.range.addr < range.addr);
        regions.insert(at, region);
        Ok(())
    }

    /// The live region of `kind` that contains `range`.
    pub fn find(&self, kind: MemoryKind, range: &AddrRange) -> Option<Arc<Region>> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let at = regions.partition_point(|r| r.range.addr <= range.addr);
        let r = regions.get(at.checked_sub(1)?)?;
        (r.kind == kind && r.range.contains(range)).then(|| Arc::clone(r))
    }

    /// Snapshot of the registered regions, for metadata.
    pub fn regions(&self) -> Vec<(MemoryKind, AddrRange)> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        regions.iter().map(|r| (r.kind, r.range)).collect()
    }

    /// Delivers a notification.
    pub fn deliver(&self, note: Notification) {
        self.inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(note);
    }

    /// Takes every notification received.
    pub fn drain(&self, out: &mut Vec<Notification>) -> usize {
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        let n = inbox.len();
        out.append(&mut inbox);
        n
    }
}

impl Deregister for AgentShared {
    fn deregister(&self, id: RegistrationId) {
        let removed = {
            let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
            let at = regions.iter().position(|r| r.id == id.0);
            at.map(|i| regions.remove(i))
        };
        let Some(region) = removed else { return };
        region.alive.store(false, Ordering::SeqCst);
        // Copies in flight finish in memcpy time; wait for them so the caller may free the
        // memory. Report (never hide) a wait that takes unusually long.
        let mut guard = region.idle_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut waited = 0u64;
        while region.inflight.load(Ordering::SeqCst) > 0 {
            let (g, timeout) = region
                .idle
                .wait_timeout(guard, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner());
            guard = g;
            if timeout.timed_out() {
                waited += 1;
                if waited % 10 == 0 {
                    tracing::warn!(agent = %self.name, region = id.0, waited_s = waited, "deregistration waits for in-flight copies");
                }
            }
        }
    }
}
