//! Which read-done notes free a prefill's held request, on the loopback: only notes from
//! agents that fetched the rank's metadata naming themselves, each sender once, all with
//! the reader count of the first; notes that arrive before the hold are kept for it.

use std::time::Duration;

use kvxfer_core::Transport;
use kvxfer_core::sidechannel::{fetch_metadata, fetch_metadata_for};
use kvxfer_core::wire::handshake::MAX_HANDSHAKE_BYTES;
use kvxfer_layout::BlockOrder;
use kvxfer_tests::pull_env::{Engine, Model, engine};
use kvxfer_tests::scenarios::pull::{clock, no_tune};
use kvxfer_transport_loopback::LoopbackTransport;

fn lb(name: &str) -> LoopbackTransport {
    LoopbackTransport::new(name).expect("loopback")
}

const T: Duration = Duration::from_secs(5);

/// The engine a metadata request names: bound into it only with a side-channel key, which
/// these tests do not set.
const ENGINE: &str = "any";

/// An agent that loaded the prefill's metadata and sends it whatever notes a test wants;
/// `reader` says whether it named itself in the metadata request, as kvxfer decodes do.
struct Sender {
    agent: LoopbackTransport,
    peer: kvxfer_core::PeerId,
}

impl Sender {
    fn new(name: &str, pre: &Engine<LoopbackTransport>, reader: bool) -> Self {
        let port = pre.base_port;
        let meta = if reader {
            fetch_metadata_for("127.0.0.1", port, ENGINE, 0, name, T, MAX_HANDSHAKE_BYTES)
        } else {
            fetch_metadata("127.0.0.1", port, ENGINE, None, T, MAX_HANDSHAKE_BYTES)
        }
        .expect("metadata");
        let mut agent = lb(name);
        let peer = agent.load_peer(&meta.agent_metadata).expect("load prefill");
        Sender { agent, peer }
    }

    fn note(&mut self, text: &str) {
        self.agent
            .send_notification(self.peer, text.as_bytes())
            .expect("send");
    }
}

fn prefill(name: &str) -> Engine<LoopbackTransport> {
    engine(
        name,
        &Model::small(BlockOrder::Hnd, 4),
        1,
        true,
        clock(),
        &lb,
        &no_tune,
    )
}

/// What the prefill freed in one poll.
fn freed(pre: &mut Engine<LoopbackTransport>) -> Vec<String> {
    pre.poll().remove(0).sending
}

#[test]
fn notes_from_an_agent_that_never_fetched_our_metadata_are_dropped() {
    let mut pre = prefill("notes1-P");
    let _ = pre.finish_prefill("r", &[1]);
    let mut outsider = Sender::new("notes1-X", &pre, false);
    outsider.note("r:1");
    outsider.note("kvxfer-hb:r");
    assert!(
        freed(&mut pre).is_empty(),
        "an outsider freed a held request"
    );
    assert_eq!(pre.workers[0].take_metrics().refused_notes, 2);
    let mut reader = Sender::new("notes1-D", &pre, true);
    // A note that is no pull note at all is counted as unknown, whoever sends it.
    reader.note("not a pull note");
    outsider.note("not a pull note either");
    assert!(freed(&mut pre).is_empty());
    assert_eq!(pre.workers[0].unknown_notifications(), 2);
    assert_eq!(pre.workers[0].take_metrics().refused_notes, 0);
    reader.note("r:1");
    assert_eq!(freed(&mut pre), vec!["r".to_string()]);
}

#[test]
fn a_request_with_two_readers_is_freed_by_the_second_reader_only() {
    let mut pre = prefill("notes2-P");
    let _ = pre.finish_prefill("r", &[1]);
    let mut a = Sender::new("notes2-A", &pre, true);
    let mut b = Sender::new("notes2-B", &pre, true);
    a.note("r:2");
    assert!(
        freed(&mut pre).is_empty(),
        "freed on the first of two notes"
    );
    // The same reader again, or another count, does not stand in for the second reader.
    a.note("r:2");
    b.note("r:1");
    assert!(
        freed(&mut pre).is_empty(),
        "freed by a repeat or a changed count"
    );
    assert_eq!(pre.workers[0].take_metrics().refused_notes, 2);
    b.note("r:2");
    assert_eq!(freed(&mut pre), vec!["r".to_string()]);
}

#[test]
fn a_note_before_the_hold_is_kept_and_frees_the_request_when_held() {
    let mut pre = prefill("notes3-P");
    let mut reader = Sender::new("notes3-D", &pre, true);
    reader.note("early:1");
    assert!(freed(&mut pre).is_empty(), "nothing is held yet");
    assert_eq!(pre.workers[0].take_metrics().refused_notes, 0);
    reader.note("early:1");
    assert!(freed(&mut pre).is_empty());
    assert_eq!(
        pre.workers[0].take_metrics().refused_notes,
        1,
        "the repeat is refused before the hold too"
    );
    let _ = pre.finish_prefill("early", &[2]);
    assert_eq!(freed(&mut pre), vec!["early".to_string()]);
    assert_eq!(pre.workers[0].take_metrics().expired_leases, 0);
}
