//! Aggregating finished request ids across TP ranks: rank 0 reports an id only when every
//! rank finished it. Engines implement [`FinishedAggregator`] over their own collective; the
//! in-process [`LocalAggregator`] serves tests and the CLI.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Collects per-rank finished ids and releases those every rank reported.
pub trait FinishedAggregator: Send {
    /// Records `ids` finished by `rank`; returns the ids now finished on all ranks.
    fn submit(&mut self, rank: u32, ids: Vec<String>) -> Vec<String>;
}

/// Shared in-process aggregator for `tp_size` ranks.
#[derive(Debug, Clone)]
pub struct LocalAggregator {
    tp_size: u32,
    counts: Arc<Mutex<HashMap<String, u32>>>,
}

impl LocalAggregator {
    /// An aggregator for `tp_size` ranks.
    pub fn new(tp_size: u32) -> Self {
        LocalAggregator {
            tp_size: tp_size.max(1),
            counts: Arc::default(),
        }
    }
}

impl FinishedAggregator for LocalAggregator {
    fn submit(&mut self, _rank: u32, ids: Vec<String>) -> Vec<String> {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = Vec::new();
        for id in ids {
            let c = counts.entry(id.clone()).or_insert(0);
            *c += 1;
            if *c == self.tp_size {
                counts.remove(&id);
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
}
