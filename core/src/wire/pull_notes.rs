//! The pull connector's notifications between decode and prefill workers (read notes, lease
//! heartbeats, vLLM's `HB:` heartbeats).

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

/// Prefix of lease heartbeats (kvxfer peers only; reference peers never receive them).
pub const HEARTBEAT_PREFIX: &str = "kvxfer-hb:";
/// Prefix of vLLM 0.32's heartbeats, `HB:` and a comma-separated list of request ids.
pub const VLLM_HEARTBEAT_PREFIX: &str = "HB:";

/// A notification the prefill side understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullNote<'a> {
    /// `"{req_id}:{readers}"`: one reader finished; the request has `readers` in total.
    Read {
        /// Request id.
        req_id: &'a str,
        /// Readers to wait for.
        readers: u32,
    },
    /// `"kvxfer-hb:{req_id}"`: the decode still wants the request's blocks.
    Heartbeat {
        /// Request id.
        req_id: &'a str,
    },
    /// `"HB:{id},{id},..."`: vLLM 0.32's heartbeat for several requests.
    Heartbeats {
        /// The request ids, comma-separated (empty ids are skipped).
        req_ids: &'a str,
    },
}

/// The read-done message.
pub fn read_done(req_id: &str, readers: u32) -> Vec<u8> {
    format!("{req_id}:{readers}").into_bytes()
}

/// The heartbeat message.
pub fn heartbeat(req_id: &str) -> Vec<u8> {
    format!("{HEARTBEAT_PREFIX}{req_id}").into_bytes()
}

/// vLLM 0.32's heartbeat for `req_ids`, and the ids it cannot name. vLLM splits the list at
/// commas, so an id holding one would renew the leases of the requests its parts name (and
/// not its own), and an empty one names nothing: those are left out, for the caller to
/// report. `None` where no id is left.
pub fn vllm_heartbeat<'a>(req_ids: &[&'a str]) -> (Option<Vec<u8>>, Vec<&'a str>) {
    let (named, left_out): (Vec<&str>, Vec<&str>) = req_ids
        .iter()
        .partition(|id| !id.is_empty() && !id.contains(','));
    let note = (!named.is_empty())
        .then(|| format!("{VLLM_HEARTBEAT_PREFIX}{}", named.join(",")).into_bytes());
    (note, left_out)
}

/// The read note a heartbeat's text also reads as, if any: its request id and reader count.
/// Request ids are the client's to choose (vLLM takes `X-Request-Id`), so one may start with
/// a heartbeat prefix, and its read note (`{req_id}:{readers}`, vLLM's format) then parses
/// as a heartbeat; the prefill reads it so when it holds that request (see
/// [`crate::pull::holds::Holds::note`]).
pub fn also_read(note: &PullNote<'_>) -> Option<(String, u32)> {
    let (prefix, body) = match *note {
        PullNote::Read { .. } => return None,
        PullNote::Heartbeat { req_id } => (HEARTBEAT_PREFIX, req_id),
        PullNote::Heartbeats { req_ids } => (VLLM_HEARTBEAT_PREFIX, req_ids),
    };
    let (rest, readers) = body.rsplit_once(':')?;
    let readers: u32 = readers.parse().ok()?;
    (readers > 0).then(|| (format!("{prefix}{rest}"), readers))
}

/// Parses a notification; anything else is `None` (dropped and counted by the caller).
pub fn parse(message: &[u8]) -> Option<PullNote<'_>> {
    let text = std::str::from_utf8(message).ok()?;
    if let Some(req_id) = text.strip_prefix(HEARTBEAT_PREFIX) {
        return (!req_id.is_empty()).then_some(PullNote::Heartbeat { req_id });
    }
    // Before read notes: `HB:1` would otherwise read as request `HB`, one reader.
    if let Some(req_ids) = text.strip_prefix(VLLM_HEARTBEAT_PREFIX) {
        return (!req_ids.is_empty()).then_some(PullNote::Heartbeats { req_ids });
    }
    let (req_id, readers) = text.rsplit_once(':')?;
    let readers: u32 = readers.parse().ok()?;
    (!req_id.is_empty() && readers > 0).then_some(PullNote::Read { req_id, readers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_round_trip_and_junk_is_none() {
        assert_eq!(
            parse(&read_done("cmpl-1:x", 2)),
            Some(PullNote::Read {
                req_id: "cmpl-1:x",
                readers: 2
            })
        );
        assert_eq!(
            parse(&heartbeat("r")),
            Some(PullNote::Heartbeat { req_id: "r" })
        );
        let (note, left_out) = vllm_heartbeat(&["0-a1", "1-b2"]);
        assert!(left_out.is_empty());
        assert_eq!(
            parse(&note.unwrap()),
            Some(PullNote::Heartbeats {
                req_ids: "0-a1,1-b2"
            })
        );
        assert_eq!(parse(b"HB:7"), Some(PullNote::Heartbeats { req_ids: "7" }));
        for junk in [
            &b""[..],
            b"r",
            b":3",
            b"r:0",
            b"r:-1",
            b"r:x",
            b"\xff\xfe:1",
            b"kvxfer-hb:",
            b"HB:",
        ] {
            assert_eq!(parse(junk), None, "{junk:?}");
        }
    }

    /// A request whose id starts with a heartbeat prefix: its read note parses as a
    /// heartbeat and also as its read note; a plain heartbeat reads as nothing else.
    #[test]
    fn a_read_note_of_an_id_with_a_heartbeat_prefix_also_reads_as_itself() {
        for id in ["HB:x", "kvxfer-hb:y", "HB:a:b", "HB:"] {
            let msg = read_done(id, 2);
            let note = parse(&msg).expect("parses");
            assert!(!matches!(note, PullNote::Read { .. }), "{note:?}");
            assert_eq!(also_read(&note), Some((id.to_string(), 2)), "{id}");
        }
        for plain in [&b"HB:a,b"[..], b"kvxfer-hb:r", b"HB:a:0", b"HB:a:x"] {
            assert_eq!(also_read(&parse(plain).expect("parses")), None, "{plain:?}");
        }
        assert_eq!(
            also_read(&PullNote::Read {
                req_id: "r",
                readers: 1
            }),
            None
        );
    }

    /// vLLM splits a heartbeat at commas: an id holding one, or an empty one, is left out
    /// and reported rather than renewing other requests' leases.
    #[test]
    fn a_vllm_heartbeat_leaves_out_ids_vllm_would_split() {
        let (note, left_out) = vllm_heartbeat(&["a", "b,c", "", "d"]);
        assert_eq!(note.as_deref(), Some(&b"HB:a,d"[..]));
        assert_eq!(left_out, ["b,c", ""]);
        assert_eq!(vllm_heartbeat(&["x,y"]), (None, vec!["x,y"]));
        assert_eq!(vllm_heartbeat(&[]), (None, vec![]));
    }
}
