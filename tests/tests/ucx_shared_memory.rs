//! Same-host UCX peers whose memory is kvxfer shared memory: the path is chosen by itself
//! (mapped, host copies, no UCX requests), only for memory and peers that qualify, never for
//! forged metadata, and a peer that dies fails the copy. The conformance suite runs over
//! this path in `ucx.rs` (`shm`); these tests pin down which path a transfer took.
#![cfg(feature = "ucx")]

use std::time::Duration;

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, XferStatus};
use kvxfer_host_mem::mem::HostMem;
use kvxfer_tests::conformance::{TransportFactory, connect, wait, wait_notifications_while};
use kvxfer_tests::memory::{Buffer, Copy, Rng, fill, verify};
use kvxfer_tests::remote::RemoteAgent;
use kvxfer_transport_ucx::metadata::AgentMeta;
use kvxfer_transport_ucx::{UcxConfig, UcxTransport};

const AGENT: &str = env!("CARGO_BIN_EXE_kvxfer-test-agent");
const H: MemoryKind = MemoryKind::Host;

/// In-process agents over TCP loopback: a mapped peer's transfers are copies whatever
/// transports UCX has.
struct Tcp {
    shared_memory: bool,
}

impl TransportFactory for Tcp {
    type T = UcxTransport;

    fn label(&self) -> String {
        "ucx/tcp,self".into()
    }

    fn create(&self, name: &str) -> UcxTransport {
        UcxTransport::with_config(name, config("tcp,self", self.shared_memory)).expect("agent")
    }
}

fn config(tls: &str, shared_memory: bool) -> UcxConfig {
    UcxConfig {
        tls: Some(tls.into()),
        shared_memory,
        keepalive_interval: Duration::from_millis(200),
        ..UcxConfig::default()
    }
}

/// `count` random pieces of `src` to distinct places of a destination of the same size.
fn scattered(len: u64, count: u64, seed: u64) -> Vec<Copy> {
    let piece = len / count;
    let mut rng = Rng::new(seed);
    let mut order: Vec<u64> = (0..count).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i as u64) as usize);
    }
    order
        .iter()
        .enumerate()
        .map(|(i, &s)| Copy {
            src: s * piece,
            dst: i as u64 * piece,
            len: piece - rng.range(0, 64),
        })
        .collect()
}

fn ranges(buf: &Buffer, copies: &[Copy], src: bool) -> Vec<AddrRange> {
    copies
        .iter()
        .map(|c| AddrRange::new(buf.addr(if src { c.src } else { c.dst }), c.len))
        .collect()
}

#[test]
fn reads_and_writes_between_mapped_peers_are_copies_and_notify_after_the_data() {
    let len = 16u64 << 20;
    let mut src = Buffer::new(len as usize, Some(21));
    let mut dst = Buffer::new(len as usize, None);
    let mut p = connect(
        &Tcp {
            shared_memory: true,
        },
        &mut [&mut dst],
        &mut [&mut src],
    );
    assert!(p.a.maps_peer(p.b_in_a), "a same-host peer in shared memory");
    let copies = scattered(len, 512, 3);
    let x =
        p.a.post(
            Op::Read,
            p.b_in_a,
            (H, H),
            &ranges(&dst, &copies, false),
            &ranges(&src, &copies, true),
            Some(b"read"),
        )
        .expect("post");
    let notes = wait_notifications_while(&mut p.b, &mut p.a, x, 1);
    assert_eq!(notes[0].message, b"read");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    verify(&src, &dst, &copies).expect("READ through the mapping");
    assert_eq!(p.a.shared_memory_transfers(), 1);

    // WRITE what arrived on to another buffer of b's, the notification after the data.
    let back = Buffer::new(len as usize, None)
        .register(&mut p.b)
        .expect("register");
    let b_again = p.a.load_peer(&p.b.metadata().unwrap()).expect("reload b");
    assert!(p.a.maps_peer(b_again));
    let copies = scattered(len, 64, 4);
    let x =
        p.a.post(
            Op::Write,
            b_again,
            (H, H),
            &ranges(&dst, &copies, true),
            &ranges(&back, &copies, false),
            Some(b"written"),
        )
        .expect("post");
    let notes = wait_notifications_while(&mut p.b, &mut p.a, x, 1);
    assert_eq!(notes[0].message, b"written");
    verify(&dst, &back, &copies).expect("WRITE visible when its notification arrives");
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    assert_eq!(p.a.shared_memory_transfers(), 2);
}

