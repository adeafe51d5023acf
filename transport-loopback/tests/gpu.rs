//! GPU memory on the loopback (feature `cuda`): host → device → device → host round trip with
//! bytes verified. Without a driver or device it checks that registration is a typed
//! "not available" error and prints why the GPU part is skipped.
#![cfg(feature = "cuda")]

use kvxfer_core::{AddrRange, MemoryKind, Op, Transport, TransportError, XferStatus};
use kvxfer_transport_loopback::LoopbackTransport;

fn wait(t: &mut LoopbackTransport, x: kvxfer_core::XferId) -> XferStatus {
    let start = std::time::Instant::now();
    loop {
        match t.status(x).expect("status") {
            XferStatus::InProgress if start.elapsed().as_secs() < 60 => std::thread::yield_now(),
            s => return s,
        }
    }
}

#[test]
fn gpu_round_trip_or_typed_skip() {
    let mut a = LoopbackTransport::new("gpu-a").expect("agent");
    if !a.capabilities().gpu_memory {
        let e = a.register(MemoryKind::Gpu { device: 0 }, AddrRange::new(0x1000, 64));
        assert!(
            matches!(e, Err(TransportError::NotAvailable { .. })),
            "{e:?}"
        );
        println!(
            "SKIP [loopback] gpu_round_trip: {}",
            e.err().map(|e| e.to_string()).unwrap_or_default()
        );
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).expect("context");
    ctx.bind_to_thread().expect("bind");
    let len = 4 << 20;
    // SAFETY: plain device allocations, freed at the end after their registrations drop.
    let (d1, d2) = unsafe {
        (
            cudarc::driver::result::malloc_sync(len).expect("malloc"),
            cudarc::driver::result::malloc_sync(len).expect("malloc"),
        )
    };
    let mut b = LoopbackTransport::new("gpu-b").expect("agent");
    let mut host_src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut host_dst = vec![0u8; len];
    let gpu = MemoryKind::Gpu { device: 0 };
    let (hs, hd) = (host_src.as_mut_ptr() as u64, host_dst.as_mut_ptr() as u64);
    let _r1 = a
        .register(MemoryKind::Host, AddrRange::new(hs, len as u64))
        .expect("host src");
    let _r2 = a
        .register(MemoryKind::Host, AddrRange::new(hd, len as u64))
        .expect("host dst");
    let _r3 = b
        .register(gpu, AddrRange::new(d1, len as u64))
        .expect("gpu 1");
    let _r4 = b
        .register(gpu, AddrRange::new(d2, len as u64))
        .expect("gpu 2");
    let peer = a.load_peer(&b.metadata().expect("meta")).expect("load");
    let whole = |addr| [AddrRange::new(addr, len as u64)];
    // Host -> device 1.
    let x = a
        .post(
            Op::Write,
            peer,
            (MemoryKind::Host, gpu),
            &whole(hs),
            &whole(d1),
            None,
        )
        .expect("h2d");
    assert_eq!(wait(&mut a, x), XferStatus::Done);
    // Device 1 -> device 2 (b talks to itself).
    let me = b.load_peer(&b.metadata().expect("meta")).expect("self");
    let x = b
        .post(Op::Write, me, (gpu, gpu), &whole(d1), &whole(d2), None)
        .expect("d2d");
    assert_eq!(wait(&mut b, x), XferStatus::Done);
    // Device 2 -> host.
    let x = a
        .post(
            Op::Read,
            peer,
            (MemoryKind::Host, gpu),
            &whole(hd),
            &whole(d2),
            None,
        )
        .expect("d2h");
    assert_eq!(wait(&mut a, x), XferStatus::Done);
    assert_eq!(host_src, host_dst);
    drop((_r3, _r4));
    // SAFETY: registrations dropped; nothing references the allocations any more.
    unsafe {
        cudarc::driver::result::free_sync(d1).expect("free");
        cudarc::driver::result::free_sync(d2).expect("free");
    }
}
