//! The push decode's control thread: the blocking side-channel requests (bootstrap,
//! registration and room destinations, liveness probes, aborts), each bounded by a timeout,
//! so that `PushDecode::poll` never blocks.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashSet;
use std::time::Duration;

use kvxfer_layout::{HeadSharding, LinkKind, TpMapping};

use super::PushDecodeConfig;
use crate::push::messages::{
    self, FromPrefill, FromRegistry, MAX_MESSAGE_BYTES, RankInfo, RegisterArgs, RoomRequest,
    ToPrefill,
};
use crate::sidechannel::auth::Destination;
use crate::sidechannel::request_bytes;

pub(super) use crate::push::directory::Addr;

/// (TP rank, PP rank) of prefill ranks this decode rank registered with.
type Registered = HashSet<(u32, u32)>;

/// A bootstrap's result: prefill instance, its ranks, and where we are registered.
type Bootstrapped = (u64, Vec<RankInfo>, Registered);

/// Work handed to the control thread.
pub(super) enum Job {
    Bootstrap {
        room: u64,
        addr: Addr,
        req: RoomRequest,
        known: Option<(u64, HashSet<(u32, u32)>)>,
    },
    Probe {
        addr: Addr,
    },
    Abort {
        room: u64,
        ranks: Vec<RankInfo>,
    },
}

/// What the control thread hands back.
pub(super) enum Done {
    Bootstrapped {
        room: u64,
        addr: Addr,
        instance: u64,
        ranks: Vec<RankInfo>,
        registered: HashSet<(u32, u32)>,
        /// Ranks sent the room's pages (the ones that write into them).
        reached: Vec<RankInfo>,
    },
    BootstrapFailed {
        room: u64,
        reason: String,
        /// Ranks sent the room's pages before it failed (they may write into them).
        reached: Vec<RankInfo>,
    },
    /// An abort went out (the room failed already); nothing to do.
    AbortSent,
    Probed {
        addr: Addr,
        ok: bool,
    },
}

/// The control thread's side: blocking side-channel requests, each bounded by a timeout.
pub(super) struct Control {
    pub(super) args: RegisterArgs,
    pub(super) config: PushDecodeConfig,
    pub(super) sharding: HeadSharding,
}

impl Control {
    pub(super) fn run(&self, job: Job) -> Done {
        match job {
            Job::Probe { addr } => {
                let ok = self
                    .config
                    .directory
                    .alive(&addr, self.config.request_timeout);
                Done::Probed { addr, ok }
            }
            Job::Abort { room, ranks } => {
                let msg = messages::encode(&ToPrefill::Abort {
                    room,
                    agent: self.args.agent.clone(),
                });
                for r in &ranks {
                    let _ = request_bytes(
                        &r.host,
                        r.port,
                        &Destination::mailbox(&r.agent),
                        &msg,
                        self.config.request_timeout,
                        MAX_MESSAGE_BYTES,
                    );
                }
                Done::AbortSent
            }
            Job::Bootstrap {
                room,
                addr,
                req,
                known,
            } => {
                let mut reached = Vec::new();
                match self.bootstrap(&addr, &req, known, &mut reached) {
                    Ok((instance, ranks, registered)) => Done::Bootstrapped {
                        room,
                        addr,
                        instance,
                        ranks,
                        registered,
                        reached,
                    },
                    Err(reason) => Done::BootstrapFailed {
                        room,
                        reason,
                        reached,
                    },
                }
            }
        }
    }

