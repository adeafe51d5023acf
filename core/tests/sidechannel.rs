//! The side channel over real sockets: exact metadata handed over, ranks named, timeouts,
//! malformed replies refused, garbage requests survived.

use std::time::{Duration, Instant};

use kvxfer_core::sidechannel::{
    FetchError, Listener, MAX_READER_NAME, MetaRequest, fetch_metadata, fetch_metadata_for,
    parse_request,
};
use kvxfer_core::wire::handshake::{GET_META_MSG, HandshakeMeta, MAX_HANDSHAKE_BYTES};

const T: Duration = Duration::from_secs(5);
/// The engine requests name (bound into a request only with a side-channel key, which
/// these tests do not set).
const ENGINE: &str = "prefill";

fn meta(engine: &str, rank: u32) -> HandshakeMeta {
    HandshakeMeta {
        engine_id: engine.into(),
        agent_metadata: vec![rank as u8; 300],
        kv_caches_base_addr: vec![0x1000 * u64::from(rank + 1), 0x9000],
        num_blocks: 64,
        tp_size: 2,
        block_len: 32768,
        attn_backend_name: "FLASH_ATTN".into(),
        kvxfer_protocol: Some(1),
        kvxfer_tp_rank: Some(rank),
        kvxfer_layout: None,
        kvxfer_lease_ms: Some(30_000),
        kvxfer_instance: Some(3),
        kvxfer_stamps: None,
        kvxfer_digests: None,
    }
}

#[test]
fn handshake_hands_over_exact_metadata() {
    let m = meta("prefill", 0);
    let l = Listener::bind("127.0.0.1", 0, 0, m.encode()).expect("bind");
    let start = Instant::now();
    let got =
        fetch_metadata("127.0.0.1", l.port(), ENGINE, None, T, MAX_HANDSHAKE_BYTES).expect("fetch");
    let took = start.elapsed();
    assert_eq!(got, m);
    println!("handshake over loopback TCP took {took:?}");
    // Requests naming a rank.
    l.set_reply(1, meta("prefill", 1).encode());
    assert_eq!(
        fetch_metadata(
            "127.0.0.1",
            l.port(),
            ENGINE,
            Some(1),
            T,
            MAX_HANDSHAKE_BYTES
        )
        .unwrap(),
        meta("prefill", 1)
    );
    assert_eq!(
        fetch_metadata(
            "127.0.0.1",
            l.port(),
            ENGINE,
            Some(0),
            T,
            MAX_HANDSHAKE_BYTES
        )
        .unwrap(),
        m
    );
    let unknown = fetch_metadata(
        "127.0.0.1",
        l.port(),
        ENGINE,
        Some(7),
        T,
        MAX_HANDSHAKE_BYTES,
    );
    assert!(
        matches!(unknown, Err(FetchError::BadReply { .. })),
        "{unknown:?}"
    );
    assert_eq!(
        l.stats().served.load(std::sync::atomic::Ordering::Relaxed),
        3
    );
}

/// A request naming its reader makes it one of the listener's readers once served; one
/// that is refused (unknown rank) does not.
#[test]
fn readers_named_in_served_requests_are_known() {
    let l = Listener::bind("127.0.0.1", 0, 0, meta("prefill", 0).encode()).expect("bind");
    let fetch =
        |rank, name| fetch_metadata_for("127.0.0.1", l.port(), ENGINE, rank, name, T, 1 << 20);
    assert_eq!(fetch(0, "decode-0").unwrap(), meta("prefill", 0));
    assert!(fetch(7, "decode-7").is_err());
    let readers = l.readers();
    assert!(readers.contains("decode-0"));
    assert!(
        !readers.contains("decode-7"),
        "a refused request named a reader"
    );
    assert_eq!(readers.len(), 1);
}

#[test]
fn requests_parse_with_and_without_a_reader() {
    let named = |rank: u32, name: &str| {
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), rank, name)).unwrap()
    };
    let plain = rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), 3u32)).unwrap();
    let req = |rank, reader: Option<&str>| MetaRequest {
        rank,
        reader: reader.map(String::from),
    };
    assert_eq!(parse_request(GET_META_MSG, 5), Some(req(5, None)));
    assert_eq!(parse_request(&plain, 5), Some(req(3, None)));
    assert_eq!(
        parse_request(&named(2, "d-1"), 5),
        Some(req(2, Some("d-1")))
    );
    let longest = "n".repeat(MAX_READER_NAME);
    assert_eq!(
        parse_request(&named(0, &longest), 5),
        Some(req(0, Some(&longest)))
    );
    for bad in [
        named(0, ""),
        named(0, &"n".repeat(MAX_READER_NAME + 1)),
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"other"), 0u32, "d")).unwrap(),
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"other"), 0u32)).unwrap(),
        b"get_meta".to_vec(),
        Vec::new(),
    ] {
        assert_eq!(parse_request(&bad, 5), None, "{bad:?}");
    }
}

