//! The conformance suite on UCX **across OS processes**: every agent lives in its own
//! helper process (`kvxfer-test-agent`), so each transfer crosses between two processes,
//! over shared memory and over TCP loopback (`UCX_TLS`). Metadata goes through this test;
//! bytes are checked here in memory the helpers map at the same address. Also: a peer killed
//! mid-transfer fails the transfer within a bound instead of hanging it.
#![cfg(feature = "ucx")]

use kvxfer_tests::conformance::TransportFactory;
use kvxfer_tests::remote::RemoteAgent;

const AGENT: &str = env!("CARGO_BIN_EXE_kvxfer-test-agent");

/// Agents in helper processes restricted to `tls`.
pub struct UcxProcess {
    tls: &'static str,
}

impl TransportFactory for UcxProcess {
    type T = RemoteAgent;

    fn label(&self) -> String {
        format!("ucx-process/{}", self.tls)
    }

    fn create(&self, name: &str) -> RemoteAgent {
        RemoteAgent::spawn(AGENT, &["ucx", self.tls], name).expect("spawn the helper agent")
    }
}

mod shm {
    kvxfer_tests::conformance_suite!(super::UcxProcess { tls: "sm,self" });

    /// The failure case through the fault-injection decorator (UCX injects none itself).
    #[test]
    fn conformance_failures_surface_as_failed_through_the_decorator() {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            super::UcxProcess { tls: "sm,self" },
        ));
    }
}

mod tcp {
    kvxfer_tests::conformance_suite!(super::UcxProcess { tls: "tcp,self" });

    /// The failure case through the fault-injection decorator (UCX injects none itself).
    #[test]
    fn conformance_failures_surface_as_failed_through_the_decorator() {
        kvxfer_tests::conformance::failures_surface_as_failed(&kvxfer_tests::faulty::WithFaults(
            super::UcxProcess { tls: "tcp,self" },
        ));
    }
}

/// A peer killed (SIGKILL) in the middle of a 256 MiB READ: the transfer ends — failed, or
/// done with every byte right if it won the race — within the suite's wait bound, and
/// transfers posted to the dead peer afterwards fail instead of hanging.
#[test]
fn peer_killed_mid_transfer_fails_within_bound() {
    use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
    use kvxfer_tests::conformance::{connect, wait};
    use kvxfer_tests::memory::{Buffer, Copy, verify};

    let f = UcxProcess { tls: "tcp,self" };
    let (block, blocks) = (32u64 << 10, 8192u64);
    let len = (block * blocks) as usize;
    let mut src = Buffer::new(len, Some(77));
    let mut dst = Buffer::new(len, None);
    let mut p = connect(&f, &mut [&mut dst], &mut [&mut src]);
    let h = MemoryKind::Host;
    // Reverse block order so the transfer is 8192 separate descriptors.
    let local: Vec<AddrRange> = (0..blocks)
        .map(|i| AddrRange::new(dst.addr(i * block), block))
        .collect();
    let remote: Vec<AddrRange> = (0..blocks)
        .map(|i| AddrRange::new(src.addr((blocks - 1 - i) * block), block))
        .collect();
    let x =
        p.a.post(Op::Read, p.b_in_a, (h, h), &local, &remote, None)
            .expect("post");
    p.b.kill();
    let killed = std::time::Instant::now();
    match wait(&mut p.a, x) {
        XferStatus::Failed(reason) => println!(
            "in-flight READ failed {:?} after the kill: {reason}",
            killed.elapsed()
        ),
        XferStatus::Done => {
            let copies: Vec<Copy> = (0..blocks)
                .map(|i| Copy {
                    src: (blocks - 1 - i) * block,
                    dst: i * block,
                    len: block,
                })
                .collect();
            verify(&src, &dst, &copies).expect("a READ reported done has every byte");
            println!("the READ finished before the kill landed");
        }
        XferStatus::InProgress => unreachable!("wait returns a final status"),
    }
    p.a.release(x).expect("release");
    // Whatever the race, the peer is dead now: new transfers must fail, not hang.
    let x =
        p.a.post(
            Op::Read,
            p.b_in_a,
            (h, h),
            &local[..1],
            &remote[..1],
            Some(b"n"),
        )
        .expect("post after the kill");
    assert!(
        matches!(wait(&mut p.a, x), XferStatus::Failed(_)),
        "a transfer to a killed peer succeeded"
    );
    println!("dead peer detected {:?} after the kill", killed.elapsed());
}
