//! The conformance suite through the facade's `AnyTransport` (loopback inside).

use kvxfer::{AnyTransport, TransportKind, open};
use kvxfer_tests::conformance::TransportFactory;

struct Facade;

impl TransportFactory for Facade {
    type T = AnyTransport;

    fn label(&self) -> String {
        "facade/loopback".into()
    }

    fn create(&self, name: &str) -> AnyTransport {
        open(TransportKind::Loopback, name).expect("loopback through the facade")
    }

    fn inject_failures(&self, t: &AnyTransport, n: usize) -> bool {
        match t {
            AnyTransport::Loopback(l) => {
                l.faults().fail_next_transfers(n);
                true
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

kvxfer_tests::conformance_suite!(Facade);

/// Everything a caller moves between threads is `Send`.
#[test]
fn contract_types_are_send() {
    fn send<T: Send>() {}
    send::<AnyTransport>();
    send::<kvxfer_transport_loopback::LoopbackTransport>();
    send::<kvxfer_core::Registration>();
    send::<kvxfer_core::TransportError>();
    send::<kvxfer_transport_loopback::Faults>();
}
