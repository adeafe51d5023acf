//! The conformance suite on UCX in one process (two agents): over shared memory, and over TCP
//! loopback, where UCX emulates RMA with messages the target must progress; both with the
//! progress thread on (the mode without it is not covered yet), every case through the
//! fault-injection decorator. The pull and push scenario lists run over shared memory.
#![cfg(feature = "ucx")]

use std::time::Duration;

use kvxfer_tests::conformance::TransportFactory;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

/// Agents restricted to `tls`.
pub struct Ucx {
    tls: &'static str,
    progress_thread: bool,
}

impl TransportFactory for Ucx {
    type T = UcxTransport;

    fn label(&self) -> String {
        format!("ucx/{}", self.tls)
    }

    fn create(&self, name: &str) -> UcxTransport {
        UcxTransport::with_config(
            name,
            UcxConfig {
                tls: Some(self.tls.into()),
                progress_thread: self.progress_thread,
                keepalive_interval: Duration::from_millis(200),
                ..UcxConfig::default()
            },
        )
        .expect("UCX agent")
    }
}

// Every conformance case runs through the fault-injection decorator, so that the failure
// case runs here too.
mod shm {
    kvxfer_tests::conformance_suite!(kvxfer_tests::faulty::WithFaults(super::Ucx {
        tls: "sm,self",
        progress_thread: true,
    }));
}

mod tcp {
    kvxfer_tests::conformance_suite!(kvxfer_tests::faulty::WithFaults(super::Ucx {
        tls: "tcp,self",
        progress_thread: true,
    }));
}

/// The pull and push scenario lists over UCX shared memory.
mod scenarios_shm {
    fn run(_case: &str, body: impl FnOnce(&super::Ucx)) {
        body(&super::Ucx {
            tls: "sm,self",
            progress_thread: true,
        });
    }

    kvxfer_tests::pull_scenarios!(run);
    kvxfer_tests::push_scenarios!(run);
}