#[test]
fn private_memory_and_a_disabled_path_go_through_ucx() {
    let len = 1u64 << 20;
    // The target's memory is not kvxfer shared memory.
    let mut a = Tcp {
        shared_memory: true,
    }
    .create("priv-a");
    let mut b = Tcp {
        shared_memory: true,
    }
    .create("priv-b");
    let mut src = HostMem::new(len as usize, 0);
    fill(&mut src, Some(8));
    let _src_reg = b.register(H, AddrRange::new(src.addr(), len)).unwrap();
    let dst = Buffer::new(len as usize, None).register(&mut a).unwrap();
    let peer = a.load_peer(&b.metadata().unwrap()).unwrap();
    assert!(!a.maps_peer(peer));
    let x = a
        .post(
            Op::Read,
            peer,
            (H, H),
            &[dst.range()],
            &[AddrRange::new(src.addr(), len)],
            None,
        )
        .unwrap();
    assert_eq!(wait(&mut a, x), XferStatus::Done);
    assert_eq!(dst.bytes(), &src[..]);
    assert_eq!(a.shared_memory_transfers(), 0);

    // Both sides in shared memory, the path turned off.
    let mut s = Buffer::new(len as usize, Some(9));
    let mut d = Buffer::new(len as usize, None);
    let mut p = connect(
        &Tcp {
            shared_memory: false,
        },
        &mut [&mut d],
        &mut [&mut s],
    );
    assert!(!p.a.maps_peer(p.b_in_a));
    let x =
        p.a.post(Op::Read, p.b_in_a, (H, H), &[d.range()], &[s.range()], None)
            .unwrap();
    assert_eq!(wait(&mut p.a, x), XferStatus::Done);
    assert_eq!(d.bytes(), s.bytes());
    assert_eq!(p.a.shared_memory_transfers(), 0);

    // Turned off on the target only: it advertises nothing, so nothing is mapped.
    let mut a = Tcp {
        shared_memory: true,
    }
    .create("half-a");
    let mut b = Tcp {
        shared_memory: false,
    }
    .create("half-b");
    let s = Buffer::new(4096, Some(2)).register(&mut b).unwrap();
    let peer = a.load_peer(&b.metadata().unwrap()).unwrap();
    assert!(!a.maps_peer(peer));
    let meta = AgentMeta::decode(&b.metadata().unwrap()).unwrap();
    assert!(meta.host.is_none() && meta.regions[0].shared.is_none());
    drop(s);
}

/// A peer's metadata with its shared section changed by `edit` still loads, but nothing of
/// it is mapped; transfers go through UCX and stay correct. The peer registers the first
/// half of its buffer, so an offset moved within the file still decodes.
fn forged(edit: impl Fn(&mut AgentMeta)) {
    let len = 1u64 << 20;
    let f = Tcp {
        shared_memory: true,
    };
    let (mut a, mut b) = (f.create("forge-a"), f.create("forge-b"));
    let src = Buffer::new(len as usize, Some(10));
    let half = AddrRange::new(src.addr(0), len / 2);
    let _src_reg = b.register(H, half).unwrap();
    let dst = Buffer::new(len as usize, None).register(&mut a).unwrap();
    let mut meta = AgentMeta::decode(&b.metadata().unwrap()).unwrap();
    assert!(meta.regions[0].shared.is_some());
    let honest = a.load_peer(&meta.encode()).expect("loads");
    assert!(a.maps_peer(honest), "the unforged metadata maps");
    a.remove_peer(honest).unwrap();
    edit(&mut meta);
    let peer = a.load_peer(&meta.encode()).expect("loads");
    assert!(!a.maps_peer(peer), "forged shared memory mapped");
    // The region as the (forged) metadata has it: inside the peer's buffer either way.
    let there = meta.regions[0].range;
    let at = (there.addr - src.addr(0)) as usize;
    let x = a
        .post(
            Op::Read,
            peer,
            (H, H),
            &[AddrRange::new(dst.addr(0), there.len)],
            &[there],
            None,
        )
        .unwrap();
    assert_eq!(wait(&mut a, x), XferStatus::Done);
    let n = there.len as usize;
    assert_eq!(dst.bytes()[..n], src.bytes()[at..at + n]);
    assert_eq!(a.shared_memory_transfers(), 0);
}

