//! Length fields from a peer never make a decoder allocate more than the input justifies:
//! hostile messages that announce huge arrays, byte strings and strings are decoded under a
//! counting allocator, and the peak allocation stays within a small bound of the input size.
//! Oversized messages are refused before decoding. (One test in this binary: the allocator
//! counts the whole process.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvxfer_core::push::messages::{self, ToPrefill};
use kvxfer_core::wire::handshake::HandshakeMeta;
use kvxfer_core::wire::vllm;
use kvxfer_transport_ucx::metadata::AgentMeta;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: same layout, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: allocated above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak bytes allocated while running `f`, above what was allocated before.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - base
}

/// msgpack: a one-entry map `{key: <header>}` followed by `tail` bytes.
fn map_with(key: &str, header: &[u8], tail: usize) -> Vec<u8> {
    let mut b = vec![0x81, 0xa0 | key.len() as u8];
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(header);
    b.extend(std::iter::repeat_n(0u8, tail));
    b
}

#[test]
fn announced_lengths_do_not_drive_allocation() {
    // The counter sees allocations (so the bounds below can fail).
    assert!(peak_of(|| drop(std::hint::black_box(vec![1u8; 8 << 20]))) >= 8 << 20);
    let huge32 = [0xff, 0xff, 0xff, 0xff];
    let with = |tag: u8| {
        let mut h = vec![tag];
        h.extend_from_slice(&huge32);
        h
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "array32 of addresses",
            map_with("kv_caches_base_addr", &with(0xdd), 64),
        ),
        (
            "bin32 metadata",
            map_with("agent_metadata", &with(0xc6), 64),
        ),
        ("str32 engine id", map_with("engine_id", &with(0xdb), 64)),
        ("map32", map_with("kvxfer_layout", &with(0xdf), 64)),
        (
            "array32 of lengths",
            map_with("block_lens", &with(0xdd), 64),
        ),
        (
            "array32 of names",
            map_with("region_names", &with(0xdd), 64),
        ),
        (
            "bin32 agent metadata bytes",
            map_with("agent_metadata_bytes", &with(0xc6), 64),
        ),
        (
            "map32 member layouts",
            map_with("packed_member_layouts", &with(0xdf), 64),
        ),
        ("array32 of pages", {
            let mut b = vec![0x82, 0xa4];
            b.extend_from_slice(b"kind");
            b.extend_from_slice(&[0xa4]);
            b.extend_from_slice(b"Room");
            b.extend_from_slice(&[0xa5]);
            b.extend_from_slice(b"pages");
            b.extend_from_slice(&with(0xdd));
            b.extend(std::iter::repeat_n(0u8, 64));
            b
        }),
    ];
    for (what, bytes) in &cases {
        let limit = bytes.len() * 4 + (2 << 20);
        let peak = peak_of(|| {
            let _ = HandshakeMeta::decode(bytes, 32 << 20);
            let _ = messages::decode::<ToPrefill>(bytes, "room");
            let _ = vllm::HandshakePayload::decode(bytes, 32 << 20);
            let _ = vllm::AgentMetadata::decode(bytes, 32 << 20);
        });
        assert!(
            peak <= limit,
            "{what}: peak allocation {peak} B for a {} B message",
            bytes.len()
        );
    }
    // UCX metadata announcing 65,536 regions in a short message.
    let mut m = b"KVXU\x01".to_vec();
    m.extend_from_slice(&1u32.to_le_bytes());
    m.push(b'x');
    m.extend_from_slice(&4u32.to_le_bytes());
    m.extend_from_slice(b"addr");
    m.extend_from_slice(&65_536u32.to_le_bytes());
    let peak = peak_of(|| assert!(AgentMeta::decode(&m).is_err()));
    assert!(peak < 64 << 10, "UCX metadata: peak {peak} B");
    // Messages over the size limit are refused before any decoding.
    let big = vec![0x90u8; (32 << 20) + 1];
    let peak = peak_of(|| {
        assert!(HandshakeMeta::decode(&big, 32 << 20).is_err());
        assert!(messages::decode::<ToPrefill>(&big, "room").is_err());
        assert!(vllm::AgentMetadata::decode(&big, 32 << 20).is_err());
        assert!(vllm::HandshakePayload::decode(&big, 32 << 20).is_err());
    });
    assert!(peak < 64 << 10, "oversized: peak {peak} B");
}
