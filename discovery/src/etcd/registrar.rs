//! Keeps one process's ranks registered: one lease for all of them, renewed every third of
//! its TTL (two renewals may fail before the keys expire), registered again under a new lease
//! when the old one is gone, retried with back-off while etcd is unreachable, revoked on drop
//! so that a clean stop removes the keys at once instead of after the TTL.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};

use super::client::{EtcdClient, EtcdError, LeaseId};
use crate::key::RankKey;
use crate::record::RankRecord;

/// The shortest TTL accepted: etcd extends shorter leases to its own minimum anyway.
pub const MIN_TTL: Duration = Duration::from_secs(2);
/// The first pause after a failed renewal; it doubles up to a third of the TTL.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// How the registration is doing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistrarStatus {
    /// The current lease.
    pub lease: LeaseId,
    /// Whether the last call to etcd confirmed the keys are there.
    pub registered: bool,
    /// Lease renewals that succeeded.
    pub renewals: u64,
    /// Times the keys were written under a new lease (1 after start).
    pub registrations: u64,
    /// Calls to etcd that failed.
    pub failures: u64,
    /// The last failure.
    pub last_error: Option<String>,
}

/// A process's registration; dropping it deregisters.
pub struct Registrar {
    client: Arc<EtcdClient>,
    status: Arc<Mutex<RegistrarStatus>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Registrar {
    /// Registers `ranks` under a new lease of `ttl` (at least [`MIN_TTL`]) and keeps them
    /// registered. Fails, with etcd's or the connection's error, when the first registration
    /// does: an engine told to use discovery must not start invisible.
    pub fn start(
        client: Arc<EtcdClient>,
        ttl: Duration,
        ranks: Vec<(RankKey, RankRecord)>,
    ) -> Result<Registrar, EtcdError> {
        for (k, r) in &ranks {
            r.check().map_err(|e| EtcdError::Protocol {
                call: "register",
                detail: format!("{}: {e}", k.to_key()),
            })?;
        }
        let ttl = ttl.max(MIN_TTL);
        let lease = register(&client, ttl, &ranks)?;
        let status = Arc::new(Mutex::new(RegistrarStatus {
            lease,
            registered: true,
            registrations: 1,
            ..RegistrarStatus::default()
        }));
        let (stop, stopped) = bounded(1);
        let keeper = Keeper {
            client: client.clone(),
            status: status.clone(),
            ttl,
            ranks,
            lease,
        };
        let thread = std::thread::Builder::new()
            .name("kvx-etcd-lease".into())
            .spawn(move || keeper.run(&stopped))
            .map_err(|e| EtcdError::Protocol {
                call: "register",
                detail: format!("cannot start the lease thread: {e}"),
            })?;
        Ok(Registrar {
            client,
            status,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// How the registration is doing.
    pub fn status(&self) -> RegistrarStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let lease = self.status().lease;
        if let Err(e) = self.client.revoke(lease) {
            tracing::warn!(%e, "discovery: could not revoke the lease; the keys expire with its TTL");
        }
    }
}

/// A new lease with every rank's key on it.
fn register(
    client: &EtcdClient,
    ttl: Duration,
    ranks: &[(RankKey, RankRecord)],
) -> Result<LeaseId, EtcdError> {
    let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
    let lease = client.grant(secs)?;
    for (k, r) in ranks {
        if let Err(e) = client.put(k.to_key().as_bytes(), &r.encode(), lease) {
            let _ = client.revoke(lease);
            return Err(e);
        }
    }
    Ok(lease)
}

struct Keeper {
    client: Arc<EtcdClient>,
    status: Arc<Mutex<RegistrarStatus>>,
    ttl: Duration,
    ranks: Vec<(RankKey, RankRecord)>,
    lease: LeaseId,
}

impl Keeper {
    fn run(mut self, stop: &Receiver<()>) {
        let every = self.ttl.checked_div(3).unwrap_or(MIN_TTL);
        let mut wait = every;
        let mut backoff = FIRST_BACKOFF;
        loop {
            match stop.recv_timeout(wait) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            match self.renew() {
                Ok(()) => {
                    wait = every;
                    backoff = FIRST_BACKOFF;
                }
                Err(e) => {
                    tracing::warn!(%e, retry_in = ?backoff, "discovery: lease renewal failed");
                    self.update(|s| {
                        s.registered = false;
                        s.failures = s.failures.saturating_add(1);
                        s.last_error = Some(e.to_string());
                    });
                    wait = backoff;
                    backoff = backoff.saturating_mul(2).min(every);
                }
            }
        }
    }

    /// Renews the lease, or registers again under a new one when it is gone.
    fn renew(&mut self) -> Result<(), EtcdError> {
        if self.client.keep_alive(self.lease)? > 0 {
            self.update(|s| {
                s.registered = true;
                s.renewals = s.renewals.saturating_add(1);
            });
            return Ok(());
        }
        tracing::warn!(
            lease = self.lease,
            "discovery: the lease expired (etcd lost it or renewals failed for a whole TTL): registering again"
        );
        self.update(|s| s.registered = false);
        self.lease = register(&self.client, self.ttl, &self.ranks)?;
        let lease = self.lease;
        self.update(|s| {
            s.lease = lease;
            s.registered = true;
            s.registrations = s.registrations.saturating_add(1);
        });
        Ok(())
    }

    fn update(&self, f: impl FnOnce(&mut RegistrarStatus)) {
        f(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }
}
