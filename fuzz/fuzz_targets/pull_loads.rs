//! The pull decode's loads (`kvxfer_core::pull::loads`): a step's loads (some with unusable
//! params, some only notifying the prefill) and waits, handshakes that succeed or fail,
//! loads posted or ended at once, READs that end, connections lost, engines reported gone,
//! connections closed, reports taken, in any order, for a few request ids on a few engines.
//! The fuzz target plays the driver and checks the machine against a model after every
//! step: what each admission says, that a handshake starts only for an engine not known and
//! a load is issued only on a connected one, that the loads queued behind a handshake come
//! back in order, and that every load is reported exactly once, only once out of flight,
//! failed ones in `failed` too, and loads that only notify never.
#![no_main]
use std::collections::HashMap;

use kvxfer_core::pull::FailurePolicy;
use kvxfer_core::pull::RecvRequest;
use kvxfer_core::pull::loads::{Admission, InFlight, Loads};
use libfuzzer_sys::fuzz_target;

/// The driver's load: its request.
struct Load(RecvRequest);

impl InFlight for Load {
    fn req(&self) -> &RecvRequest {
        &self.0
    }
}

/// An engine as the model sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Handshaking,
    Ready,
}

/// A request as the model sees it.
#[derive(Clone, PartialEq, Eq, Debug)]
enum State {
    /// Queued behind its engine's handshake.
    Queued,
    /// Posted: in flight on its engine.
    Loading,
    /// Reported, not yet taken (`failed` says whether as failed).
    Reported { failed: bool },
}

fn request(id: u8, engine: u8, flags: u8) -> RecvRequest {
    let notify_only = flags & 1 != 0;
    RecvRequest {
        req_id: format!("r{id}"),
        remote_req_id: format!("p{id}"),
        local_block_ids: if notify_only {
            vec![Vec::new()]
        } else {
            vec![vec![u32::from(id)]]
        },
        engine_id: format!("e{engine}"),
        host: "h".into(),
        port: 1,
        remote_block_ids: vec![vec![u32::from(id)]],
        protocol: Default::default(),
        remote_tp_size: None,
        remote_expiry: None,
        tokens: None,
        stamp: None,
        refused: (flags & 2 != 0).then(|| "bad params".into()),
    }
}

/// The model's record of a load reported: failed or not; a load that only notifies is never
/// reported, and leaves the model.
fn report(reqs: &mut HashMap<String, (RecvRequest, State)>, req: RecvRequest, failed: bool) {
    let key = req.req_id.clone();
    if req.notify_only() {
        reqs.remove(&key);
    } else {
        reqs.insert(key, (req, State::Reported { failed }));
    }
}

