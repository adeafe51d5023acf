//! A push prefill forgets the decodes no room needs (dead ones at once, idle ones past
//! `idle_decode_timeout`), so a long run with restarting decodes keeps its peers flat; a
//! forgotten decode that is alive registers again with its next room.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::Transport;
use kvxfer_core::clock::{Clock, ManualClock};
use kvxfer_core::push::RoomStatus;
use kvxfer_core::push::messages::{
    self, FromPrefill, RegisterArgs, RoomRequest, ToPrefill, encode,
};
use kvxfer_core::sidechannel::auth::Destination;
use kvxfer_core::sidechannel::request_bytes;
use kvxfer_core::wire::handshake::LayoutWire;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::pull_env::Model;
use kvxfer_tests::push_env::{
    DecodeSide, PrefillSide, Setup, decode, poll_until, prefill, run_room,
};

/// One prefill and one decode rank; decodes idle for 60 s are forgotten; the decode waits
/// for data far longer than the tests advance the clock.
fn setup() -> Setup {
    let mut s = Setup::new(Model::small(BlockOrder::Hnd, 4), 1, 1);
    s.aux = 0;
    s.prefill_config = |c| c.idle_decode_timeout = Duration::from_secs(60);
    s.decode_config = |c| c.waiting_timeout = Duration::from_secs(3600);
    s
}

fn manual() -> (ManualClock, Arc<dyn Clock>) {
    let m = ManualClock::default();
    let c: Arc<dyn Clock> = Arc::new(m.clone());
    (m, c)
}

fn peers(pre: &PrefillSide) -> usize {
    pre.ranks[0].transport().resource_counts().0
}

/// Room `room`: decode page `dst` from prefill page `src`, which must succeed.
fn room(pre: &mut PrefillSide, dec: &mut DecodeSide, room: u64, src: u32, dst: u32) {
    assert_eq!(
        run_room(pre, dec, room, &[src], &[dst], 1, None, (vec![], vec![])),
        vec![RoomStatus::Success],
        "{:?}",
        dec.ranks[0].error(room)
    );
}

/// 100 decodes in turn, each gone after its room (as decodes that restart under a new
/// agent name): each is forgotten at the prefill's next poll, so its peers stay flat.
#[test]
fn dead_decodes_are_forgotten_and_the_prefills_peers_stay_flat() {
    let s = setup();
    let (_m, c) = manual();
    let mut pre = prefill(&s, "fg1", Arc::clone(&c), None, None);
    for i in 0..100u64 {
        let mut dec = decode(&s, &format!("fg1-{i}"), Arc::clone(&c));
        room(&mut pre, &mut dec, i, 1, 2);
        dec.mem[0].kv.verify(&[(1, 2)]).expect("bytes");
        assert_eq!(peers(&pre), 1, "one peer while it lives ({i})");
        drop(dec);
        pre.ranks[0].poll();
        assert_eq!(peers(&pre), 0, "a dead decode is forgotten ({i})");
    }
    let m = pre.ranks[0].take_metrics();
    assert_eq!((m.forgotten_decodes, m.registrations), (100, 100));
}

/// A live decode no room named for the idle timeout is forgotten (not a second before);
/// its next room is answered "unregistered", it registers again, and the room succeeds.
#[test]
fn an_idle_decode_is_forgotten_and_registers_again_with_its_next_room() {
    let s = setup();
    let (m, c) = manual();
    let mut pre = prefill(&s, "fg2", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "fg2", c);
    room(&mut pre, &mut dec, 1, 1, 2);
    m.advance(Duration::from_secs(59));
    pre.ranks[0].poll();
    assert_eq!(peers(&pre), 1, "59 s idle: kept");
    m.advance(Duration::from_secs(1));
    pre.ranks[0].poll();
    assert_eq!(peers(&pre), 0, "60 s idle: forgotten");
    room(&mut pre, &mut dec, 2, 3, 4);
    dec.mem[0].kv.verify(&[(1, 2), (3, 4)]).expect("bytes");
    let metrics = pre.ranks[0].take_metrics();
    assert_eq!(
        (metrics.forgotten_decodes, metrics.registrations),
        (1, 2),
        "registered again once"
    );
    assert_eq!(peers(&pre), 1);
}

/// A decode whose room is still open is kept however long it has been idle, and forgotten
/// once that room ended.
#[test]
fn a_decode_an_open_room_needs_is_kept_past_the_idle_timeout() {
    let s = setup();
    let (m, c) = manual();
    let mut pre = prefill(&s, "fg3", Arc::clone(&c), None, None);
    let mut dec = decode(&s, "fg3", c);
    let port = pre.registry.port();
    dec.ranks[0].add_room(1, ("127.0.0.1", port), vec![5], None, vec![]);
    pre.ranks[0].add_room(1, 1, None, vec![]);
    poll_until(&mut pre, &mut dec, |pre, dec| {
        pre.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
            && dec.ranks[0].status(1) == Some(RoomStatus::WaitingForInput)
    });
    m.advance(Duration::from_secs(600));
    pre.ranks[0].poll();
    assert_eq!(peers(&pre), 1, "its room waits for data: kept");
    pre.ranks[0].send(1, &[3]).expect("send");
    poll_until(&mut pre, &mut dec, |pre, dec| {
        dec.ranks[0].status(1).is_some_and(RoomStatus::is_final)
            && pre.ranks[0].status(1).is_some_and(RoomStatus::is_final)
    });
    assert_eq!(dec.ranks[0].status(1), Some(RoomStatus::Success));
    dec.mem[0].kv.verify(&[(3, 5)]).expect("bytes");
    pre.ranks[0].poll();
    assert_eq!(peers(&pre), 0, "room over: forgotten");
    assert_eq!(pre.ranks[0].take_metrics().forgotten_decodes, 1);
}

