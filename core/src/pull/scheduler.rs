//! The scheduler half of the pull connector: sans-I/O bookkeeping of which requests load
//! from a remote prefill, which blocks the prefill must hold, and what each worker step does.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::stamps::{Generations, Stamp};
use crate::wire::WireError;
use crate::wire::handshake::PROTOCOL_VERSION;
use crate::wire::params::{KvTransferParams, PeerProtocol};

/// A load the workers must start: per KV cache group, read the tail of
/// `remote_block_ids[g]` into `local_block_ids[g]`. No local block in any group (full local
/// prefix hit) only notifies the prefill, and is not reported ([`RecvRequest::notify_only`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvRequest {
    /// Request id (this engine's).
    pub req_id: String,
    /// The request's id on the prefill engine, named in read-done notes and heartbeats.
    pub remote_req_id: String,
    /// Local blocks to fill, per KV cache group.
    pub local_block_ids: Vec<Vec<u32>>,
    /// Prefill engine to read from.
    pub engine_id: String,
    /// Its side-channel host.
    pub host: String,
    /// Its side-channel base port.
    pub port: u16,
    /// Its blocks holding the request, per KV cache group.
    pub remote_block_ids: Vec<Vec<u32>>,
    /// The handshake the prefill speaks.
    #[serde(default)]
    pub protocol: PeerProtocol,
    /// The prefill's TP size, where its params said (stock vLLM prefills).
    #[serde(default)]
    pub remote_tp_size: Option<u32>,
    /// When the prefill frees the blocks, in its clock's seconds (stock vLLM prefills).
    #[serde(default)]
    pub remote_expiry: Option<serde_json::Number>,
    /// The request's tokens the local blocks receive, `[first, end)`, where the engine named
    /// them (`after_alloc`'s `load_end`): what a load from a prefill whose blocks hold a
    /// different number of tokens needs, since it maps token ranges, not block ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<[u64; 2]>,
    /// The stamp the prefill's slot must hold once the blocks are read (its generation from
    /// the reference, the content this engine expects): absent for a prefill that does not
    /// stamp its references.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<Stamp>,
    /// Why this load cannot start (its params were unusable): the workers report it failed
    /// at once, with its blocks, so the engine applies its failure policy instead of the
    /// prompt being computed silently ([`PullScheduler::refuse_load`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// One KV cache group's blocks of a load: the prefill's read, the local ones filled.
pub type GroupPairs<'a> = (&'a [u32], &'a [u32]);

impl RecvRequest {
    /// Per KV cache group of a cache with `groups` groups, the prefill blocks read and the
    /// local blocks they fill: each group's local blocks take the tail of its prefill
    /// blocks (the decode's are the suffix its prefix cache lacks). Empty when no group has a
    /// local block (a full local prefix hit: the prefill is only notified). Group counts that
    /// differ from the cache's, or more local blocks than the prefill holds, are an error.
    pub fn pairs(&self, groups: usize) -> Result<Vec<GroupPairs<'_>>, String> {
        if self.local_block_ids.iter().all(Vec::is_empty) {
            return Ok(Vec::new());
        }
        for (what, n) in [
            ("local blocks", self.local_block_ids.len()),
            ("the prefill's blocks", self.remote_block_ids.len()),
        ] {
            if n != groups {
                return Err(format!(
                    "{what} name {n} KV cache groups, this cache has {groups}"
                ));
            }
        }
        let mut out = Vec::with_capacity(groups);
        for (g, (remote, local)) in self
            .remote_block_ids
            .iter()
            .zip(&self.local_block_ids)
            .enumerate()
        {
            let Some(start) = remote.len().checked_sub(local.len()) else {
                let group = if groups > 1 {
                    format!("KV cache group {g}: ")
                } else {
                    String::new()
                };
                return Err(format!(
                    "{group}{} local blocks but the prefill holds only {}",
                    local.len(),
                    remote.len()
                ));
            };
            out.push((&remote[start..], local.as_slice()));
        }
        Ok(out)
    }

    /// Every local block of the load, all groups together.
    pub fn all_local_blocks(&self) -> Vec<u32> {
        self.local_block_ids.iter().flatten().copied().collect()
    }

    /// A load with no local block (a full local prefix hit): it only tells the prefill that
    /// its blocks are no longer needed. The engine never waits for it, so the worker reports
    /// it neither done nor failed (vLLM, told of a request it did not wait for, stops).
    pub fn notify_only(&self) -> bool {
        self.local_block_ids.iter().all(Vec::is_empty)
    }
}