#[test]
fn forged_shared_memory_is_never_mapped() {
    let mut other = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let other_pid = other.id();
    forged(|m| m.regions[0].shared.as_mut().unwrap().file_len += 4096);
    forged(|m| m.regions[0].shared.as_mut().unwrap().token[3] ^= 1);
    forged(|m| m.regions[0].shared.as_mut().unwrap().fd = 0);
    forged(|m| m.regions[0].shared.as_mut().unwrap().pid = other_pid);
    // Other bytes of the file than the peer's region: the owner does not map them there.
    forged(|m| m.regions[0].shared.as_mut().unwrap().offset += 4096);
    forged(|m| m.regions[0].range.addr += 4096);
    forged(|m| m.host.as_mut().unwrap()[0] ^= 1);
    let _ = other.kill();
    let _ = other.wait();
    // A region larger than its file is refused when decoded.
    let f = Tcp {
        shared_memory: true,
    };
    let mut b = f.create("forge-c");
    let _src = Buffer::new(4096, Some(1)).register(&mut b).unwrap();
    let mut meta = AgentMeta::decode(&b.metadata().unwrap()).unwrap();
    meta.regions[0].range.len += 4096;
    let err = f.create("forge-d").load_peer(&meta.encode()).unwrap_err();
    assert!(err.to_string().contains("inside its file"), "{err}");
}

/// Copies cannot be cancelled: releasing a transfer, or deregistering memory it writes,
/// returns only once they are over (the bytes are all there), even past `release_wait`; and
/// waiting for copies does not close a healthy peer (its next transfer is done).
#[test]
fn release_and_deregistration_wait_for_copies_and_keep_the_peer() {
    let len = 64u64 << 20;
    let config = UcxConfig {
        release_wait: Duration::from_millis(1),
        ..config("sm,self", true)
    };
    let mut a = UcxTransport::with_config("wait-a", config.clone()).unwrap();
    let mut b = UcxTransport::with_config("wait-b", config).unwrap();
    let src = Buffer::new(len as usize, Some(31))
        .register(&mut b)
        .unwrap();
    let mut dst = Buffer::new(len as usize, None).register(&mut a).unwrap();
    let peer = a.load_peer(&b.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(peer));
    // 4096 pieces in reverse order.
    let piece = len / 4096;
    let copies: Vec<Copy> = (0..4096)
        .map(|i| Copy {
            src: (4095 - i) * piece,
            dst: i * piece,
            len: piece,
        })
        .collect();
    let read = |a: &mut UcxTransport, dst: &Buffer| {
        a.post(
            Op::Read,
            peer,
            (H, H),
            &ranges(dst, &copies, false),
            &ranges(&src, &copies, true),
            None,
        )
        .unwrap()
    };
    let x = read(&mut a, &dst);
    a.release(x).unwrap();
    verify(&src, &dst, &copies).expect("every byte copied when release returned");
    dst.bytes_mut().iter_mut().for_each(|b| *b = 0);
    let x = read(&mut a, &dst);
    drop(dst.registration.take());
    assert!(
        dst.bytes() == &expected(&src, &copies)[..],
        "every byte copied when deregistration returned"
    );
    a.release(x).unwrap();
    assert!(!a.peer_failed(peer));
    let dst = dst.register(&mut a).unwrap();
    let x = read(&mut a, &dst);
    assert_eq!(wait(&mut a, x), XferStatus::Done, "the peer is still there");
    assert_eq!(a.shared_memory_transfers(), 3);
}

