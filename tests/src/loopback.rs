//! The loopback as a [`TransportFactory`](crate::conformance::TransportFactory), with its
//! fault injection wired to the suite's failure case.

use kvxfer_transport_loopback::{LoopbackConfig, LoopbackTransport};

use crate::conformance::TransportFactory;

/// Makes loopback agents.
pub struct Loopback;

impl TransportFactory for Loopback {
    type T = LoopbackTransport;

    fn label(&self) -> String {
        "loopback".into()
    }

    fn create(&self, name: &str) -> LoopbackTransport {
        LoopbackTransport::new(name).expect("loopback agent")
    }

    fn inject_failures(&self, t: &LoopbackTransport, n: usize) -> bool {
        t.faults().fail_next_transfers(n);
        true
    }
}

/// Makes loopback agents that ask connectors for prepared per-block lists, as NIXL does,
/// so the pull connector's indexed posts run without NIXL.
pub struct LoopbackPreparedLists;

impl TransportFactory for LoopbackPreparedLists {
    type T = LoopbackTransport;

    fn label(&self) -> String {
        "loopback with prepared lists".into()
    }

    fn create(&self, name: &str) -> LoopbackTransport {
        let config = LoopbackConfig {
            prefer_prepared_lists: true,
            ..LoopbackConfig::default()
        };
        LoopbackTransport::with_config(name, config).expect("loopback agent")
    }

    fn inject_failures(&self, t: &LoopbackTransport, n: usize) -> bool {
        Loopback.inject_failures(t, n)
    }
}
