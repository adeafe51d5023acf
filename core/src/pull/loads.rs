//! The decode side's loads, without I/O: which prefill engines are connected or being
//! handshaken with, the loads queued behind a handshake, the requests waiting for blocks,
//! the loads in flight, and what the engine is told of each. Events go in (a step's loads
//! and waits, a handshake's outcome, a load's end, a lost connection); what the driver must
//! do comes out ([`Admission`]: start a handshake, issue a load). [`super::PullWorker`] is
//! the driver: it does the handshakes, the READs and the notes, and keeps each connection's
//! and each load's I/O state in the `C` and `L` this machine holds for it. The `pull_loads`
//! fuzz target drives it against a model.
//!
//! What it guarantees, whatever the order of events:
//! - a load is reported once (in `recving`, and in `failed` too when it failed), and only
//!   after the driver took it out of flight: never while a READ may still land in its blocks;
//! - a load of a request already in flight (queued, loading, or reported and not yet taken)
//!   is refused, and the first one continues untouched;
//! - one handshake per engine at a time; a load is issued only on a connected engine, and the
//!   loads queued behind a handshake are issued, in order, or failed, when it ends;
//! - a load that only notifies the prefill (no local block) is never reported.
//!
//! Public for the fuzz targets; engines use [`PullWorker`](crate::pull::PullWorker).

use std::collections::HashMap;

use super::config::FailurePolicy;
use super::scheduler::RecvRequest;

/// A load in the step metadata that was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadRefused {
    /// A load of this request id is already in flight (loading, waiting for its
    /// handshake, or ended and not yet reported): the first one continues untouched.
    #[error("a load of request {0} is already in flight")]
    AlreadyInFlight(String),
}

/// A load that could not complete: its local blocks hold no valid data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedLoad {
    /// Request id.
    pub req_id: String,
    /// Local blocks whose content is invalid.
    pub invalid_blocks: Vec<u32>,
    /// Why.
    pub reason: String,
    /// What the engine should do.
    pub policy: FailurePolicy,
}

/// What the driver does with a load the step asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Not started: another load of the request is in flight.
    Refused(LoadRefused),
    /// Failed at once (its params were unusable): reported with its blocks.
    Failed,
    /// Its engine is connected: post its READs now.
    Issue,
    /// Queued behind the engine's handshake in flight.
    Queued,
    /// Queued behind a handshake with its engine, which the driver starts now.
    Handshake,
}

/// A prefill engine as the decode knows it.
#[derive(Debug)]
pub enum Conn<C> {
    /// A handshake with it is in flight.
    Handshaking,
    /// Connected: the driver's connection state.
    Ready(C),
}

/// The driver's state of a load in flight: the machine only needs its request.
pub trait InFlight {
    /// The request the load fills.
    fn req(&self) -> &RecvRequest;
}

/// The decode side's loads: `C` is the driver's state of a connection, `L` of a load.
#[derive(Debug)]
pub struct Loads<C, L> {
    engines: HashMap<String, Conn<C>>,
    queued: HashMap<String, Vec<RecvRequest>>,
    waiting: HashMap<String, RecvRequest>,
    loads: HashMap<String, L>,
    recving: Vec<String>,
    failed: Vec<FailedLoad>,
    policy: FailurePolicy,
}

impl<C, L: InFlight> Loads<C, L> {
    /// No engine, no load; failures carry `policy`.
    pub fn new(policy: FailurePolicy) -> Self {
        Loads {
            engines: HashMap::new(),
            queued: HashMap::new(),
            waiting: HashMap::new(),
            loads: HashMap::new(),
            recving: Vec::new(),
            failed: Vec::new(),
            policy,
        }
    }

    /// Whether a load of `req_id` started and the engine has not yet been told it ended.
    pub fn in_flight(&self, req_id: &str) -> bool {
        self.loads.contains_key(req_id)
            || self.queued.values().flatten().any(|r| r.req_id == req_id)
            || self.recving.iter().any(|r| r == req_id)
    }