/// What `copies` of `src` make of a destination of the same size that held zeros.
fn expected(src: &Buffer, copies: &[Copy]) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    for c in copies {
        let (s, d, n) = (c.src as usize, c.dst as usize, c.len as usize);
        out[d..d + n].copy_from_slice(&src.bytes()[s..s + n]);
    }
    out
}

/// Another process's cache in shared memory: read through the mapping, every byte right;
/// once that process is gone, a READ fails instead of returning its memory as a transfer.
#[test]
fn a_peer_process_is_mapped_and_its_death_fails_the_copy() {
    let (block, blocks) = (32u64 << 10, 2048u64);
    let len = block * blocks;
    let mut b = RemoteAgent::spawn(AGENT, &["ucx", "sm,self"], "proc-b").expect("helper");
    let src = b.alloc_shared_filled(len, 5).expect("shared memory");
    let _src_reg = b.register(H, AddrRange::new(src, len)).expect("register");
    let mut a = UcxTransport::with_config("proc-a", config("sm,self", true)).unwrap();
    let dst = Buffer::new(len as usize, None).register(&mut a).unwrap();
    let peer = a.load_peer(&b.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(peer));
    let local: Vec<AddrRange> = (0..blocks)
        .map(|i| AddrRange::new(dst.addr(i * block), block))
        .collect();
    let remote: Vec<AddrRange> = (0..blocks)
        .map(|i| AddrRange::new(src + (blocks - 1 - i) * block, block))
        .collect();
    let x = a
        .post(Op::Read, peer, (H, H), &local, &remote, None)
        .unwrap();
    assert_eq!(wait(&mut a, x), XferStatus::Done);
    a.release(x).unwrap();
    let mut expected = vec![0u8; len as usize];
    fill(&mut expected, Some(5));
    for i in 0..blocks {
        let (d, s) = ((i * block) as usize, ((blocks - 1 - i) * block) as usize);
        assert!(
            dst.bytes()[d..d + block as usize] == expected[s..s + block as usize],
            "block {i}"
        );
    }
    assert_eq!(a.shared_memory_transfers(), 1);
    assert!(!a.peer_failed(peer));
    // A READ in flight when the peer dies, then a READ and a WRITE after: none is done.
    let x = a
        .post(Op::Read, peer, (H, H), &local, &remote, None)
        .unwrap();
    b.kill();
    match wait(&mut a, x) {
        XferStatus::Failed(why) => assert!(why.contains("exited"), "{why}"),
        XferStatus::Done => println!("the READ finished before the kill landed"),
        s => panic!("{s:?}"),
    }
    // Noticed by watching its process, before anything else is posted.
    assert!(a.peer_failed(peer), "its process is watched");
    assert!(!a.maps_peer(peer), "a dead peer's memory is let go");
    for op in [Op::Read, Op::Write] {
        let x = a.post(op, peer, (H, H), &local, &remote, None).unwrap();
        match wait(&mut a, x) {
            XferStatus::Failed(why) => assert!(why.contains("exited"), "{why}"),
            s => panic!("{op:?} to a dead peer's memory: {s:?}"),
        }
    }
    assert!(a.peer_failed(peer));
}

