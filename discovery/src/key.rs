//! The key layout: where a rank's record lives in the store.
//!
//! `/kvxfer/v1/<cluster>/engines/<role>/<engine_id>/ranks/<dp>.<pp>.<tp>`
//!
//! One key per engine rank. Names are restricted to a safe character set so that a prefix of
//! one engine can never be a prefix of another (`/` ends each segment) and so keys can be typed
//! in `etcdctl` as they are.

use std::fmt;

/// The first segments of every key this version writes.
pub const ROOT: &str = "/kvxfer/v1/";
/// The longest cluster name or engine id accepted.
pub const MAX_NAME: usize = 128;

/// Which side of the disaggregation an engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Computes the prompt's KV cache.
    Prefill,
    /// Generates tokens from it.
    Decode,
}

impl Role {
    /// The segment in keys.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    /// Parses a key segment or command-line value.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rank's place in its engine: data-parallel, pipeline and tensor-parallel index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankIndex {
    /// Data-parallel index.
    pub dp: u32,
    /// Pipeline stage.
    pub pp: u32,
    /// Tensor-parallel rank.
    pub tp: u32,
}

impl fmt::Display for RankIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.dp, self.pp, self.tp)
    }
}

impl RankIndex {
    fn parse(s: &str) -> Option<RankIndex> {
        let mut it = s.split('.');
        let mut next = || -> Option<u32> {
            let p = it.next()?;
            // Canonical decimal only, so one rank has exactly one key.
            if p.is_empty() || p.len() > 10 || (p.len() > 1 && p.starts_with('0')) {
                return None;
            }
            if !p.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p.parse().ok()
        };
        let r = RankIndex {
            dp: next()?,
            pp: next()?,
            tp: next()?,
        };
        it.next().is_none().then_some(r)
    }
}

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid {what} {name:?}: 1 to {MAX_NAME} characters from [A-Za-z0-9_.-], not starting with '.'"
)]
pub struct NameError {
    /// Which name.
    pub what: &'static str,
    /// The value refused.
    pub name: String,
}

/// Checks a cluster name or engine id.
pub fn check_name(what: &'static str, name: &str) -> Result<(), NameError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(NameError {
            what,
            name: name.to_owned(),
        })
    }
}

/// The full identity of one rank's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    /// The fleet's name: engines only see engines of their own cluster.
    pub cluster: String,
    /// The engine's side.
    pub role: Role,
    /// The engine's id (vLLM's `engine_id`).
    pub engine_id: String,
    /// The rank within the engine.
    pub rank: RankIndex,
}

impl RankKey {
    /// A key, its names checked.
    pub fn new(
        cluster: &str,
        role: Role,
        engine_id: &str,
        rank: RankIndex,
    ) -> Result<RankKey, NameError> {
        check_name("cluster name", cluster)?;
        check_name("engine id", engine_id)?;
        Ok(RankKey {
            cluster: cluster.to_owned(),
            role,
            engine_id: engine_id.to_owned(),
            rank,
        })
    }

    /// The key as stored.
    pub fn to_key(&self) -> String {
        format!(
            "{}ranks/{}",
            engine_prefix(&self.cluster, self.role, &self.engine_id),
            self.rank
        )
    }

    /// Parses a stored key; `None` for anything not written by this layout.
    pub fn parse(key: &[u8]) -> Option<RankKey> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(ROOT)?;
        let mut seg = rest.split('/');
        let cluster = seg.next()?;
        (seg.next()? == "engines").then_some(())?;
        let role = Role::parse(seg.next()?)?;
        let engine_id = seg.next()?;
        (seg.next()? == "ranks").then_some(())?;
        let rank = RankIndex::parse(seg.next()?)?;
        if seg.next().is_some() {
            return None;
        }
        RankKey::new(cluster, role, engine_id, rank).ok()
    }
}

/// Every key of a cluster's engines of one role: `/kvxfer/v1/<cluster>/engines/<role>/`.
pub fn role_prefix(cluster: &str, role: Role) -> String {
    format!("{ROOT}{cluster}/engines/{role}/")
}

/// Every key of one engine: `/kvxfer/v1/<cluster>/engines/<role>/<engine_id>/`.
pub fn engine_prefix(cluster: &str, role: Role, engine_id: &str) -> String {
    format!("{}{engine_id}/", role_prefix(cluster, role))
}

/// The end of etcd's range for `prefix`: the prefix with its last byte incremented (our
/// prefixes end in `/`, never 0xff).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last.saturating_add(1));
            return end;
        }
    }
    // All 0xff (or empty): etcd's "\0" means every key from `prefix` on.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(engine: &str, dp: u32, pp: u32, tp: u32) -> RankKey {
        RankKey::new("c1", Role::Prefill, engine, RankIndex { dp, pp, tp }).unwrap()
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        assert_eq!(
            key("p-0", 1, 2, 3).to_key(),
            "/kvxfer/v1/c1/engines/prefill/p-0/ranks/1.2.3"
        );
        assert_eq!(
            engine_prefix("c1", Role::Decode, "d"),
            "/kvxfer/v1/c1/engines/decode/d/"
        );
    }

    #[test]
    fn foreign_and_malformed_keys_are_not_ours() {
        for k in [
            "/kvxfer/v2/c1/engines/prefill/p/ranks/0.0.0",
            "/kvxfer/v1/c1/engines/router/p/ranks/0.0.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.0.0.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.01.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.+1.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.4294967296.0",
            "/kvxfer/v1/c1/engines/prefill/p/ranks/0.0.0/x",
            "/kvxfer/v1/c1/engines/prefill/p/rank/0.0.0",
            "/kvxfer/v1/c1/nodes/prefill/p/ranks/0.0.0",
            "/kvxfer/v1/c 1/engines/prefill/p/ranks/0.0.0",
            "/kvxfer/v1//engines/prefill/p/ranks/0.0.0",
            "/kvxfer/v1/c1/engines/prefill/../ranks/0.0.0",
        ] {
            assert_eq!(RankKey::parse(k.as_bytes()), None, "{k}");
        }
        assert_eq!(RankKey::parse(&[0xff, 0xfe]), None);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("x", "engine_0.a-b").is_ok());
        for bad in [
            "",
            ".",
            ".hidden",
            "a/b",
            "a b",
            "é",
            &"x".repeat(MAX_NAME + 1),
        ] {
            assert!(check_name("x", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("x", &"x".repeat(MAX_NAME)).is_ok());
        let e = RankKey::new(
            "c",
            Role::Prefill,
            "a/b",
            RankIndex {
                dp: 0,
                pp: 0,
                tp: 0,
            },
        );
        assert_eq!(e.unwrap_err().what, "engine id");
    }

    #[test]
    fn prefix_end_covers_exactly_the_prefix() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b");
        assert_eq!(prefix_end(&[0xff]), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    proptest! {
        #[test]
        fn keys_round_trip(engine in "[A-Za-z0-9_-][A-Za-z0-9_.-]{0,20}", dp: u32, pp: u32, tp: u32,
                           decode: bool) {
            let role = if decode { Role::Decode } else { Role::Prefill };
            let k = RankKey::new("fleet", role, &engine, RankIndex { dp, pp, tp }).unwrap();
            let s = k.to_key();
            prop_assert!(s.starts_with(&engine_prefix("fleet", role, &engine)));
            prop_assert_eq!(RankKey::parse(s.as_bytes()), Some(k));
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = RankKey::parse(&bytes);
        }
    }
}