/// What the workers do in one step. Serializable: an engine whose scheduler and workers
/// live in different processes ships it between them (the Python binding as JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMeta {
    /// Loads to start (decode side).
    pub recv: Vec<RecvRequest>,
    /// Requests whose blocks the prefill now holds for a remote decode (prefill side).
    pub hold: Vec<Hold>,
    /// Requests that began waiting for blocks to load into (decode side): the workers
    /// heartbeat the prefill's lease for them, and handshake ahead, until a load in `recv`
    /// or `unwait` names them. Block ids are empty: nothing is read yet.
    #[serde(default)]
    pub wait: Vec<RecvRequest>,
    /// Waiting requests that ended without a load (aborted): heartbeats stop.
    #[serde(default)]
    pub unwait: Vec<String>,
}

/// A request whose blocks the prefill's workers hold, with the stamp each writes into its
/// table for as long as the hold lasts (see [`crate::pull::stamps`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Request id.
    pub req_id: String,
    /// Its stamp: the generation its reference carries, and its content key.
    pub stamp: Stamp,
    /// Its blocks per KV cache group: what a worker that publishes content digests
    /// digests when the hold starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_ids: Vec<Vec<u32>>,
}

/// The outcome of a finished request on the prefill side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishDecision {
    /// Keep the blocks until the decode read them (or the lease expires).
    pub delay_free: bool,
    /// Parameters to hand to the decode side through the proxy.
    pub params: Option<KvTransferParams>,
}

/// Scheduler half; one per engine.
#[derive(Debug)]
pub struct PullScheduler {
    engine_id: String,
    host: String,
    port: u16,
    pending: StepMeta,
    triggered: HashSet<String>,
    /// Requests in `pending.wait` of some step and not yet loading or ended.
    waiting: HashSet<String>,
    tp_size: u32,
    generations: Generations,
}

impl PullScheduler {
    /// A scheduler for engine `engine_id` whose side channel is `host:port` (base port).
    pub fn new(engine_id: &str, host: &str, port: u16) -> Self {
        PullScheduler {
            engine_id: engine_id.into(),
            host: host.into(),
            port,
            pending: StepMeta::default(),
            triggered: HashSet::new(),
            waiting: HashSet::new(),
            tp_size: 1,
            generations: Generations::random(),
        }
    }

    /// Sets the engine's TP size, which the params handed to decodes carry (a stock vLLM
    /// decode reads it from there).
    pub fn with_tp_size(mut self, tp_size: u32) -> Self {
        self.tp_size = tp_size.max(1);
        self
    }

    /// Tokens to load asynchronously for a request: every prompt token not computed
    /// locally when the request pulls from a remote prefill (the last, partial block
    /// included, so prompts shorter than a block load too), else none. Params a load could
    /// not start from are an error here, before the engine waits for a load that
    /// [`PullScheduler::after_alloc`] would refuse.
    ///
    /// The engine asks while `req_id` waits for blocks; from the first ask that loads, the
    /// workers keep the prefill's lease alive (a stock vLLM prefill frees the blocks when
    /// it runs out, however long the request queued here).
    pub fn tokens_to_load(
        &mut self,
        req_id: &str,
        params: Option<&KvTransferParams>,
        prompt_len: usize,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool), WireError> {
        match params {
            Some(p) if p.do_remote_prefill => {
                let src = usable(p)?;
                let count = prompt_len.saturating_sub(num_computed_tokens);
                if count > 0
                    && !self.triggered.contains(req_id)
                    && self.waiting.insert(req_id.into())
                {
                    let mut wait = recv_request(req_id, p, src, Vec::new());
                    wait.remote_block_ids.clear();
                    wait.remote_expiry = None;
                    self.pending.wait.push(wait);
                }
                Ok((count, count > 0))
            }
            _ => Ok((0, false)),
        }
    }