/// A peer may make this process hold only so many mappings: one that advertises more
/// memfds than a peer may map, or than are left of the total, is not mapped at all (its
/// transfers go through UCX, still right), counted; and the memfds of a mapped peer
/// advertised again under another agent name are refused, however much room is left.
#[test]
fn mappings_are_bounded_per_peer_and_in_all_and_never_claimed_twice() {
    let bounded = |per_peer, total| UcxConfig {
        max_peer_mappings: per_peer,
        max_mappings: total,
        ..config("tcp,self", true)
    };
    let mut a = UcxTransport::with_config("bound-a", bounded(2, 3)).unwrap();
    let peer_with = |name: &str, memfds: u64| {
        let mut t = UcxTransport::with_config(name, config("tcp,self", true)).unwrap();
        let bufs: Vec<Buffer> = (0..memfds)
            .map(|i| Buffer::new(4096, Some(i)).register(&mut t).unwrap())
            .collect();
        (t, bufs)
    };
    let dst = Buffer::new(4096, None).register(&mut a).unwrap();
    let read_back = |a: &mut UcxTransport, peer, src: &Buffer| {
        let x = a
            .post(Op::Read, peer, (H, H), &[dst.range()], &[src.range()], None)
            .unwrap();
        assert_eq!(wait(a, x), XferStatus::Done);
        assert_eq!(dst.bytes(), src.bytes());
    };

    // Three memfds, two per peer.
    let (three, bufs) = peer_with("bound-three", 3);
    let p3 = a.load_peer(&three.metadata().unwrap()).unwrap();
    assert!(!a.maps_peer(p3), "over the per-peer bound");
    assert_eq!(a.shared_memory_refusals(), 1);
    read_back(&mut a, p3, &bufs[2]);
    assert_eq!(a.shared_memory_transfers(), 0, "through UCX");

    // Two fit; two more would pass the total of three.
    let (two, two_bufs) = peer_with("bound-two", 2);
    let p2 = a.load_peer(&two.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(p2));
    assert_eq!(a.shared_memory_mappings(), 2);
    let (other, other_bufs) = peer_with("bound-other", 2);
    let po = a.load_peer(&other.metadata().unwrap()).unwrap();
    assert!(!a.maps_peer(po), "over the total");
    assert_eq!(a.shared_memory_refusals(), 2);
    read_back(&mut a, po, &other_bufs[1]);
    // Reloading the mapped peer under its own name is a refresh, not a second claim.
    let p2 = a.load_peer(&two.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(p2));
    read_back(&mut a, p2, &two_bufs[0]);
    assert_eq!(a.shared_memory_transfers(), 1);

    // The mapped peer's memfds under another agent name: one mapping left, but claimed.
    let mut meta = AgentMeta::decode(&two.metadata().unwrap()).unwrap();
    meta.name = "bound-impostor".into();
    meta.regions.truncate(1);
    let pi = a.load_peer(&meta.encode()).unwrap();
    assert!(!a.maps_peer(pi), "another peer's memfd");
    assert_eq!(a.shared_memory_refusals(), 3);
    assert_eq!(a.shared_memory_mappings(), 2);

    // Two regions of one memfd are one mapping, each read through it.
    let mut halves = UcxTransport::with_config("bound-halves", config("tcp,self", true)).unwrap();
    let whole = Buffer::new(8192, Some(9));
    let regs: Vec<_> = [0, 4096]
        .map(|at| {
            halves
                .register(H, AddrRange::new(whole.addr(at), 4096))
                .unwrap()
        })
        .into();
    a.remove_peer(po).unwrap();
    let ph = a.load_peer(&halves.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(ph));
    assert_eq!(
        a.shared_memory_mappings(),
        3,
        "two peers: two memfds and one"
    );
    for at in [0, 4096] {
        let x = a
            .post(
                Op::Read,
                ph,
                (H, H),
                &[dst.range()],
                &[AddrRange::new(whole.addr(at), 4096)],
                None,
            )
            .unwrap();
        assert_eq!(wait(&mut a, x), XferStatus::Done);
        assert_eq!(dst.bytes(), &whole.bytes()[at as usize..at as usize + 4096]);
    }
    assert_eq!(a.shared_memory_transfers(), 3);
    a.remove_peer(ph).unwrap();
    drop(regs);

    // Once the mapped peer is gone, its mappings are room for others.
    a.remove_peer(p2).unwrap();
    a.remove_peer(pi).unwrap();
    let po = a.load_peer(&other.metadata().unwrap()).unwrap();
    assert!(a.maps_peer(po));
}