    /// A load the step asks for. It no longer waits; see [`Admission`] for what follows.
    pub fn admit(&mut self, req: &RecvRequest) -> Admission {
        self.waiting.remove(&req.req_id);
        if self.in_flight(&req.req_id) {
            return Admission::Refused(LoadRefused::AlreadyInFlight(req.req_id.clone()));
        }
        if let Some(why) = &req.refused {
            // Nothing was posted: the load fails in this step, with its blocks.
            let reason = format!("unusable kv_transfer_params: {why}");
            self.fail(req.clone(), reason);
            return Admission::Failed;
        }
        let admission = match self.engines.get(&req.engine_id) {
            Some(Conn::Ready(_)) => return Admission::Issue,
            Some(Conn::Handshaking) => Admission::Queued,
            None => {
                self.engines
                    .insert(req.engine_id.clone(), Conn::Handshaking);
                Admission::Handshake
            }
        };
        self.queued
            .entry(req.engine_id.clone())
            .or_default()
            .push(req.clone());
        admission
    }

    /// A request begins waiting for blocks to load into: heartbeated like a load. True when
    /// the driver should handshake with its engine now (none is known), ahead of the load.
    pub fn wait(&mut self, req: &RecvRequest) -> bool {
        self.waiting.insert(req.req_id.clone(), req.clone());
        if self.engines.contains_key(&req.engine_id) {
            return false;
        }
        self.engines
            .insert(req.engine_id.clone(), Conn::Handshaking);
        true
    }

    /// A request stops waiting (its load starts elsewhere, or it ended).
    pub fn unwait(&mut self, req_id: &str) {
        self.waiting.remove(req_id);
    }

    /// Whether `req_id` waits for blocks.
    pub fn is_waiting(&self, req_id: &str) -> bool {
        self.waiting.contains_key(req_id)
    }

    /// The handshake with `engine_id` succeeded: it is connected, and the loads queued
    /// behind it come back, in order, for the driver to issue.
    pub fn connected(&mut self, engine_id: &str, conn: C) -> Vec<RecvRequest> {
        self.engines
            .insert(engine_id.to_string(), Conn::Ready(conn));
        self.queued.remove(engine_id).unwrap_or_default()
    }

    /// The handshake with `engine_id` failed: the engine is forgotten (a later load tries
    /// again), and the loads queued behind it fail.
    pub fn handshake_failed(&mut self, engine_id: &str, reason: &str) {
        self.engines.remove(engine_id);
        for req in self.queued.remove(engine_id).unwrap_or_default() {
            self.fail(req, format!("handshake with {engine_id} failed: {reason}"));
        }
    }

    /// The connection to `engine_id`, when connected.
    pub fn connection(&self, engine_id: &str) -> Option<&C> {
        match self.engines.get(engine_id) {
            Some(Conn::Ready(c)) => Some(c),
            _ => None,
        }
    }

    /// The connection to `engine_id`, mutably.
    pub fn connection_mut(&mut self, engine_id: &str) -> Option<&mut C> {
        match self.engines.get_mut(engine_id) {
            Some(Conn::Ready(c)) => Some(c),
            _ => None,
        }
    }

    /// Every connection, with its engine.
    pub fn connections(&self) -> impl Iterator<Item = (&String, &C)> {
        self.engines.iter().filter_map(|(e, c)| match c {
            Conn::Ready(c) => Some((e, c)),
            Conn::Handshaking => None,
        })
    }

    /// Whether loads are queued behind a handshake with `engine_id`.
    pub fn has_queued(&self, engine_id: &str) -> bool {
        self.queued.contains_key(engine_id)
    }

    /// Whether any load is queued behind a handshake.
    pub fn any_queued(&self) -> bool {
        self.queued.values().any(|q| !q.is_empty())
    }

    /// Forgets the connection to `engine_id` and returns it, with the loads in flight on it
    /// (all posted on this connection: a new one is made only once it is gone). The driver
    /// cancels their READs and reports them ([`Loads::fail`]). `None` unless connected.
    pub fn lose(&mut self, engine_id: &str) -> Option<(C, Vec<L>)> {
        if !matches!(self.engines.get(engine_id), Some(Conn::Ready(_))) {
            return None;
        }
        let Some(Conn::Ready(conn)) = self.engines.remove(engine_id) else {
            return None;
        };
        let doomed: Vec<String> = self
            .loads
            .iter()
            .filter(|(_, l)| l.req().engine_id == engine_id)
            .map(|(id, _)| id.clone())
            .collect();
        let loads = doomed
            .iter()
            .filter_map(|id| self.loads.remove(id))
            .collect();
        Some((conn, loads))
    }

