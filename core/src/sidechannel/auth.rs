//! Optional shared-secret authentication of side-channel messages.
//!
//! With a key installed (from `KVXFER_SIDE_CHANNEL_KEY_FILE` or `KVXFER_SIDE_CHANNEL_KEY`, or
//! [`install_key`]), every request and reply on the side channel — pull handshakes, the push
//! registry and mailboxes — is sealed with HMAC-SHA256 and checked in constant time. A request
//! carries a random nonce and the sender's clock; a server refuses nonces it has seen and
//! clocks outside [`WINDOW`], so a captured request cannot be replayed to it. Its MAC also
//! covers its [`Destination`] (the server's role and name), so it cannot be replayed to
//! another server with the same key either. A reply is bound to its
//! request's nonce, so a captured reply cannot answer another request. Unauthenticated or
//! wrongly keyed requests are refused (with a fixed plain reply, so a misconfigured peer gets
//! a clear error), counted, and never reach a handler: they cannot make us register, read or
//! write anything. Without a key, messages are exactly the reference wire format.
//!
//! Sealed request: `"KVXA" 2 | nonce[16] | time_ms u64 LE | mac[32] | payload`, mac over
//! `"req" | destination length u64 LE | destination | nonce | time_ms | payload`. Sealed
//! reply: `"KVXA" 2 | mac[32] | payload`, mac over `"rep" | request nonce | payload`. (Version
//! 1 had no destination: such peers are refused as wrongly keyed.)

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

const MAGIC: &[u8; 5] = b"KVXA\x02";
const NONCE: usize = 16;
const TAG: usize = 32;
/// How far a request's clock may be from ours (either way).
pub const WINDOW: Duration = Duration::from_secs(120);
/// Shortest key accepted.
pub const MIN_KEY_BYTES: usize = 16;
/// Largest key file read.
const MAX_KEY_FILE: u64 = 4096;
/// Most nonces remembered; beyond it, requests are refused until old ones expire.
const MAX_SEEN: usize = 1 << 20;
/// What a server answers a request it refuses.
pub const REFUSED_REPLY: &[u8] = b"kvxfer: side-channel authentication failed";

/// Why a sealed message was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AuthError {
    /// Not a sealed message (no key on the sender, or garbage).
    #[error("message is not authenticated")]
    NotSealed,
    /// The MAC does not match (wrong key or altered message).
    #[error("message authentication failed (wrong key or altered message)")]
    BadMac,
    /// The request's clock is outside the window.
    #[error("request time is {0:?} away from ours (allowed {WINDOW:?})")]
    Stale(Duration),
    /// The nonce was seen before.
    #[error("replayed request")]
    Replayed,
    /// Too many recent requests to remember.
    #[error("too many recent requests")]
    Busy,
}

/// The server a request is for, bound into its MAC: a role and a name both ends know
/// without asking each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination(Vec<u8>);

impl Destination {
    /// The pull side channel of prefill engine `engine_id` (any of its ranks' listeners).
    pub fn pull(engine_id: &str) -> Destination {
        Self::of("pull", engine_id)
    }

    /// The push mailbox of the prefill rank whose transport agent is `agent`.
    pub fn mailbox(agent: &str) -> Destination {
        Self::of("mailbox", agent)
    }

    /// A push bootstrap registry, by the port it listens on: where a port is translated
    /// between the two ends (a NAT), requests to it fail authentication.
    pub fn registry(port: u16) -> Destination {
        Self::of("registry", &port.to_string())
    }

    fn of(role: &str, name: &str) -> Destination {
        let mut v = Vec::with_capacity(role.len().saturating_add(name.len()).saturating_add(1));
        v.extend_from_slice(role.as_bytes());
        v.push(0);
        v.extend_from_slice(name.as_bytes());
        Destination(v)
    }

