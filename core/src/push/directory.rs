//! Where a push decode learns a prefill's ranks and whether it is alive: the prefill's
//! bootstrap registry (kvxfer's side channel) by default, or the fleet's etcd, where each
//! prefill rank registers under a lease ([`super::EtcdDirectory`], feature `etcd`).

use std::fmt::Debug;
use std::time::Duration;

use super::messages::{FromRegistry, ToRegistry};
use super::registry::ask_registry;

/// A prefill's bootstrap address (host, port): what a decode's rooms name it by.
pub type Addr = (String, u16);

/// Answers a push decode's questions about the prefills its rooms name.
pub trait PrefillDirectory: Send + Sync + Debug {
    /// The prefill at `addr`: [`FromRegistry::Layout`] once every rank registered,
    /// [`FromRegistry::NotReady`] before; `Err` when it cannot be asked. Bounded by `timeout`.
    fn query(&self, addr: &Addr, timeout: Duration) -> Result<FromRegistry, String>;
    /// Whether the prefill at `addr` is alive (the decode's liveness probe).
    fn alive(&self, addr: &Addr, timeout: Duration) -> bool;
    /// Where the answers come from, for messages.
    fn source(&self) -> String;
}

/// Asks the prefill's own bootstrap registry at `addr` ([`super::BootstrapRegistry`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct RegistryDirectory;

impl PrefillDirectory for RegistryDirectory {
    fn query(&self, addr: &Addr, timeout: Duration) -> Result<FromRegistry, String> {
        ask_registry(&addr.0, addr.1, &ToRegistry::Query, timeout)
    }
    fn alive(&self, addr: &Addr, timeout: Duration) -> bool {
        matches!(
            ask_registry(&addr.0, addr.1, &ToRegistry::Health, timeout),
            Ok(FromRegistry::Ok)
        )
    }
    fn source(&self) -> String {
        "its bootstrap registry".into()
    }
}