#[test]
fn nobody_listening_times_out() {
    let port = {
        let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let r = fetch_metadata(
        "127.0.0.1",
        port,
        ENGINE,
        None,
        Duration::from_millis(200),
        MAX_HANDSHAKE_BYTES,
    );
    assert!(matches!(r, Err(FetchError::Timeout { .. })), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "timeout not honoured"
    );
}

#[test]
fn malformed_replies_are_errors_not_panics() {
    let good = meta("p", 0).encode();
    let mut huge = vec![0x81, 0xb3];
    huge.extend_from_slice(b"kv_caches_base_addr");
    huge.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    let wrong_types = rmp_serde::to_vec_named(&std::collections::BTreeMap::from([
        ("engine_id", 5u32),
        ("num_blocks", 1),
    ]))
    .unwrap();
    let noise: Vec<u8> = (0..500u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for (name, reply) in [
        ("truncated", good[..good.len() / 2].to_vec()),
        ("wrong types", wrong_types),
        ("huge lengths", huge),
        ("random bytes", noise),
        ("empty", Vec::new()),
    ] {
        let l = Listener::bind("127.0.0.1", 0, 0, reply).expect("bind");
        let r = fetch_metadata("127.0.0.1", l.port(), ENGINE, None, T, MAX_HANDSHAKE_BYTES);
        assert!(
            matches!(r, Err(FetchError::BadReply { .. })),
            "{name}: {r:?}"
        );
    }
    // A reply above the client's limit is refused too (ZMQ drops it: a timeout or bad reply).
    let l = Listener::bind("127.0.0.1", 0, 0, good).expect("bind");
    let r = fetch_metadata(
        "127.0.0.1",
        l.port(),
        ENGINE,
        None,
        Duration::from_millis(300),
        64,
    );
    assert!(r.is_err(), "oversized reply accepted");
}

#[test]
fn garbage_requests_do_not_stop_the_listener() {
    let m = meta("p", 0);
    let l = Listener::bind("127.0.0.1", 0, 0, m.encode()).expect("bind");
    let ctx = zmq::Context::new();
    let ep = format!("tcp://127.0.0.1:{}", l.port());
    // DEALER sends raw frames: junk, an oversized message, many frames, a wrong request.
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&ep).unwrap();
    dealer.send(&b"garbage"[..], 0).unwrap();
    dealer.send(vec![7u8; 1 << 20], 0).unwrap();
    dealer
        .send_multipart([&b"a"[..], b"b", b"c", b"d"], 0)
        .unwrap();
    for i in 0..200u32 {
        dealer.send(i.to_le_bytes().to_vec(), zmq::DONTWAIT).ok();
    }
    // Raw TCP garbage that is not even ZMTP.
    {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", l.port())).unwrap();
        let _ = s.write_all(&[0xffu8; 4096]);
    }
    let got = fetch_metadata("127.0.0.1", l.port(), ENGINE, None, T, MAX_HANDSHAKE_BYTES)
        .expect("still serving");
    assert_eq!(got, m);
    // The garbage travels on other connections: wait (bounded) until the listener counted it.
    let start = Instant::now();
    while l.stats().refused.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "garbage never counted as refused"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The reference request is accepted byte for byte.
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_rcvtimeo(5000).unwrap();
    req.connect(&ep).unwrap();
    req.send(GET_META_MSG, 0).unwrap();
    assert_eq!(req.recv_bytes(0).unwrap(), m.encode());
}

/// vLLM 0.32's client against our listener: two frames (payload, our clock), only for the
/// ranks given a payload; serving one opens the listener's readers to unnamed agents.
#[test]
fn a_vllm_request_gets_the_vllm_payload_and_our_clock() {
    use kvxfer_core::sidechannel::{fetch_vllm, monotonic_seconds};
    use kvxfer_core::wire::vllm::{HandshakePayload, MetaRequest};

    let l = Listener::bind("127.0.0.1", 0, 0, meta("prefill", 0).encode()).expect("bind");
    let ask = |tp_rank| {
        fetch_vllm(
            "127.0.0.1",
            l.port(),
            MetaRequest {
                pp_rank: 0,
                tp_rank,
            },
            T,
            MAX_HANDSHAKE_BYTES,
        )
    };
    // No payload yet: refused, and notes from unnamed agents stay refused.
    assert!(matches!(ask(0), Err(FetchError::BadReply { .. })));
    assert!(!l.readers().unnamed_allowed());
    let payload = HandshakePayload {
        compatibility_hash: "ab".repeat(32),
        agent_metadata_bytes: vec![7; 100],
    };
    l.set_vllm_reply(0, 0, payload.encode());
    let before = monotonic_seconds();
    let got = ask(0).expect("served");
    let after = monotonic_seconds();
    assert_eq!(got.payload, payload);
    assert!(
        (before..=after).contains(&got.remote_clock),
        "{before} <= {} <= {after}: the clock is this host's monotonic clock",
        got.remote_clock
    );
    assert!((before..=after).contains(&got.local_midpoint));
    assert!(l.readers().unnamed_allowed());
    // Another rank is not served; kvxfer's own requests still are.
    assert!(matches!(ask(1), Err(FetchError::BadReply { .. })));
    assert_eq!(
        fetch_metadata("127.0.0.1", l.port(), ENGINE, None, T, MAX_HANDSHAKE_BYTES).unwrap(),
        meta("prefill", 0)
    );
}

/// A ROUTER on a free loopback port, and the port.
fn bound_router() -> (zmq::Socket, u16) {
    let router = zmq::Context::new().socket(zmq::ROUTER).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = router.get_last_endpoint().unwrap().unwrap();
    let port = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    (router, port)
}

/// vLLM's request for pipeline stage 0, TP rank 0, to the listener at `port`.
fn ask_rank_0(
    port: u16,
    timeout: Duration,
) -> Result<kvxfer_core::sidechannel::VllmReply, FetchError> {
    use kvxfer_core::wire::vllm::MetaRequest;
    let request = MetaRequest {
        pp_rank: 0,
        tp_rank: 0,
    };
    kvxfer_core::sidechannel::fetch_vllm("127.0.0.1", port, request, timeout, MAX_HANDSHAKE_BYTES)
}

/// A vLLM listener answering one frame, or a bad clock, is a typed error; one answering
/// nothing is a timeout.
#[test]
fn bad_vllm_replies_are_typed_errors() {
    use kvxfer_core::wire::vllm::{HandshakePayload, encode_clock};

    let payload = HandshakePayload {
        compatibility_hash: "0".repeat(64),
        agent_metadata_bytes: vec![1],
    }
    .encode();
    let replies: Vec<Vec<Vec<u8>>> = vec![
        vec![payload.clone()],
        vec![payload.clone(), b"not a float".to_vec()],
        vec![payload.clone(), encode_clock(f64::INFINITY)],
        vec![b"junk".to_vec(), encode_clock(1.0)],
        vec![payload, encode_clock(1.0), encode_clock(2.0)],
    ];
    for frames in replies {
        let (port, answer) = answers_late(0, frames);
        let got = ask_rank_0(port, T);
        assert!(matches!(got, Err(FetchError::BadReply { .. })), "{got:?}");
        drop(answer.join());
    }
    // Nobody answers: bounded by the timeout.
    let (_silent, port) = bound_router();
    let start = Instant::now();
    let got = ask_rank_0(port, Duration::from_millis(300));
    assert!(matches!(got, Err(FetchError::Timeout { .. })), "{got:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// A ROUTER that leaves the first `ignored` requests unanswered and answers the next with
/// `reply` (frames after the identity and delimiter); returns how many requests it read.
fn answers_late(ignored: usize, reply: Vec<Vec<u8>>) -> (u16, std::thread::JoinHandle<usize>) {
    let (router, port) = bound_router();
    let t = std::thread::spawn(move || {
        for _ in 0..ignored {
            router.recv_multipart(0).unwrap();
        }
        let req = router.recv_multipart(0).unwrap();
        let mut out = vec![req[0].clone(), Vec::new()];
        out.extend(reply);
        router.send_multipart(out, 0).unwrap();
        ignored + 1
    });
    (port, t)
}

/// A request whose reply never comes (lost with a connection, or a listener that restarted
/// in between) is asked again on a fresh socket within the timeout, for kvxfer and vLLM
/// listeners alike; a listener that never answers still fails at the timeout, named whole.
#[test]
fn an_unanswered_metadata_request_is_asked_again_within_the_timeout() {
    use kvxfer_core::wire::vllm::{HandshakePayload, encode_clock};

    let m = meta("p", 0);
    let (port, router) = answers_late(2, vec![m.encode()]);
    let got = fetch_metadata(
        "127.0.0.1",
        port,
        ENGINE,
        None,
        Duration::from_secs(20),
        MAX_HANDSHAKE_BYTES,
    );
    assert_eq!(got.expect("answered on the third attempt"), m);
    assert_eq!(router.join().unwrap(), 3);

    let payload = HandshakePayload {
        compatibility_hash: "0".repeat(64),
        agent_metadata_bytes: vec![7],
    };
    let (port, router) = answers_late(1, vec![payload.encode(), encode_clock(1.0)]);
    let got = ask_rank_0(port, Duration::from_secs(20)).expect("answered on the second attempt");
    assert_eq!(got.payload, payload);
    assert_eq!(router.join().unwrap(), 2);

    let (_silent, port) = bound_router();
    let timeout = Duration::from_millis(2500);
    let start = Instant::now();
    let got = fetch_metadata(
        "127.0.0.1",
        port,
        ENGINE,
        None,
        timeout,
        MAX_HANDSHAKE_BYTES,
    );
    let elapsed = start.elapsed();
    assert_eq!(
        got,
        Err(FetchError::Timeout {
            endpoint: format!("tcp://127.0.0.1:{port}"),
            timeout
        })
    );
    assert!(
        elapsed >= timeout,
        "gave up after {elapsed:?}, before the timeout"
    );
}