    /// Its length as the MAC takes it, ahead of the bytes (so no two destinations and
    /// payloads run together the same).
    fn len_bytes(&self) -> [u8; 8] {
        (self.0.len() as u64).to_le_bytes()
    }
}

/// A shared secret.
#[derive(Clone)]
pub struct SideKey(Arc<[u8]>);

impl std::fmt::Debug for SideKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SideKey(..)")
    }
}

impl SideKey {
    /// A key from secret bytes (at least [`MIN_KEY_BYTES`]).
    pub fn new(bytes: &[u8]) -> Result<SideKey, String> {
        if bytes.len() < MIN_KEY_BYTES {
            return Err(format!(
                "side-channel key has {} bytes, at least {MIN_KEY_BYTES} are needed",
                bytes.len()
            ));
        }
        Ok(SideKey(bytes.into()))
    }

    /// The key named by the environment: the contents of `KVXFER_SIDE_CHANNEL_KEY_FILE`
    /// (whitespace trimmed), else `KVXFER_SIDE_CHANNEL_KEY`; `None` when neither is set.
    pub fn from_env() -> Result<Option<SideKey>, String> {
        if let Some(path) = std::env::var_os("KVXFER_SIDE_CHANNEL_KEY_FILE") {
            use std::io::Read;
            let shown = path.to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            std::fs::File::open(&path)
                .and_then(|f| f.take(MAX_KEY_FILE + 1).read_to_end(&mut bytes))
                .map_err(|e| format!("side-channel key file {shown}: {e}"))?;
            if bytes.len() as u64 > MAX_KEY_FILE {
                return Err(format!(
                    "side-channel key file {shown} is over {MAX_KEY_FILE} bytes"
                ));
            }
            return SideKey::new(bytes.trim_ascii()).map(Some);
        }
        match std::env::var("KVXFER_SIDE_CHANNEL_KEY") {
            Ok(k) => SideKey::new(k.trim().as_bytes()).map(Some),
            Err(_) => Ok(None),
        }
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; TAG] {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> Result<(), AuthError> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for p in parts {
            m.update(p);
        }
        // Constant-time comparison.
        m.verify_slice(tag).map_err(|_| AuthError::BadMac)
    }

    /// Seals a request for `to`; returns it with its nonce (to open the reply).
    pub fn seal_request(&self, to: &Destination, payload: &[u8]) -> (Vec<u8>, [u8; NONCE]) {
        let nonce: [u8; NONCE] = rand::random();
        let time = now_ms().to_le_bytes();
        let tag = self.mac(&[b"req", &to.len_bytes(), &to.0, &nonce, &time, payload]);
        let mut out = Vec::with_capacity(capacity(&[MAGIC.len(), NONCE, 8, TAG, payload.len()]));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&time);
        out.extend_from_slice(&tag);
        out.extend_from_slice(payload);
        (out, nonce)
    }

    /// Opens a request to `me`: MAC (a request sealed for another destination fails it),
    /// clock window, then the replay check (only authentic requests enter the nonce cache).
    /// Returns the nonce and payload.
    pub fn open_request<'a>(
        &self,
        me: &Destination,
        bytes: &'a [u8],
        seen: &mut ReplayGuard,
    ) -> Result<([u8; NONCE], &'a [u8]), AuthError> {
        let rest = bytes
            .strip_prefix(MAGIC.as_slice())
            .ok_or(AuthError::NotSealed)?;
        if rest.len() < NONCE + 8 + TAG {
            return Err(AuthError::NotSealed);
        }
        let (nonce, rest) = rest.split_at(NONCE);
        let (time, rest) = rest.split_at(8);
        let (tag, payload) = rest.split_at(TAG);
        self.verify(&[b"req", &me.len_bytes(), &me.0, nonce, time, payload], tag)?;
        let sent = u64::from_le_bytes(time.try_into().expect("8 bytes"));
        let skew = now_ms().abs_diff(sent);
        if skew > WINDOW.as_millis() as u64 {
            return Err(AuthError::Stale(Duration::from_millis(skew)));
        }
        let nonce: [u8; NONCE] = nonce.try_into().expect("16 bytes");
        seen.admit(nonce, sent)?;
        Ok((nonce, payload))
    }

    /// Seals a reply to the request with `nonce`.
    pub fn seal_reply(&self, nonce: &[u8; NONCE], payload: &[u8]) -> Vec<u8> {
        let tag = self.mac(&[b"rep", nonce, payload]);
        let mut out = Vec::with_capacity(capacity(&[MAGIC.len(), TAG, payload.len()]));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&tag);
        out.extend_from_slice(payload);
        out
    }

    /// Opens the reply to the request with `nonce`.
    pub fn open_reply<'a>(
        &self,
        nonce: &[u8; NONCE],
        bytes: &'a [u8],
    ) -> Result<&'a [u8], AuthError> {
        let rest = bytes
            .strip_prefix(MAGIC.as_slice())
            .ok_or(AuthError::NotSealed)?;
        if rest.len() < TAG {
            return Err(AuthError::NotSealed);
        }
        let (tag, payload) = rest.split_at(TAG);
        self.verify(&[b"rep", nonce, payload], tag)?;
        Ok(payload)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Nonces of authentic requests seen within the window (one per server).
