//! The agents that fetched a listener's metadata naming themselves: the decode ranks that
//! will read this rank's blocks, and so the only peers whose pull notifications count.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most names kept; past it the oldest goes (a decode that restarted under a new name
/// leaves its old one behind).
pub const MAX_READERS: usize = 4096;
/// Longest agent name a request may carry.
pub const MAX_READER_NAME: usize = 256;

/// A bounded set of reader names, shared by the listener thread (which adds) and the
/// worker (which asks).
#[derive(Debug, Default)]
pub struct KnownReaders {
    inner: Mutex<(VecDeque<String>, HashSet<String>)>,
    unnamed: AtomicBool,
}

impl KnownReaders {
    /// A reader that cannot name itself was served (a stock vLLM decode: its request has no
    /// agent name): from now on notes from agents not named are accepted too, as vLLM's
    /// own prefill accepts them. Each sender still counts once per request.
    pub fn allow_unnamed(&self) {
        self.unnamed.store(true, Ordering::Relaxed);
    }

    /// Whether [`KnownReaders::allow_unnamed`] was called.
    pub fn unnamed_allowed(&self) -> bool {
        self.unnamed.load(Ordering::Relaxed)
    }

    /// Whether `name` fetched the metadata naming itself.
    pub fn contains(&self, name: &str) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .contains(name)
    }

    /// Records `name`, evicting the oldest name when full.
    pub fn add(&self, name: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (order, set) = &mut *g;
        if set.contains(name) {
            return;
        }
        if order.len() >= MAX_READERS {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
        order.push_back(name.to_string());
        set.insert(name.to_string());
    }

    /// How many names are kept.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }

    /// Whether no name is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kept_once_and_the_oldest_goes_when_full() {
        let r = KnownReaders::default();
        assert!(r.is_empty());
        r.add("a");
        assert!(!r.is_empty());
        r.add("a");
        assert_eq!(r.len(), 1);
        for i in 0..MAX_READERS {
            r.add(&format!("n{i}"));
        }
        assert_eq!(r.len(), MAX_READERS);
        assert!(!r.contains("a"), "the oldest name was evicted");
        assert!(r.contains("n0") && r.contains(&format!("n{}", MAX_READERS - 1)));
        r.add("n0");
        assert!(r.contains("n1"), "a name already kept evicts nothing");
    }
}