/// Sends `msg` to prefill rank 0's mailbox and returns its reply.
fn ask(pre: &PrefillSide, msg: &ToPrefill) -> FromPrefill {
    let reply = request_bytes(
        "127.0.0.1",
        pre.ranks[0].port(),
        &Destination::mailbox(&pre.ranks[0].rank_info().agent),
        &encode(msg),
        Duration::from_secs(5),
        messages::MAX_MESSAGE_BYTES,
    )
    .expect("reply");
    messages::decode(&reply, "reply").expect("a reply")
}

/// A decode that does not say it registers again (an older kvxfer) is never forgotten for
/// being idle, since it would not register again; one that says so is.
#[test]
fn only_a_decode_that_registers_again_is_forgotten_when_idle() {
    let s = setup();
    let (m, c) = manual();
    let mut pre = prefill(&s, "fg4", Arc::clone(&c), None, None);
    let dec = decode(&s, "fg4", c);
    let spec = dec.mem[0].kv.spec;
    let args = |agent: &str, reregisters: bool| RegisterArgs {
        agent: agent.into(),
        agent_metadata: dec.ranks[0].transport().metadata().expect("metadata"),
        layout: LayoutWire::from_spec(&spec, 4, 2, 0),
        kv_bases: dec.mem[0].kv.bases(),
        aux: vec![],
        state: vec![],
        tp_size: 1,
        tp_rank: 0,
        reregisters,
    };
    for (agent, again) in [("fg4-old", false), ("fg4-new", true)] {
        assert_eq!(
            ask(&pre, &ToPrefill::Register(args(agent, again))),
            FromPrefill::Ok
        );
    }
    let start = Instant::now();
    while pre.ranks[0].take_metrics().registrations == 0 {
        pre.ranks[0].poll();
        assert!(start.elapsed() < Duration::from_secs(60), "never handled");
        std::thread::sleep(Duration::from_millis(1));
    }
    m.advance(Duration::from_secs(3600));
    pre.ranks[0].poll();
    assert_eq!(pre.ranks[0].take_metrics().forgotten_decodes, 1);
    let room = |agent: &str| {
        ToPrefill::Room(RoomRequest {
            room: 7,
            agent: agent.into(),
            pages: vec![1],
            aux_index: None,
            state_indices: vec![],
            digest: false,
            prefix_tokens: 0,
            group_pages: Vec::new(),
        })
    };
    assert_eq!(ask(&pre, &room("fg4-new")), FromPrefill::Unregistered);
    assert_eq!(ask(&pre, &room("fg4-old")), FromPrefill::Ok);
}

/// A prefill rank that answers a room `Unregistered` again after the decode registered once
/// more (it keeps refusing the registration) fails the room at once, naming the rank,
/// after exactly one more registration.
#[test]
fn a_room_still_unregistered_after_registering_again_fails_naming_the_rank() {
    use kvxfer_core::push::messages::RankInfo;
    use kvxfer_core::sidechannel::MessageServer;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let seen = Arc::clone(&counts);
    let mailbox = MessageServer::bind(
        "127.0.0.1",
        0,
        1 << 20,
        |_| Destination::mailbox("fg6-p0-0"),
        Box::new(
            move |bytes: &[u8]| match messages::decode::<ToPrefill>(bytes, "request") {
                Ok(ToPrefill::Register(_)) => {
                    seen.0.fetch_add(1, Ordering::SeqCst);
                    encode(&FromPrefill::Ok)
                }
                Ok(ToPrefill::Room(_)) => {
                    seen.1.fetch_add(1, Ordering::SeqCst);
                    encode(&FromPrefill::Unregistered)
                }
                _ => encode(&FromPrefill::Ok),
            },
        ),
    )
    .expect("mailbox");
    let rank = RankInfo {
        agent: "fg6-p0-0".into(),
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        dp_size: 1,
        dp_rank: 0,
        host: "127.0.0.1".into(),
        port: mailbox.port(),
        page_size: 4,
        dtype: "f16".into(),
        first_layer: 0,
        num_layers: 2,
    };
    let registry = kvxfer_tests::push_env::fake_registry(rank);
    let (_m, c) = manual();
    let mut dec = decode(&setup(), "fg6", c);
    dec.ranks[0].add_room(1, ("127.0.0.1", registry.port()), vec![5], None, vec![]);
    let start = Instant::now();
    while !dec.ranks[0].status(1).is_some_and(RoomStatus::is_final) {
        dec.ranks[0].poll();
        assert!(start.elapsed() < Duration::from_secs(60), "never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
    let error = dec.ranks[0].error(1).unwrap_or_default();
    assert!(
        error.contains("prefill rank 0 does not know this decode although it registered"),
        "{error}"
    );
    assert_eq!(
        (
            counts.0.load(Ordering::SeqCst),
            counts.1.load(Ordering::SeqCst)
        ),
        (2, 2),
        "registered, asked, registered again, asked again"
    );
}
