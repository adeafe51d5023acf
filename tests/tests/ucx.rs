//! The conformance suite on UCX in one process (two agents): over shared memory, and over TCP
//! loopback, where UCX emulates RMA with messages the target must progress: every case with the
//! progress thread on (the failure case through the fault-injection decorator), and the cases
//! that poll both agents with it off. The pull and push scenario lists run over shared memory.
#![cfg(feature = "ucx")]

use std::time::Duration;

use kvxfer_tests::conformance::TransportFactory;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

/// Agents restricted to `tls`; with `shared_memory`, transfers between test buffers (kvxfer
/// shared memory) are host copies through the peer's mapped memory instead of UCX requests.
pub struct Ucx {
    tls: &'static str,
    progress_thread: bool,
    shared_memory: bool,
}

impl TransportFactory for Ucx {
    type T = UcxTransport;

    fn label(&self) -> String {
        let path = if self.shared_memory { "+mapped" } else { "" };
        format!("ucx/{}{path}", self.tls)
    }

    fn create(&self, name: &str) -> UcxTransport {
        UcxTransport::with_config(
            name,
            UcxConfig {
                tls: Some(self.tls.into()),
                progress_thread: self.progress_thread,
                shared_memory: self.shared_memory,
                keepalive_interval: Duration::from_millis(200),
                ..UcxConfig::default()
            },
        )
        .expect("UCX agent")
    }
}

mod shm {
    kvxfer_tests::conformance_suite!(super::Ucx {
        tls: "sm,self",
        progress_thread: true,
        shared_memory: true,
    });

    /// UCX injects no faults itself: the failure case runs through the decorator.
    #[test]
    fn conformance_failures_surface_as_failed_through_the_decorator() {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            super::Ucx {
                tls: "sm,self",
                progress_thread: true,
                shared_memory: true,
            },
        ));
    }

    /// The suite's agents and buffers take the same-host copies, not UCX's path (which
    /// `shm_cma` runs): a check that quietly failed here would make this a second CMA run.
    #[test]
    fn the_suite_runs_over_same_host_copies() {
        use kvxfer_core::{MemoryKind, Op, Transport, XferStatus};
        use kvxfer_tests::conformance::{TransportFactory, connect, wait};
        use kvxfer_tests::memory::Buffer;
        for mapped in [true, false] {
            let f = super::Ucx {
                tls: "sm,self",
                progress_thread: true,
                shared_memory: mapped,
            };
            assert_eq!(f.label().ends_with("+mapped"), mapped);
            let (mut src, mut dst) = (Buffer::new(4096, Some(1)), Buffer::new(4096, None));
            let mut p = connect(&f, &mut [&mut dst], &mut [&mut src]);
            assert_eq!(p.a.maps_peer(p.b_in_a), mapped);
            let h = MemoryKind::Host;
            let x =
                p.a.post(
                    Op::Read,
                    p.b_in_a,
                    (h, h),
                    &[dst.range()],
                    &[src.range()],
                    None,
                )
                .unwrap();
            assert_eq!(wait(&mut p.a, x), XferStatus::Done);
            assert_eq!(dst.bytes(), src.bytes());
            assert_eq!(p.a.shared_memory_transfers(), u64::from(mapped));
        }
    }
}

/// UCX's own shared-memory path (CMA) for the same buffers: the same-host mapping off.
mod shm_cma {
    kvxfer_tests::conformance_suite!(super::Ucx {
        tls: "sm,self",
        progress_thread: true,
        shared_memory: false,
    });
}

mod tcp {
    kvxfer_tests::conformance_suite!(super::Ucx {
        tls: "tcp,self",
        progress_thread: true,
        shared_memory: false,
    });

    /// UCX injects no faults itself: the failure case runs through the decorator.
    #[test]
    fn conformance_failures_surface_as_failed_through_the_decorator() {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            super::Ucx {
                tls: "tcp,self",
                progress_thread: true,
                shared_memory: false,
            },
        ));
    }
}

/// The pull and push scenario lists over UCX shared memory.
mod scenarios_shm {
    fn run(_case: &str, body: impl FnOnce(&super::Ucx)) {
        body(&super::Ucx {
            tls: "sm,self",
            progress_thread: true,
            shared_memory: true,
        });
    }

    kvxfer_tests::pull_scenarios!(run);
    kvxfer_tests::push_scenarios!(run);
}

/// Without the progress thread (`KVXFER_UCX_PROGRESS_THREAD=0`), a mode for engines that poll
/// both sides: the cases in which the test itself polls both agents (the others wait on the
/// initiator alone, and UCX's wire-up needs the target to progress too). Dropping an agent
/// whose replaced endpoint never finished closing aborted the process here before.
mod polled {
    use kvxfer_tests::conformance as c;

    use super::Ucx;

    const SHM: Ucx = Ucx {
        tls: "sm,self",
        progress_thread: false,
        shared_memory: true,
    };
    const TCP: Ucx = Ucx {
        tls: "tcp,self",
        progress_thread: false,
        shared_memory: false,
    };

    #[test]
    fn shm_notification_after_data() {
        c::notification_after_data(&SHM);
    }
    #[test]
    fn tcp_notification_after_data() {
        c::notification_after_data(&TCP);
    }
    #[test]
    fn shm_metadata_round_trip() {
        c::metadata_round_trip(&SHM);
    }
    #[test]
    fn tcp_metadata_round_trip() {
        c::metadata_round_trip(&TCP);
    }
    #[test]
    fn shm_unknown_or_removed_peer() {
        c::unknown_or_removed_peer(&SHM);
    }
    #[test]
    fn tcp_unknown_or_removed_peer() {
        c::unknown_or_removed_peer(&TCP);
    }
    #[test]
    fn shm_out_of_bounds_rejected() {
        c::out_of_bounds_rejected(&SHM);
    }
    #[test]
    fn tcp_out_of_bounds_rejected() {
        c::out_of_bounds_rejected(&TCP);
    }
    #[test]
    fn shm_registration_lifecycle() {
        c::registration_lifecycle(&SHM);
    }
    #[test]
    fn tcp_registration_lifecycle() {
        c::registration_lifecycle(&TCP);
    }
}
