//! The helper process's side: [`serve`] owns the real agent and answers requests until told
//! to shut down.

use std::io::{BufRead, Write};

use kvxfer_core::transport::Registration;
use kvxfer_core::{
    AddrRange, DescListId, Op, PeerId, Transport, TransportResult, XferId, XferStatus,
};

use super::wire::{REPLY_PREFIX, Reply, Request, WireError, from_wire, kind_from};
use crate::shared_mem::SharedMapping;

/// The helper side: answers requests from stdin on stdout with `t` until `Shutdown` or EOF.
pub fn serve<T: Transport>(mut t: T) {
    let mut regs: std::collections::HashMap<u64, (Registration, Option<SharedMapping>)> =
        Default::default();
    let mut attached: std::collections::HashMap<u64, (SharedMapping, usize)> = Default::default();
    let mut owned: Vec<Own> = Vec::new();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let req: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("kvxfer-test-agent: bad request: {e}");
                break;
            }
        };
        let shutdown = matches!(req, Request::Shutdown);
        let reply = match req {
            Request::AllocFilled { len, seed, shared } => {
                let mut m = if shared {
                    Own::Shared(kvxfer_host_mem::shm::SharedHostMem::new(len as usize, 1))
                } else {
                    Own::Private(kvxfer_host_mem::mem::HostMem::new(len as usize, 1))
                };
                crate::memory::fill(m.bytes(), Some(seed));
                let addr = m.bytes().as_ptr() as u64;
                owned.push(m);
                Reply::Id(addr)
            }
            Request::Register {
                kind: None,
                range,
                mapping: None,
            } if !owned.iter_mut().any(|m| m.contains(range.0, range.1)) => {
                Reply::Err(WireError::InvalidRegistration(
                    "host memory for a helper process must be shared test memory or its own".into(),
                ))
            }
            req => handle(&mut t, req, &mut regs, &mut attached),
        };
        let mut out = REPLY_PREFIX.to_string();
        out.push_str(&serde_json::to_string(&reply).expect("reply encodes"));
        out.push('\n');
        if stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
            || shutdown
        {
            break;
        }
    }
    // Registrations before the transport, memory after both.
    regs.clear();
    drop(t);
    drop(owned);
    for (m, _) in attached.values() {
        crate::shared_mem::detach(m);
    }
}

/// Memory the helper allocated itself.
enum Own {
    Private(kvxfer_host_mem::mem::HostMem),
    Shared(kvxfer_host_mem::shm::SharedHostMem),
}

impl Own {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Own::Private(m) => m,
            // SAFETY: the helper fills its memory before registering it and looks at it
            // again only to check a range, while no peer has it (the tests' protocol).
            Own::Shared(m) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) },
        }
    }

    fn contains(&mut self, addr: u64, len: u64) -> bool {
        let b = self.bytes();
        let start = b.as_ptr() as u64;
        addr >= start
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= start + b.len() as u64)
    }
}

type Regs = std::collections::HashMap<u64, (Registration, Option<SharedMapping>)>;
type Attached = std::collections::HashMap<u64, (SharedMapping, usize)>;

fn handle<T: Transport>(
    t: &mut T,
    req: Request,
    regs: &mut Regs,
    attached: &mut Attached,
) -> Reply {
    let r = |res: TransportResult<Reply>| res.unwrap_or_else(|e| Reply::Err((&e).into()));
    let op = |write: bool| if write { Op::Write } else { Op::Read };
    match req {
        Request::Capabilities => {
            let c = t.capabilities();
            Reply::Caps {
                host: c.host_memory,
                gpu: c.gpu_memory,
                read: c.read,
                write: c.write,
                notifications: c.notifications,
                max_descriptors: c.max_descriptors,
                max_notification_len: c.max_notification_len,
                detects_peer_deregistration: c.detects_peer_deregistration,
            }
        }
        Request::Register {
            kind,
            range,
            mapping,
        } => {
            let mapping = mapping.map(|(pid, fd, base, len)| SharedMapping { pid, fd, base, len });
            if let Some(m) = &mapping {
                match attached.get_mut(&m.base) {
                    Some((_, n)) => *n += 1,
                    None => {
                        if let Err(e) = crate::shared_mem::attach(m) {
                            return Reply::Err(WireError::InvalidRegistration(format!(
                                "cannot map the test's memory at {:#x}: {e}",
                                m.base
                            )));
                        }
                        attached.insert(m.base, (*m, 1));
                    }
                }
            }
            match t.register(kind_from(kind), AddrRange::new(range.0, range.1)) {
                Ok(reg) => {
                    let id = reg.id().0;
                    regs.insert(id, (reg, mapping));
                    Reply::Id(id)
                }
                Err(e) => {
                    if let Some(m) = mapping {
                        release_mapping(attached, &m);
                    }
                    Reply::Err((&e).into())
                }
            }
        }
        Request::Deregister(id) => {
            if let Some((reg, mapping)) = regs.remove(&id) {
                drop(reg);
                if let Some(m) = mapping {
                    release_mapping(attached, &m);
                }
            }
            Reply::Done
        }
        Request::Metadata => r(t.metadata().map(Reply::Bytes)),
        Request::LoadPeer(m) => r(t.load_peer(&m).map(|p| Reply::Id(p.0))),
        Request::RemovePeer(p) => r(t.remove_peer(PeerId(p)).map(|()| Reply::Done)),
        Request::PrepareLocal(k, ranges) => r(t
            .prepare_local(kind_from(k), &from_wire(&ranges))
            .map(|l| Reply::Id(l.0))),
        Request::PrepareRemote(p, k, ranges) => r(t
            .prepare_remote(PeerId(p), kind_from(k), &from_wire(&ranges))
            .map(|l| Reply::Id(l.0))),
        Request::ReleaseList(l) => r(t.release_list(DescListId(l)).map(|()| Reply::Done)),
        Request::PostIndexed {
            write,
            local,
            local_idx,
            remote,
            remote_idx,
            notification,
        } => r(t
            .post_indexed(
                op(write),
                DescListId(local),
                &local_idx,
                DescListId(remote),
                &remote_idx,
                notification.as_deref(),
            )
            .map(|x| Reply::Id(x.0))),
        Request::Post {
            write,
            peer,
            kinds,
            local,
            remote,
            notification,
        } => r(t
            .post(
                op(write),
                PeerId(peer),
                (kind_from(kinds.0), kind_from(kinds.1)),
                &from_wire(&local),
                &from_wire(&remote),
                notification.as_deref(),
            )
            .map(|x| Reply::Id(x.0))),
        Request::Status(x) => r(t.status(XferId(x)).map(|s| match s {
            XferStatus::InProgress => Reply::InProgress,
            XferStatus::Done => Reply::Finished,
            XferStatus::Failed(e) => Reply::Failed(e),
        })),
        Request::Release(x) => r(t.release(XferId(x)).map(|()| Reply::Done)),
        Request::SendNotification(p, m) => {
            r(t.send_notification(PeerId(p), &m).map(|()| Reply::Done))
        }
        Request::Drain => {
            let mut out = Vec::new();
            r(t.drain_notifications(&mut out)
                .map(|_| Reply::Notes(out.into_iter().map(|n| (n.from, n.message)).collect())))
        }
        Request::Shutdown | Request::AllocFilled { .. } => Reply::Done,
    }
}

fn release_mapping(attached: &mut Attached, m: &SharedMapping) {
    if let Some((_, n)) = attached.get_mut(&m.base) {
        *n -= 1;
        if *n == 0 {
            attached.remove(&m.base);
            crate::shared_mem::detach(m);
        }
    }
}