    /// Closes the connection to `engine_id`, which no load uses (the driver checked), and
    /// returns it. `None` unless connected.
    pub fn close(&mut self, engine_id: &str) -> Option<C> {
        if !matches!(self.engines.get(engine_id), Some(Conn::Ready(_))) {
            return None;
        }
        match self.engines.remove(engine_id) {
            Some(Conn::Ready(c)) => Some(c),
            _ => None,
        }
    }

    /// The loads queued behind a handshake with `engine_id`, taken out: its engine was lost
    /// while the handshake runs (the handshake goes on and serves later loads).
    pub fn take_queued(&mut self, engine_id: &str) -> Vec<RecvRequest> {
        self.queued.remove(engine_id).unwrap_or_default()
    }

    /// A load whose READs were posted: in flight until the driver takes it out.
    pub fn start(&mut self, load: L) {
        self.loads.insert(load.req().req_id.clone(), load);
    }

    /// Takes a load out of flight (its READs ended, or it is to be reported).
    pub fn take(&mut self, req_id: &str) -> Option<L> {
        self.loads.remove(req_id)
    }

    /// The load in flight of `req_id`, mutably.
    pub fn load_mut(&mut self, req_id: &str) -> Option<&mut L> {
        self.loads.get_mut(req_id)
    }

    /// The loads in flight.
    pub fn loads(&self) -> impl Iterator<Item = &L> {
        self.loads.values()
    }

    /// The loads in flight, mutably, with their request ids.
    pub fn loads_mut(&mut self) -> impl Iterator<Item = (&String, &mut L)> {
        self.loads.iter_mut()
    }

    /// Loads in flight.
    pub fn loading(&self) -> usize {
        self.loads.len()
    }

    /// Takes every load out of flight (shutdown).
    pub fn drain(&mut self) -> Vec<L> {
        self.queued.clear();
        self.loads.drain().map(|(_, l)| l).collect()
    }

    /// Takes every connection out (shutdown).
    pub fn drain_connections(&mut self) -> Vec<C> {
        self.engines
            .drain()
            .filter_map(|(_, c)| match c {
                Conn::Ready(c) => Some(c),
                Conn::Handshaking => None,
            })
            .collect()
    }

    /// The requests loading or (with `waiting`) waiting to load, each once.
    pub fn requests(&self, waiting: bool) -> impl Iterator<Item = &RecvRequest> {
        let waits = self.waiting.values().filter(move |_| waiting);
        self.loads.values().map(InFlight::req).chain(waits)
    }

    /// The engines that requests load from (and, with `waiting`, wait to), each once.
    pub fn engines_of(&self, waiting: bool) -> Vec<String> {
        let mut engines: Vec<String> = self
            .requests(waiting)
            .map(|r| r.engine_id.clone())
            .collect();
        engines.sort_unstable();
        engines.dedup();
        engines
    }

    /// Reports a load done, out of flight (a load that only notified is not reported).
    pub fn done(&mut self, req: &RecvRequest) {
        if !req.notify_only() {
            self.recving.push(req.req_id.clone());
        }
    }

    /// Reports a load failed, out of flight, with its blocks (a load that only notified is
    /// not reported: the engine never waited for it, and the prefill's lease ends the hold
    /// its note would have).
    pub fn fail(&mut self, req: RecvRequest, reason: String) {
        if req.notify_only() {
            tracing::warn!(req = %req.req_id, engine = %req.engine_id, "read-done note for a prefix the engine held already not sent: {reason}");
            return;
        }
        self.recving.push(req.req_id.clone());
        let invalid_blocks = req.all_local_blocks();
        self.failed.push(FailedLoad {
            req_id: req.req_id,
            invalid_blocks,
            reason,
            policy: self.policy,
        });
    }

