//! The conformance suite on the loopback transport (host memory, real copies).

use kvxfer_tests::conformance::TransportFactory;
use kvxfer_transport_loopback::LoopbackTransport;

struct Loopback;

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

kvxfer_tests::conformance_suite!(Loopback);