#[derive(Debug, Default)]
pub struct ReplayGuard {
    seen: HashMap<[u8; NONCE], u64>,
}

impl ReplayGuard {
    fn admit(&mut self, nonce: [u8; NONCE], sent_ms: u64) -> Result<(), AuthError> {
        if self.seen.contains_key(&nonce) {
            return Err(AuthError::Replayed);
        }
        if self.seen.len() >= MAX_SEEN {
            // Requests older than the window can no longer be replayed (their clock is
            // refused): forget them.
            let oldest = now_ms().saturating_sub(WINDOW.as_millis() as u64);
            self.seen.retain(|_, t| *t >= oldest);
            if self.seen.len() >= MAX_SEEN {
                return Err(AuthError::Busy);
            }
        }
        self.seen.insert(nonce, sent_ms);
        Ok(())
    }
}

static KEY: RwLock<Option<Option<SideKey>>> = RwLock::new(None);

/// Installs (or with `None` removes) the process's side-channel key, overriding the
/// environment. Servers bound afterwards and every later request use it.
pub fn install_key(key: Option<SideKey>) {
    *KEY.write().unwrap_or_else(|e| e.into_inner()) = Some(key);
}

/// The process's key: installed, else from the environment (read once). A malformed setting
/// (short key, unreadable file) is an error at every bind and request, never "no key".
pub fn key() -> Result<Option<SideKey>, String> {
    if let Some(k) = KEY.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return Ok(k.clone());
    }
    let k = SideKey::from_env()?;
    // Only a well-formed environment setting is cached; errors are re-reported.
    let mut slot = KEY.write().unwrap_or_else(|e| e.into_inner());
    Ok(slot.get_or_insert(k).clone())
}