    /// The loads reported since the last call: ended (failed ones too), and failed.
    pub fn take_finished(&mut self) -> (Vec<String>, Vec<FailedLoad>) {
        (
            std::mem::take(&mut self.recving),
            std::mem::take(&mut self.failed),
        )
    }

    /// Forgets queued loads and waits (shutdown).
    pub fn clear(&mut self) {
        self.queued.clear();
        self.waiting.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Load(RecvRequest);

    impl InFlight for Load {
        fn req(&self) -> &RecvRequest {
            &self.0
        }
    }

    fn req(id: &str, engine: &str) -> RecvRequest {
        RecvRequest {
            req_id: id.into(),
            remote_req_id: format!("p-{id}"),
            local_block_ids: vec![vec![1, 2]],
            engine_id: engine.into(),
            host: "h".into(),
            port: 1,
            remote_block_ids: vec![vec![3, 4]],
            protocol: Default::default(),
            remote_tp_size: None,
            remote_expiry: None,
            tokens: None,
            stamp: None,
            refused: None,
        }
    }

    fn machine() -> Loads<u32, Load> {
        Loads::new(FailurePolicy::Recompute)
    }

    /// The first load of an engine handshakes, the next queue behind it and come back in
    /// order once connected; then loads issue at once; a request in flight is refused.
    #[test]
    fn loads_queue_behind_one_handshake_and_issue_once_connected() {
        let mut m = machine();
        assert_eq!(m.admit(&req("a", "e")), Admission::Handshake);
        assert_eq!(m.admit(&req("b", "e")), Admission::Queued);
        assert_eq!(
            m.admit(&req("a", "e")),
            Admission::Refused(LoadRefused::AlreadyInFlight("a".into()))
        );
        assert!(m.has_queued("e") && m.any_queued() && m.connection("e").is_none());
        let back: Vec<String> = m.connected("e", 7).into_iter().map(|r| r.req_id).collect();
        assert_eq!(back, ["a", "b"]);
        assert_eq!(m.connection("e"), Some(&7));
        assert!(!m.has_queued("e") && !m.any_queued());
        assert_eq!(m.admit(&req("c", "e")), Admission::Issue);
        m.start(Load(req("c", "e")));
        assert!(m.in_flight("c"));
        assert_eq!(m.loading(), 1);
        assert_eq!(m.engines_of(false), ["e"]);
    }

    /// A load is reported once out of flight; until its report is taken, another load of it
    /// is refused; failures carry the blocks and the policy; loads that only notify are not
    /// reported.
    #[test]
    fn a_load_is_reported_once_and_only_out_of_flight() {
        let mut m = machine();
        m.connected("e", 1);
        m.start(Load(req("a", "e")));
        m.start(Load(req("b", "e")));
        assert_eq!(m.take_finished(), (Vec::new(), Vec::new()));
        let a = m.take("a").expect("in flight");
        m.done(&a.0);
        let b = m.take("b").expect("in flight");
        m.fail(b.0, "transfer failed".into());
        assert!(m.in_flight("a"), "reported, not yet taken");
        assert!(matches!(m.admit(&req("a", "e")), Admission::Refused(_)));
        let (recving, failed) = m.take_finished();
        assert_eq!(recving, ["a", "b"]);
        assert_eq!(
            failed,
            [FailedLoad {
                req_id: "b".into(),
                invalid_blocks: vec![1, 2],
                reason: "transfer failed".into(),
                policy: FailurePolicy::Recompute,
            }]
        );
        assert!(!m.in_flight("a"));
        let mut notify = req("n", "e");
        notify.local_block_ids = vec![Vec::new()];
        m.done(&notify);
        m.fail(notify, "x".into());
        assert_eq!(m.take_finished(), (Vec::new(), Vec::new()));
    }

    /// Unusable params fail the load at once, with its blocks; a failed handshake fails the
    /// loads queued behind it and forgets the engine, so the next load handshakes again.
    #[test]
    fn refused_params_and_failed_handshakes_fail_their_loads() {
        let mut m = machine();
        let mut bad = req("x", "e");
        bad.refused = Some("no blocks".into());
        assert_eq!(m.admit(&bad), Admission::Failed);
        assert_eq!(m.admit(&req("a", "e")), Admission::Handshake);
        assert_eq!(m.admit(&req("b", "e")), Admission::Queued);
        m.handshake_failed("e", "timed out");
        let (recving, failed) = m.take_finished();
        assert_eq!(recving, ["x", "a", "b"]);
        assert_eq!(failed[0].reason, "unusable kv_transfer_params: no blocks");
        assert_eq!(failed[1].reason, "handshake with e failed: timed out");
        assert!(!m.has_queued("e"));
        assert_eq!(m.admit(&req("c", "e")), Admission::Handshake);
    }

    /// A lost connection gives back itself and its loads only; a connection is closed only
    /// when connected; loads queued behind a handshake can be taken while it runs on.
    #[test]
    fn lost_and_closed_connections_give_back_their_loads() {
        let mut m = machine();
        assert!(m.lose("e").is_none() && m.close("e").is_none());
        m.connected("e", 1);
        m.connected("f", 2);
        m.start(Load(req("a", "e")));
        m.start(Load(req("b", "f")));
        let (conn, loads) = m.lose("e").expect("connected");
        assert_eq!(conn, 1);
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].0.req_id, "a");
        assert!(m.connection("e").is_none() && m.in_flight("b"));
        assert_eq!(m.close("f"), Some(2));
        assert_eq!(m.admit(&req("c", "g")), Admission::Handshake);
        assert!(m.close("g").is_none() && m.lose("g").is_none());
        let taken = m.take_queued("g");
        assert_eq!(taken.len(), 1);
        assert!(!m.in_flight("c"));
        assert_eq!(
            m.admit(&req("d", "g")),
            Admission::Queued,
            "still handshaking"
        );
        assert_eq!(m.drain().len(), 1);
        assert!(!m.any_queued());
        assert!(m.drain_connections().is_empty());
    }

    /// A wait handshakes ahead of the load only for an engine not known; a load of the
    /// request ends the wait; waits count for heartbeats.
    #[test]
    fn waits_handshake_ahead_and_are_heartbeated() {
        let mut m = machine();
        assert!(m.wait(&req("a", "e")));
        assert!(!m.wait(&req("b", "e")), "one handshake per engine");
        assert!(m.is_waiting("a"));
        assert_eq!(m.engines_of(true), ["e"]);
        assert!(m.engines_of(false).is_empty());
        assert_eq!(m.requests(true).count(), 2);
        m.unwait("b");
        assert!(!m.is_waiting("b") && m.is_waiting("a"));
        assert_eq!(m.admit(&req("a", "e")), Admission::Queued);
        assert!(!m.is_waiting("a"));
        assert!(m.wait(&req("c", "f")));
        m.clear();
        assert!(!m.is_waiting("c") && !m.any_queued());
    }

    /// The driver reaches the state it keeps in the machine: each connection and each load
    /// in flight, to read and to change.
    #[test]
    fn the_driver_reaches_its_connection_and_load_state() {
        let mut m = machine();
        assert!(m.connection_mut("e").is_none());
        m.connected("e", 1);
        *m.connection_mut("e").expect("connected") = 5;
        assert_eq!(m.connection("e"), Some(&5));
        assert_eq!(m.admit(&req("x", "f")), Admission::Handshake);
        assert!(m.connection_mut("f").is_none(), "still handshaking");
        let conns: Vec<(String, u32)> = m.connections().map(|(e, c)| (e.clone(), *c)).collect();
        assert_eq!(conns, [("e".to_string(), 5)]);
        assert_eq!(m.loading(), 0);
        m.start(Load(req("a", "e")));
        m.start(Load(req("b", "e")));
        assert_eq!(m.loading(), 2);
        assert!(m.load_mut("zz").is_none());
        m.load_mut("a").expect("in flight").0.port = 7;
        assert_eq!(m.loads().filter(|l| l.0.port == 7).count(), 1);
        for (id, l) in m.loads_mut() {
            assert_eq!(id, &l.0.req_id);
            l.0.port = 9;
        }
        assert_eq!(m.loads().filter(|l| l.0.port == 9).count(), 2);
        assert_eq!(m.drain_connections(), [5]);
    }
}
