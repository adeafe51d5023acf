//! Side-channel authentication over real sockets. The key is process-wide (servers take it
//! when they bind, clients when they send), so this binary holds one test that walks through
//! the cases in order: the right key works; no key, a wrong key, replayed requests and
//! requests sealed for another server are refused and counted; refused requests never reach
//! a handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvxfer_core::sidechannel::auth::{Destination, REFUSED_REPLY, SideKey, install_key};
use kvxfer_core::sidechannel::{
    FetchError, Listener, MessageServer, fetch_metadata, request_bytes,
};
use kvxfer_core::wire::handshake::{HandshakeMeta, MAX_HANDSHAKE_BYTES};

const T: Duration = Duration::from_secs(5);

fn meta() -> HandshakeMeta {
    HandshakeMeta {
        engine_id: "prefill".into(),
        agent_metadata: vec![1; 64],
        kv_caches_base_addr: vec![0x1000],
        num_blocks: 8,
        tp_size: 1,
        block_len: 4096,
        attn_backend_name: "kvxfer".into(),
        kvxfer_protocol: Some(1),
        kvxfer_tp_rank: Some(0),
        kvxfer_layout: None,
        kvxfer_lease_ms: None,
        kvxfer_instance: None,
        kvxfer_stamps: None,
        kvxfer_digests: None,
    }
}

fn key(s: &str) -> Option<SideKey> {
    Some(SideKey::new(s.as_bytes()).unwrap())
}

#[test]
fn keyed_side_channel_refuses_and_counts_outsiders() {
    let right = "the cluster's shared secret, 42";
    let wrong = "somebody else's secret, 0123456";
    install_key(key(right));
    let listener = Listener::bind("127.0.0.1", 0, 0, meta().encode()).unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&calls);
    let mb = Destination::mailbox("prefill-rank-0");
    let server = MessageServer::bind(
        "127.0.0.1",
        0,
        1 << 20,
        |_| mb.clone(),
        Box::new(move |req| {
            seen.fetch_add(1, Ordering::SeqCst);
            req.to_vec()
        }),
    )
    .unwrap();
    let refused = || listener.stats().refused.load(Ordering::Relaxed);

    // The right key: metadata and echoes go through, sealed both ways.
    let got = fetch_metadata(
        "127.0.0.1",
        listener.port(),
        "prefill",
        None,
        T,
        MAX_HANDSHAKE_BYTES,
    )
    .unwrap();
    assert_eq!(got, meta());
    assert_eq!(
        request_bytes("127.0.0.1", server.port(), &mb, b"ping", T, 1 << 20).unwrap(),
        b"ping"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // No key: refused with a clear error, counted, the handler never runs.
    install_key(None);
    let e = fetch_metadata(
        "127.0.0.1",
        listener.port(),
        "prefill",
        None,
        T,
        MAX_HANDSHAKE_BYTES,
    )
    .unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    assert!(e.to_string().contains("no key is configured"), "{e}");
    let e = request_bytes("127.0.0.1", server.port(), &mb, b"register me", T, 1 << 20).unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    assert_eq!(refused(), 1);
    assert_eq!(server.refused(), 1);

    // A wrong key: refused, counted, the handler never runs; the reply is not accepted.
    install_key(key(wrong));
    let e = fetch_metadata(
        "127.0.0.1",
        listener.port(),
        "prefill",
        None,
        T,
        MAX_HANDSHAKE_BYTES,
    )
    .unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    let e = request_bytes("127.0.0.1", server.port(), &mb, b"write here", T, 1 << 20).unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    assert_eq!((refused(), server.refused()), (2, 2));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a refused request reached the handler"
    );

    // A captured authentic request sent again (raw, as an attacker would) is refused.
    let (sealed, _) = SideKey::new(right.as_bytes())
        .unwrap()
        .seal_request(&mb, b"once");
    install_key(None);
    let first = request_bytes("127.0.0.1", server.port(), &mb, &sealed, T, 1 << 20);
    // Without our key we cannot open the sealed echo, but it was served...
    assert!(first.is_ok(), "{first:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // ...and the replay is not.
    let again = request_bytes("127.0.0.1", server.port(), &mb, &sealed, T, 1 << 20).unwrap_err();
    assert!(matches!(again, FetchError::Auth { .. }), "{again:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "a replayed request reached the handler"
    );
    assert_eq!(server.refused(), 3);

    // Sealed with the right key for another server: another mailbox, another engine's
    // listener on the same key. Refused, counted, never handled.
    let key_right = SideKey::new(right.as_bytes()).unwrap();
    let (for_other, _) = key_right.seal_request(&Destination::mailbox("prefill-rank-1"), b"x");
    let e = request_bytes("127.0.0.1", server.port(), &mb, &for_other, T, 1 << 20).unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    assert_eq!((server.refused(), calls.load(Ordering::SeqCst)), (4, 2));
    install_key(key(right));
    let e = fetch_metadata(
        "127.0.0.1",
        listener.port(),
        "prefill-b",
        None,
        T,
        MAX_HANDSHAKE_BYTES,
    )
    .unwrap_err();
    assert!(matches!(e, FetchError::Auth { .. }), "{e:?}");
    assert_eq!(
        refused(),
        3,
        "a request for engine prefill-b at engine prefill's listener"
    );

    // Garbage does not stop the keyed servers from serving the right key.
    install_key(None);
    for junk in [&b""[..], b"\xc1", &[0u8; 3000], REFUSED_REPLY] {
        let _ = request_bytes("127.0.0.1", listener.port(), &mb, junk, T, 1 << 20);
    }
    install_key(key(right));
    assert_eq!(
        fetch_metadata(
            "127.0.0.1",
            listener.port(),
            "prefill",
            None,
            T,
            MAX_HANDSHAKE_BYTES
        )
        .unwrap(),
        meta()
    );
    assert_eq!(
        request_bytes("127.0.0.1", server.port(), &mb, b"pong", T, 1 << 20).unwrap(),
        b"pong"
    );

    // Short keys are refused outright.
    assert!(SideKey::new(b"too short").is_err());
}
