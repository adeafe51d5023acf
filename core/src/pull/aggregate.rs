//! Aggregating finished request ids across TP ranks: rank 0 reports an id only when every
//! rank finished it. Engines implement [`FinishedAggregator`] over their own collective; the
//! in-process [`LocalAggregator`] serves tests and the CLI.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Collects per-rank finished ids and releases those every rank reported.
pub trait FinishedAggregator: Send {
    /// Records `ids` finished by `rank`; returns the ids now finished on all ranks.
    fn submit(&mut self, rank: u32, ids: Vec<String>) -> Vec<String>;
}

/// Shared in-process aggregator for `tp_size` ranks. An id completes when each rank
/// reported it at least once: a rank repeating an id, or a rank outside `0..tp_size`,
/// never completes it for the others.
#[derive(Debug, Clone)]
pub struct LocalAggregator {
    tp_size: u32,
    ranks: Arc<Mutex<HashMap<String, BTreeSet<u32>>>>,
}

impl LocalAggregator {
    /// An aggregator for `tp_size` ranks.
    pub fn new(tp_size: u32) -> Self {
        LocalAggregator {
            tp_size: tp_size.max(1),
            ranks: Arc::default(),
        }
    }
}

impl FinishedAggregator for LocalAggregator {
    fn submit(&mut self, rank: u32, ids: Vec<String>) -> Vec<String> {
        if rank >= self.tp_size {
            return Vec::new();
        }
        let mut ranks = self.ranks.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = Vec::new();
        for id in ids {
            let seen = ranks.entry(id.clone()).or_default();
            seen.insert(rank);
            if seen.len() == self.tp_size as usize {
                ranks.remove(&id);
                done.push(id);
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_only_when_all_ranks_finished() {
        let mut a = LocalAggregator::new(2);
        let mut b = a.clone();
        assert!(a.submit(0, vec!["r1".into(), "r2".into()]).is_empty());
        assert_eq!(b.submit(1, vec!["r2".into()]), vec!["r2".to_string()]);
        assert_eq!(b.submit(1, vec!["r1".into()]), vec!["r1".to_string()]);
    }

    #[test]
    fn a_rank_repeating_an_id_does_not_complete_it() {
        let mut a = LocalAggregator::new(2);
        assert!(a.submit(0, vec!["r".into()]).is_empty());
        assert!(a.submit(0, vec!["r".into(), "r".into()]).is_empty());
        assert_eq!(a.submit(1, vec!["r".into()]), vec!["r".to_string()]);
        // Completed ids are forgotten: a later report starts over.
        assert!(a.submit(1, vec!["r".into()]).is_empty());
    }

    #[test]
    fn a_rank_outside_the_tp_group_is_ignored() {
        let mut a = LocalAggregator::new(2);
        assert!(a.submit(0, vec!["r".into()]).is_empty());
        assert!(a.submit(2, vec!["r".into()]).is_empty());
        assert!(a.submit(u32::MAX, vec!["r".into()]).is_empty());
        assert_eq!(a.submit(1, vec!["r".into()]), vec!["r".to_string()]);
        let mut one = LocalAggregator::new(1);
        assert_eq!(one.submit(0, vec!["x".into()]), vec!["x".to_string()]);
    }
}