fuzz_target!(|data: &[u8]| {
    let mut m: Loads<(), Load> = Loads::new(FailurePolicy::Fail);
    let mut engines: HashMap<String, Engine> = HashMap::new();
    let mut reqs: HashMap<String, (RecvRequest, State)> = HashMap::new();
    // The queue behind each engine's handshake, in order.
    let mut queues: HashMap<String, Vec<String>> = HashMap::new();
    let mut waiting: HashMap<String, String> = HashMap::new();
    let mut bytes = data.iter().copied();

    // What the model says when a load of `req` is issued on a connected engine: the driver
    // posts it, or (the low bit of `how`) it ends at once, done or (bit 1) failed.
    let issue = |m: &mut Loads<(), Load>,
                 reqs: &mut HashMap<String, (RecvRequest, State)>,
                 req: RecvRequest,
                 how: u8| {
        if how & 1 == 0 {
            m.start(Load(req.clone()));
            reqs.insert(req.req_id.clone(), (req, State::Loading));
        } else if how & 2 == 0 {
            m.done(&req);
            report(reqs, req, false);
        } else {
            m.fail(req.clone(), "post failed".into());
            report(reqs, req, true);
        }
    };

    while let Some(op) = bytes.next() {
        let arg = bytes.next().unwrap_or(0);
        let (id, engine) = (op >> 4, (op >> 2) & 3);
        let engine_id = format!("e{engine}");
        match op & 3 {
            0 => {
                // A load the step asks for.
                let req = request(id, engine, arg);
                let key = req.req_id.clone();
                let admission = m.admit(&req);
                waiting.remove(&key);
                if reqs.contains_key(&key) {
                    assert_eq!(
                        admission,
                        Admission::Refused(kvxfer_core::pull::LoadRefused::AlreadyInFlight(
                            key.clone()
                        ))
                    );
                    continue;
                }
                if req.refused.is_some() {
                    assert_eq!(admission, Admission::Failed);
                    report(&mut reqs, req, true);
                    continue;
                }
                match engines.get(&engine_id).copied() {
                    Some(Engine::Ready) => {
                        assert_eq!(admission, Admission::Issue);
                        issue(&mut m, &mut reqs, req, arg >> 2);
                    }
                    Some(Engine::Handshaking) => {
                        assert_eq!(admission, Admission::Queued);
                        queues.entry(engine_id).or_default().push(key.clone());
                        reqs.insert(key, (req, State::Queued));
                    }
                    None => {
                        assert_eq!(admission, Admission::Handshake);
                        engines.insert(engine_id.clone(), Engine::Handshaking);
                        queues.entry(engine_id).or_default().push(key.clone());
                        reqs.insert(key, (req, State::Queued));
                    }
                }
            }
            1 => {
                // A request begins waiting (handshaking ahead when its engine is unknown),
                // or stops.
                let req = request(id, engine, 0);
                if arg & 0x40 == 0 {
                    let known = engines.contains_key(&engine_id);
                    assert_eq!(m.wait(&req), !known);
                    if !known {
                        engines.insert(engine_id, Engine::Handshaking);
                    }
                    waiting.insert(req.req_id.clone(), req.engine_id);
                } else {
                    m.unwait(&req.req_id);
                    waiting.remove(&req.req_id);
                }
            }
            2 => {
                // A handshake ends, for an engine being handshaken with.
                if engines.get(&engine_id) != Some(&Engine::Handshaking) {
                    continue;
                }
                let queued = queues.remove(&engine_id).unwrap_or_default();
                if arg & 1 == 0 {
                    engines.insert(engine_id.clone(), Engine::Ready);
                    let back = m.connected(&engine_id, ());
                    let ids: Vec<String> = back.iter().map(|r| r.req_id.clone()).collect();
                    assert_eq!(ids, queued, "queued loads come back in order");
                    for (i, req) in back.into_iter().enumerate() {
                        issue(&mut m, &mut reqs, req, arg.rotate_right(i as u32 % 8));
                    }
                } else {
                    engines.remove(&engine_id);
                    m.handshake_failed(&engine_id, "refused");
                    for key in queued {
                        let (req, _) = reqs.remove(&key).expect("queued");
                        report(&mut reqs, req, true);
                    }
                }
            }
            _ => match arg & 7 {
                0 | 1 => {
                    // A load's READs end: it leaves flight and is reported.
                    let key = format!("r{id}");
                    let loading = matches!(reqs.get(&key), Some((_, State::Loading)));
                    let taken = m.take(&key);
                    assert_eq!(taken.is_some(), loading, "{key} in flight");
                    if let Some(Load(req)) = taken {
                        let failed = arg & 1 == 1;
                        if failed {
                            m.fail(req.clone(), "transfer failed".into());
                        } else {
                            m.done(&req);
                        }
                        report(&mut reqs, req, failed);
                    }
                }
                2 => {
                    // The connection fails: its loads in flight come back to be failed.
                    let lost = m.lose(&engine_id);
                    assert_eq!(
                        lost.is_some(),
                        engines.get(&engine_id) == Some(&Engine::Ready)
                    );
                    let Some(((), loads)) = lost else { continue };
                    engines.remove(&engine_id);
                    let mut ids: Vec<String> = loads.iter().map(|l| l.0.req_id.clone()).collect();
                    ids.sort();
                    let mut want: Vec<String> = reqs
                        .iter()
                        .filter(|(_, (r, s))| *s == State::Loading && r.engine_id == engine_id)
                        .map(|(k, _)| k.clone())
                        .collect();
                    want.sort();
                    assert_eq!(ids, want, "the loads on the lost connection");
                    for Load(req) in loads {
                        m.fail(req.clone(), "lost".into());
                        report(&mut reqs, req, true);
                    }
                }
                3 => {
                    // Discovery says the engine is gone while its handshake runs on: the
                    // loads queued behind it fail now.
                    let taken = m.take_queued(&engine_id);
                    let ids: Vec<String> = taken.iter().map(|r| r.req_id.clone()).collect();
                    assert_eq!(ids, queues.remove(&engine_id).unwrap_or_default());
                    for req in taken {
                        m.fail(req.clone(), "gone".into());
                        report(&mut reqs, req, true);
                    }
                }
                4 => {
                    // A connection no load needs is closed.
                    let busy = reqs
                        .values()
                        .any(|(r, s)| r.engine_id == engine_id && *s == State::Loading);
                    if busy || queues.contains_key(&engine_id) {
                        continue;
                    }
                    let closed = m.close(&engine_id);
                    assert_eq!(
                        closed.is_some(),
                        engines.get(&engine_id) == Some(&Engine::Ready)
                    );
                    if closed.is_some() {
                        engines.remove(&engine_id);
                    }
                }
                _ => {
                    // The step's reports are taken.
                    let (mut recving, failed) = m.take_finished();
                    recving.sort();
                    let mut want: Vec<String> = reqs
                        .iter()
                        .filter(|(_, (_, s))| matches!(s, State::Reported { .. }))
                        .map(|(k, _)| k.clone())
                        .collect();
                    want.sort();
                    assert_eq!(recving, want, "each load reported once, out of flight");
                    let mut failed_ids: Vec<String> =
                        failed.iter().map(|f| f.req_id.clone()).collect();
                    failed_ids.sort();
                    let mut want_failed: Vec<String> = reqs
                        .iter()
                        .filter(|(_, (_, s))| *s == State::Reported { failed: true })
                        .map(|(k, _)| k.clone())
                        .collect();
                    want_failed.sort();
                    assert_eq!(failed_ids, want_failed);
                    for f in &failed {
                        let (req, _) = &reqs[&f.req_id];
                        assert_eq!(f.invalid_blocks, req.all_local_blocks());
                    }
                    reqs.retain(|_, (_, s)| !matches!(s, State::Reported { .. }));
                }
            },
        }
        // After every step: the machine's view of flight and waits is the model's.
        for i in 0..16u8 {
            let key = format!("r{i}");
            assert_eq!(m.in_flight(&key), reqs.contains_key(&key), "{key}");
            assert_eq!(m.is_waiting(&key), waiting.contains_key(&key), "{key}");
        }
        let loading = reqs.values().filter(|(_, s)| *s == State::Loading).count();
        assert_eq!(m.loading(), loading);
        for e in 0..4 {
            let engine_id = format!("e{e}");
            assert_eq!(
                m.connection(&engine_id).is_some(),
                engines.get(&engine_id) == Some(&Engine::Ready)
            );
            assert_eq!(m.has_queued(&engine_id), queues.contains_key(&engine_id));
        }
    }
});