    fn bootstrap(
        &self,
        addr: &Addr,
        req: &RoomRequest,
        known: Option<(u64, HashSet<(u32, u32)>)>,
        reached: &mut Vec<RankInfo>,
    ) -> Result<Bootstrapped, String> {
        let t = self.config.request_timeout;
        let deadline = std::time::Instant::now().checked_add(self.config.bootstrap_timeout);
        let (instance, ranks) = loop {
            match self.config.directory.query(addr, t)? {
                FromRegistry::Layout { instance, ranks } => break (instance, ranks),
                FromRegistry::NotReady { .. }
                    if deadline.is_none_or(|d| std::time::Instant::now() < d) =>
                {
                    std::thread::sleep(Duration::from_millis(20))
                }
                FromRegistry::NotReady {
                    registered,
                    expected,
                } => {
                    return Err(format!(
                        "prefill {}:{} not ready: {registered} of {expected} ranks registered \
                         after {:?} (asked {})",
                        addr.0,
                        addr.1,
                        self.config.bootstrap_timeout,
                        self.config.directory.source()
                    ));
                }
                other => return Err(format!("unexpected registry reply {other:?}")),
            }
        };
        messages::check_layout(&ranks).map_err(|e| format!("prefill registry's layout: {e}"))?;
        let first = ranks.first().ok_or("the prefill registered no ranks")?;
        let mine = &self.args.layout;
        if first.page_size != mine.tokens_per_block || first.dtype != mine.dtype {
            return Err(format!(
                "prefill page size {} / dtype {} differ from decode {} / {}",
                first.page_size, first.dtype, mine.tokens_per_block, mine.dtype
            ));
        }
        let mapping = TpMapping::new(first.tp_size, self.config.tp.1, self.sharding)
            .map_err(|e| e.to_string())?;
        let links = mapping
            .links_for_decode(self.config.tp.0)
            .map_err(|e| e.to_string())?;
        let mut registered = match known {
            Some((i, set)) if i == instance => set,
            _ => HashSet::new(),
        };
        for rank in ranks
            .iter()
            .filter(|r| links.iter().any(|l| l.prefill_rank == r.tp_rank))
        {
            let key = (rank.tp_rank, rank.pp_rank);
            let register = ToPrefill::Register(self.args.clone());
            if !registered.contains(&key) {
                send(rank, &register, t)?.accepted(rank)?;
                registered.insert(key);
            }
            let data = links
                .iter()
                .any(|l| l.prefill_rank == rank.tp_rank && matches!(l.kind, LinkKind::Data(_)));
            let mut msg = req.clone();
            if !data {
                // A dummy destination: completes the rank's status, receives no data.
                msg.pages.clear();
            }
            if !msg.pages.is_empty() {
                // Noted before the send: one that times out may still have been delivered.
                reached.push(rank.clone());
            }
            let room = ToPrefill::Room(msg);
            if send(rank, &room, t)? == Accepted::Unregistered {
                // The rank forgot this decode (idle, or it restarted): once more, registered.
                tracing::info!(
                    prefill_rank = rank.tp_rank,
                    agent = %rank.agent,
                    "the prefill rank no longer knows this decode: registering again"
                );
                send(rank, &register, t)?.accepted(rank)?;
                send(rank, &room, t)?.accepted(rank)?;
            }
        }
        Ok((instance, ranks, registered))
    }
}

/// How a prefill rank took a message it did not refuse.
#[derive(Debug, PartialEq, Eq)]
enum Accepted {
    Ok,
    /// It does not know this decode: register, then send again.
    Unregistered,
}

impl Accepted {
    fn accepted(self, rank: &RankInfo) -> Result<(), String> {
        match self {
            Accepted::Ok => Ok(()),
            Accepted::Unregistered => Err(format!(
                "prefill rank {} does not know this decode although it registered (was the registration refused? see that rank's log)",
                rank.tp_rank
            )),
        }
    }
}

fn send(rank: &RankInfo, msg: &ToPrefill, timeout: Duration) -> Result<Accepted, String> {
    let reply = request_bytes(
        &rank.host,
        rank.port,
        &Destination::mailbox(&rank.agent),
        &messages::encode(msg),
        timeout,
        MAX_MESSAGE_BYTES,
    )
    .map_err(|e| e.to_string())?;
    match messages::decode::<FromPrefill>(&reply, "prefill reply").map_err(|e| e.to_string())? {
        FromPrefill::Ok => Ok(Accepted::Ok),
        FromPrefill::Unregistered => Ok(Accepted::Unregistered),
        FromPrefill::Error { reason } => {
            Err(format!("prefill rank {} refused: {reason}", rank.tp_rank))
        }
    }
}