/// The sum of `parts`, saturating (a capacity hint).
fn capacity(parts: &[usize]) -> usize {
    parts.iter().fold(0, |a, b| a.saturating_add(*b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> SideKey {
        SideKey::new(s.as_bytes()).unwrap()
    }

    #[test]
    fn sealed_round_trip_and_refusals() {
        let (a, b) = (
            k("a shared secret of 32 bytes!!!!"),
            k("another secret, also long enough"),
        );
        let mut guard = ReplayGuard::default();
        let me = Destination::pull("prefill-0");
        let (req, nonce) = a.seal_request(&me, b"get_meta_msg");
        let (n, payload) = a.open_request(&me, &req, &mut guard).unwrap();
        assert_eq!((n, payload), (nonce, &b"get_meta_msg"[..]));
        assert_eq!(
            a.open_request(&me, &req, &mut guard),
            Err(AuthError::Replayed)
        );
        let (req2, _) = a.seal_request(&me, b"x");
        assert_eq!(
            b.open_request(&me, &req2, &mut guard),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            a.open_request(&me, b"get_meta_msg", &mut guard),
            Err(AuthError::NotSealed)
        );
        // Sealed for another server with the same key: another engine's listener, a
        // mailbox or registry, or a name that only runs the role into it.
        for other in [
            Destination::pull("prefill-1"),
            Destination::mailbox("prefill-0"),
            Destination::registry(5600),
            Destination::pull("prefill-0\0"),
            Destination::of("pull\0prefill", "0"),
        ] {
            assert_eq!(
                a.open_request(&other, &req2, &mut ReplayGuard::default()),
                Err(AuthError::BadMac),
                "{other:?}"
            );
        }
        for cut in 0..req2.len() {
            assert!(
                a.open_request(&me, &req2[..cut], &mut ReplayGuard::default())
                    .is_err()
            );
        }
        for i in 0..req2.len() {
            let mut t = req2.clone();
            t[i] ^= 1;
            assert!(
                a.open_request(&me, &t, &mut ReplayGuard::default())
                    .is_err(),
                "bit flip at {i}"
            );
        }
        let reply = a.seal_reply(&nonce, b"meta");
        assert_eq!(a.open_reply(&nonce, &reply), Ok(&b"meta"[..]));
        assert_eq!(b.open_reply(&nonce, &reply), Err(AuthError::BadMac));
        // A reply bound to another request's nonce does not open.
        assert_eq!(a.open_reply(&[0; NONCE], &reply), Err(AuthError::BadMac));
        assert_eq!(
            a.open_reply(&nonce, REFUSED_REPLY),
            Err(AuthError::NotSealed)
        );
    }

    #[test]
    fn a_destination_cannot_be_shifted_into_the_nonce() {
        // Sealed for engine "prefill-01", re-cut for engine "prefill-0": the destination's
        // last byte read as the nonce's first, and so on down to the payload. Without the
        // destination's length in the MAC, the bytes it covers would be the same.
        let a = k("a shared secret of 32 bytes!!!!");
        let (req, _) = a.seal_request(&Destination::pull("prefill-01"), b"payload");
        let body = &req[MAGIC.len()..];
        let (nonce, rest) = body.split_at(NONCE);
        let (time, rest) = rest.split_at(8);
        let (tag, payload) = rest.split_at(TAG);
        let mut shifted = b"1".to_vec();
        shifted.extend_from_slice(nonce);
        shifted.extend_from_slice(time);
        shifted.extend_from_slice(payload);
        let mut forged = MAGIC.to_vec();
        forged.extend_from_slice(&shifted[..NONCE + 8]);
        forged.extend_from_slice(tag);
        forged.extend_from_slice(&shifted[NONCE + 8..]);
        assert_eq!(
            a.open_request(
                &Destination::pull("prefill-0"),
                &forged,
                &mut ReplayGuard::default()
            ),
            Err(AuthError::BadMac)
        );
    }

    #[test]
    fn stale_requests_are_refused() {
        let a = k("a shared secret of 32 bytes!!!!");
        let nonce = [7u8; NONCE];
        let old = (now_ms() - WINDOW.as_millis() as u64 - 1000).to_le_bytes();
        let me = Destination::registry(1);
        let tag = a.mac(&[b"req", &me.len_bytes(), &me.0, &nonce, &old, b"p"]);
        let mut req = MAGIC.to_vec();
        req.extend_from_slice(&nonce);
        req.extend_from_slice(&old);
        req.extend_from_slice(&tag);
        req.push(b'p');
        assert!(matches!(
            a.open_request(&me, &req, &mut ReplayGuard::default()),
            Err(AuthError::Stale(_))
        ));
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(SideKey::new(b"short").is_err());
    }
}
