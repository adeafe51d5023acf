//! The loopback as a [`TransportFactory`](crate::conformance::TransportFactory), with its
//! fault injection wired to the suite's failure case.

use kvxfer_transport_loopback::LoopbackTransport;

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