    /// Records a request after block allocation. `uncomputed_blocks` are its local blocks
    /// without a local prefix hit, per KV cache group; with `num_external_tokens == 0` (full
    /// prefix hit) the prefill is only notified. `load_end`, where given, is the token the
    /// load ends before (the local blocks then receive `[load_end - num_external_tokens,
    /// load_end)`), which lets a prefill with another block size serve the load. `content`
    /// is what this engine expects the KV to be computed from, in the same terms as the
    /// prefill's engine named it at [`PullScheduler::request_finished`] (kvxfer.vllm: a
    /// digest of the prompt's tokens): a stamped reference whose hold names other content
    /// fails the load. Triggers at most one transfer per request.
    pub fn after_alloc(
        &mut self,
        req_id: &str,
        params: &mut KvTransferParams,
        uncomputed_blocks: &[Vec<u32>],
        num_external_tokens: usize,
        load_end: Option<usize>,
        content: Option<u64>,
    ) -> Result<(), WireError> {
        if !params.do_remote_prefill || self.triggered.contains(req_id) {
            return Ok(());
        }
        let src = usable(params)?;
        let local = if num_external_tokens > 0 {
            uncomputed_blocks.to_vec()
        } else {
            Vec::new()
        };
        // The load supersedes the wait: the workers heartbeat it as a load from here.
        self.waiting.remove(req_id);
        let mut recv = recv_request(req_id, params, src, local);
        recv.tokens = load_end
            .filter(|_| num_external_tokens > 0)
            .and_then(|end| Some([end.checked_sub(num_external_tokens)? as u64, end as u64]));
        recv.stamp = params.kvxfer_stamp.map(|generation| Stamp {
            generation,
            content: content.unwrap_or(0),
        });
        self.pending.recv.push(recv);
        self.triggered.insert(req_id.into());
        params.do_remote_prefill = false;
        Ok(())
    }

    /// Records a load the engine asked for (its params say to pull) that cannot start, for
    /// `reason` (params kvxfer cannot read): the workers report it failed with
    /// `uncomputed_blocks`, its local blocks, so that the engine's failure policy decides
    /// (fail the request, or compute the prompt) and the client hears of a bad reference.
    pub fn refuse_load(&mut self, req_id: &str, uncomputed_blocks: &[Vec<u32>], reason: &str) {
        if self.triggered.contains(req_id) {
            return;
        }
        self.waiting.remove(req_id);
        self.pending.recv.push(RecvRequest {
            req_id: req_id.into(),
            remote_req_id: req_id.into(),
            local_block_ids: uncomputed_blocks.to_vec(),
            engine_id: String::new(),
            host: String::new(),
            port: 0,
            remote_block_ids: Vec::new(),
            protocol: PeerProtocol::default(),
            remote_tp_size: None,
            remote_expiry: None,
            tokens: None,
            stamp: None,
            refused: Some(reason.into()),
        });
        self.triggered.insert(req_id.into());
    }

    /// The step's metadata for the workers (taken: the next call starts empty).
    pub fn build_step_meta(&mut self) -> StepMeta {
        std::mem::take(&mut self.pending)
    }

    /// Decides, when a request finishes on the prefill side, whether its blocks are held
    /// for a remote decode and what parameters the decode needs. Only requests asking for
    /// remote decode that stopped because of the length cap (prefill-only) qualify.
    /// `block_ids` are the request's blocks per KV cache group; `content`, what the KV was
    /// computed from (see [`PullScheduler::after_alloc`]), goes into the hold's stamp.
    pub fn request_finished(
        &mut self,
        req_id: &str,
        params: Option<&KvTransferParams>,
        length_capped: bool,
        block_ids: &[Vec<u32>],
        content: Option<u64>,
    ) -> FinishDecision {
        self.triggered.remove(req_id);
        if self.waiting.remove(req_id) {
            self.pending.unwait.push(req_id.into());
        }
        let wants_remote = params.is_some_and(|p| p.do_remote_decode);
        if !wants_remote || !length_capped {
            return FinishDecision {
                delay_free: false,
                params: None,
            };
        }
        let delay_free = block_ids.iter().any(|g| !g.is_empty());
        let stamp = delay_free.then(|| Stamp {
            generation: self.generations.draw(),
            content: content.unwrap_or(0),
        });
        if let Some(stamp) = stamp {
            self.pending.hold.push(Hold {
                req_id: req_id.into(),
                stamp,
                block_ids: block_ids.to_vec(),
            });
        }
        FinishDecision {
            delay_free,
            params: Some(KvTransferParams {
                do_remote_prefill: true,
                do_remote_decode: false,
                remote_block_ids: Some(block_ids.to_vec()),
                remote_engine_id: Some(self.engine_id.clone()),
                remote_host: Some(self.host.clone()),
                remote_port: Some(self.port),
                remote_request_id: Some(req_id.into()),
                tp_size: Some(self.tp_size),
                dcp_size: None,
                pp_size: None,
                transfer_mode: Some("pull".into()),
                remote_blocks_expiry_time: None,
                kvxfer_protocol: Some(PROTOCOL_VERSION),
                kvxfer_stamp: stamp.map(|s| s.generation),
            }),
        }
    }
}

/// The load of `req_id` into `local` that `params` (whose source is `src`) describe.
fn recv_request(
    req_id: &str,
    params: &KvTransferParams,
    src: crate::wire::params::RemoteSource<'_>,
    local: Vec<Vec<u32>>,
) -> RecvRequest {
    RecvRequest {
        req_id: req_id.into(),
        remote_req_id: params
            .remote_request_id
            .clone()
            .unwrap_or_else(|| req_id.into()),
        local_block_ids: local,
        engine_id: src.engine_id.into(),
        host: src.host.into(),
        port: src.port,
        remote_block_ids: src.block_ids.to_vec(),
        protocol: params.peer_protocol(),
        remote_tp_size: params.tp_size,
        remote_expiry: params.remote_blocks_expiry_time.clone(),
        tokens: None,
        stamp: None,
        refused: None,
    }
}

/// The remote source of a pulling request's params, checked as the handshake needs it.
fn usable(params: &KvTransferParams) -> Result<crate::wire::params::RemoteSource<'_>, WireError> {
    let src = params.remote_source()?;
    if params.peer_protocol() == PeerProtocol::Vllm032 {
        check_stock_params(params)?;
    }
    Ok(src)
}

/// What kvxfer pulls from a stock vLLM 0.32 prefill: READ-mode params of one context
/// stage, with its TP size.
fn check_stock_params(p: &KvTransferParams) -> Result<(), WireError> {
    let invalid = |reason: String| WireError::Invalid {
        what: "kv_transfer_params",
        reason,
    };
    if p.transfer_mode.as_deref() != Some("pull") {
        return Err(invalid(format!(
            "transfer_mode {:?}: kvxfer pulls (READ) from stock vLLM prefills; their push mode is not supported",
            p.transfer_mode
        )));
    }
    match (p.tp_size, p.dcp_size.unwrap_or(1), p.pp_size.unwrap_or(1)) {
        (None, ..) | (Some(0), ..) => {
            Err(invalid("a stock vLLM prefill's tp_size is missing".into()))
        }
        (_, 1, 1) => Ok(()),
        (_, dcp, pp) => Err(invalid(format!(
            "a stock vLLM prefill with dcp_size {dcp}, pp_size {pp}: kvxfer pulls from one context and pipeline stage"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(blocks: &[u32]) -> KvTransferParams {
        KvTransferParams {
            do_remote_prefill: true,
            remote_block_ids: Some(vec![blocks.to_vec()]),
            remote_engine_id: Some("P".into()),
            remote_host: Some("127.0.0.1".into()),
            remote_port: Some(5600),
            ..Default::default()
        }
    }

    #[test]
    fn two_and_a_half_blocks_give_one_recv_entry() {
        let mut s = PullScheduler::new("D", "h", 1);
        let mut p = remote(&[7, 8, 9]);
        // 40 tokens with 16-token blocks: 2.5 blocks, all loaded.
        assert_eq!(s.tokens_to_load("r1", Some(&p), 40, 0), Ok((40, true)));
        s.after_alloc("r1", &mut p, &[vec![1, 2, 3]], 40, None, None)
            .unwrap();
        let meta = s.build_step_meta();
        assert_eq!(meta.recv.len(), 1);
        assert_eq!(meta.recv[0].local_block_ids, vec![vec![1, 2, 3]]);
        assert_eq!(meta.recv[0].remote_block_ids, vec![vec![7, 8, 9]]);
        // Only one transfer per request, and the meta was taken.
        s.after_alloc("r1", &mut p, &[vec![1, 2, 3]], 40, None, None)
            .unwrap();
        assert!(s.build_step_meta().recv.is_empty());
        assert!(!p.do_remote_prefill);
    }

    /// Params a load could not start from are refused when vLLM asks how many tokens to
    /// load, so it never waits for a load that is not coming.
    #[test]
    fn unusable_params_are_refused_before_the_engine_waits() {
        let mut s = PullScheduler::new("D", "h", 1);
        let mut stock = |f: fn(&mut KvTransferParams)| {
            let mut p = remote(&[3]);
            p.transfer_mode = Some("pull".into());
            p.tp_size = Some(1);
            f(&mut p);
            s.tokens_to_load("r", Some(&p), 40, 0)
        };
        assert_eq!(stock(|_| {}), Ok((40, true)));
        assert!(stock(|p| p.transfer_mode = Some("push".into())).is_err());
        assert!(stock(|p| p.tp_size = None).is_err());
        assert!(stock(|p| p.pp_size = Some(2)).is_err());
        assert!(stock(|p| p.dcp_size = Some(2)).is_err());
        assert!(stock(|p| p.remote_host = None).is_err());
        // kvxfer params need no tp_size.
        let mut k = remote(&[3]);
        k.transfer_mode = Some("pull".into());
        k.kvxfer_protocol = Some(2);
        assert_eq!(s.tokens_to_load("k", Some(&k), 40, 0), Ok((40, true)));
    }

    /// A request waits for blocks from the engine's first ask: the workers heartbeat it
    /// from then until its load starts, or until it ends without one.
    #[test]
    fn a_waiting_request_is_announced_once_and_ends_with_its_load_or_its_end() {
        let mut s = PullScheduler::new("D", "h", 1);
        let mut p = remote(&[7, 8]);
        p.remote_request_id = Some("P-r".into());
        s.tokens_to_load("r", Some(&p), 20, 0).unwrap();
        s.tokens_to_load("r", Some(&p), 20, 0).unwrap();
        s.tokens_to_load("full-hit", Some(&p), 20, 20).unwrap();
        let meta = s.build_step_meta();
        assert!(meta.recv.is_empty());
        let [wait] = meta.wait.as_slice() else {
            panic!("one wait expected: {:?}", meta.wait)
        };
        assert_eq!(
            (wait.req_id.as_str(), wait.remote_req_id.as_str()),
            ("r", "P-r")
        );
        assert_eq!((wait.engine_id.as_str(), wait.port), ("P", 5600));
        assert!(wait.remote_block_ids.is_empty() && wait.local_block_ids.is_empty());
        // Loading ends the wait without an unwait; asking again after that is no new wait.
        s.after_alloc("r", &mut p.clone(), &[vec![1, 2]], 20, None, None)
            .unwrap();
        s.tokens_to_load("r", Some(&p), 20, 0).unwrap();
        let meta = s.build_step_meta();
        assert_eq!((meta.recv.len(), meta.wait.len()), (1, 0));
        s.request_finished("r", Some(&p), false, &[vec![1, 2]], None);
        assert!(s.build_step_meta().unwait.is_empty());
        // Ending while waiting stops the heartbeats, once.
        s.tokens_to_load("q", Some(&p), 20, 0).unwrap();
        s.request_finished("q", Some(&p), false, &[vec![]], None);
        s.request_finished("q", Some(&p), false, &[vec![]], None);
        let meta = s.build_step_meta();
        assert_eq!((meta.wait.len(), meta.unwait), (1, vec!["q".to_string()]));
    }

    #[test]
    fn prompt_shorter_than_a_block_still_loads() {
        let mut s = PullScheduler::new("D", "h", 1);
        assert_eq!(
            s.tokens_to_load("a", Some(&remote(&[3])), 5, 0),
            Ok((5, true))
        );
        assert_eq!(
            s.tokens_to_load("b", Some(&remote(&[3])), 5, 5),
            Ok((0, false))
        );
        assert_eq!(s.tokens_to_load("c", None, 50, 0), Ok((0, false)));
    }

    /// Parameters that do not ask for a remote prefill (vLLM keeps them on requests that
    /// were already loaded) load nothing.
    #[test]
    fn a_request_not_pulling_loads_nothing() {
        let mut s = PullScheduler::new("D", "h", 1);
        let mut p = remote(&[7]);
        p.do_remote_prefill = false;
        assert_eq!(s.tokens_to_load("r", Some(&p), 40, 0), Ok((0, false)));
        s.after_alloc("r", &mut p, &[vec![1]], 16, None, None)
            .unwrap();
        assert_eq!(s.build_step_meta(), StepMeta::default());
    }

    /// A request triggers one transfer even when the engine hands over a fresh copy of its
    /// parameters each time.
    #[test]
    fn a_request_triggers_once_whatever_params_it_brings() {
        let mut s = PullScheduler::new("D", "h", 1);
        s.after_alloc("r", &mut remote(&[7]), &[vec![1]], 16, None, None)
            .unwrap();
        s.after_alloc("r", &mut remote(&[7]), &[vec![1]], 16, None, None)
            .unwrap();
        assert_eq!(s.build_step_meta().recv.len(), 1);
    }

    #[test]
    fn full_prefix_hit_notifies_only_partial_hit_reads_tail() {
        let mut s = PullScheduler::new("D", "h", 1);
        let mut p = remote(&[7, 8, 9]);
        // A full hit loads nothing, whatever blocks the engine passes.
        s.after_alloc("full", &mut p, &[vec![4]], 0, None, None)
            .unwrap();
        let mut q = remote(&[7, 8, 9]);
        s.after_alloc("partial", &mut q, &[vec![5]], 16, None, None)
            .unwrap();
        let meta = s.build_step_meta();
        assert!(meta.recv[0].local_block_ids.is_empty());
        assert_eq!(meta.recv[1].local_block_ids, vec![vec![5]]);
        let mut bad = KvTransferParams {
            do_remote_prefill: true,
            ..Default::default()
        };
        assert!(
            s.after_alloc("bad", &mut bad, &[vec![1]], 16, None, None)
                .is_err()
        );
    }

    #[test]
    fn prefill_holds_blocks_and_hands_params() {
        let mut s = PullScheduler::new("P", "10.0.0.1", 5600);
        let p = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        let d = s.request_finished("r", Some(&p), true, &[vec![4, 5]], Some(9));
        assert!(d.delay_free);
        let mut out = d.params.unwrap();
        assert_eq!(out.remote_block_ids, Some(vec![vec![4, 5]]));
        assert_eq!(out.remote_engine_id.as_deref(), Some("P"));
        // The hold's stamp: the generation its reference carries, the engine's content.
        let generation = out.kvxfer_stamp.unwrap();
        let stamp = Stamp {
            generation,
            content: 9,
        };
        let hold = s.build_step_meta().hold;
        assert_eq!(
            hold,
            vec![Hold {
                req_id: "r".into(),
                stamp,
                block_ids: vec![vec![4, 5]],
            }]
        );
        // The decode expects that stamp, with the content it names.
        let mut dec = PullScheduler::new("D", "h", 1);
        dec.after_alloc("r", &mut out, &[vec![1]], 20, None, Some(9))
            .unwrap();
        assert_eq!(dec.build_step_meta().recv[0].stamp, Some(stamp));
        // Each hold has its own generation.
        let again = s.request_finished("r1", Some(&p), true, &[vec![6]], None);
        assert_ne!(again.params.unwrap().kvxfer_stamp, Some(generation));
        // Not length capped (aborted) or not remote: free immediately.
        assert!(
            !s.request_finished("r2", Some(&p), false, &[vec![1]], None)
                .delay_free
        );
        assert!(
            !s.request_finished("r3", None, true, &[vec![1]], None)
                .delay_free
        );
        assert!(
            !s.request_finished("r4", Some(&p), true, &[vec![], vec![]], None)
                .delay_free
        );
    }

    /// A hybrid model's params carry each KV cache group's blocks; the prefill holds them
    /// while any group has one.
    #[test]
    fn every_kv_cache_group_is_handed_off_and_loaded() {
        let mut s = PullScheduler::new("P", "h", 5600);
        let p = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        let d = s.request_finished("r", Some(&p), true, &[vec![], vec![9]], None);
        assert!(d.delay_free);
        let mut out = d.params.unwrap();
        assert_eq!(out.remote_block_ids, Some(vec![vec![], vec![9]]));
        let mut dec = PullScheduler::new("D", "h", 1);
        dec.after_alloc("r", &mut out, &[vec![3], vec![4]], 40, None, None)
            .unwrap();
        let recv = dec.build_step_meta().recv;
        assert_eq!(recv[0].local_block_ids, vec![vec![3], vec![4]]);
        assert_eq!(recv[0].remote_block_ids, vec![vec![], vec![9]]);
    }

    fn load(remote: Vec<Vec<u32>>, local: Vec<Vec<u32>>) -> RecvRequest {
        RecvRequest {
            req_id: "r".into(),
            remote_req_id: "r".into(),
            local_block_ids: local,
            engine_id: "P".into(),
            host: "h".into(),
            port: 1,
            remote_block_ids: remote,
            protocol: PeerProtocol::Kvxfer,
            remote_tp_size: None,
            remote_expiry: None,
            tokens: None,
            stamp: None,
            refused: None,
        }
    }

    /// A load names the tokens its local blocks receive where the engine gave its end:
    /// `[end - external, end)`; none for a full prefix hit or an end before the external
    /// tokens' start.
    #[test]
    fn a_load_names_its_tokens_where_the_engine_gave_their_end() {
        let tokens = |external, end| {
            let mut s = PullScheduler::new("D", "h", 1);
            let mut p = KvTransferParams {
                do_remote_prefill: true,
                remote_block_ids: Some(vec![vec![1, 2, 3]]),
                remote_engine_id: Some("P".into()),
                remote_host: Some("h".into()),
                remote_port: Some(1),
                ..Default::default()
            };
            s.after_alloc("r", &mut p, &[vec![7, 8]], external, end, None)
                .unwrap();
            s.build_step_meta().recv[0].tokens
        };
        assert_eq!(tokens(24, Some(40)), Some([16, 40]));
        assert_eq!(tokens(40, Some(40)), Some([0, 40]));
        assert_eq!(tokens(24, None), None);
        assert_eq!(tokens(0, Some(40)), None, "a full prefix hit loads nothing");
        assert_eq!(
            tokens(41, Some(40)),
            None,
            "more external tokens than the end"
        );
    }

    /// Each group's local blocks take the tail of that group's prefill blocks; counts that
    /// cannot be right are refused, naming the group.
    #[test]
    fn pairs_take_each_groups_tail() {
        let r = load(vec![vec![1, 2, 3], vec![7, 8]], vec![vec![4, 5], vec![6]]);
        let pairs = r.pairs(2).unwrap();
        assert_eq!(
            pairs,
            vec![(&[2u32, 3][..], &[4u32, 5][..]), (&[8][..], &[6][..])]
        );
        assert_eq!(r.all_local_blocks(), vec![4, 5, 6]);
        // A full local prefix hit reads nothing, whatever the groups.
        assert!(load(vec![vec![1]], vec![]).pairs(2).unwrap().is_empty());
        assert!(
            load(vec![vec![1]], vec![vec![], vec![]])
                .pairs(2)
                .unwrap()
                .is_empty()
        );
        // Group counts differ from the cache's.
        assert!(r.pairs(1).unwrap_err().contains("2 KV cache groups"));
        let short = load(vec![vec![1]], vec![vec![4], vec![5]]);
        assert!(
            short
                .pairs(2)
                .unwrap_err()
                .contains("the prefill's blocks name 1")
        );
        // More local blocks than the prefill holds: a sliding-window group whose prefill
        // freed a block the decode's window needs.
        let freed = load(vec![vec![1, 2], vec![8]], vec![vec![4], vec![5, 6]]);
        assert_eq!(
            freed.pairs(2).unwrap_err(),
            "KV cache group 1: 2 local blocks but the prefill holds only 1"
        );
        let one = load(vec![vec![1]], vec![vec![4, 5]]);
        assert_eq!(
            one.pairs(1).unwrap_err(),
            "2 local blocks but the prefill holds only 1"
        );
    }
}
