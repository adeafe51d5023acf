//! Saturating counters. Statistics count what peers make us do (notes, transfers, bytes), so
//! they saturate instead of wrapping or panicking, and the peer-facing modules, which deny
//! clippy's `arithmetic_side_effects`, stay free of unchecked `+=`.

use std::time::Duration;

/// A counter that saturates at its maximum.
pub(crate) trait Tally {
    /// Adds `by`, saturating.
    fn tally(&mut self, by: Self);
}

impl Tally for u64 {
    fn tally(&mut self, by: u64) {
        *self = self.saturating_add(by);
    }
}

impl Tally for u32 {
    fn tally(&mut self, by: u32) {
        *self = self.saturating_add(by);
    }
}

impl Tally for usize {
    fn tally(&mut self, by: usize) {
        *self = self.saturating_add(by);
    }
}

impl Tally for Duration {
    fn tally(&mut self, by: Duration) {
        *self = self.saturating_add(by);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_saturate() {
        let mut n = u64::MAX - 1;
        n.tally(5);
        assert_eq!(n, u64::MAX);
        let mut m = 3u32;
        m.tally(4);
        assert_eq!(m, 7);
        let mut u = usize::MAX;
        u.tally(1);
        assert_eq!(u, usize::MAX);
        let mut v = 2usize;
        v.tally(3);
        assert_eq!(v, 5);
        let mut d = Duration::MAX;
        d.tally(Duration::from_secs(1));
        assert_eq!(d, Duration::MAX);
        let mut e = Duration::from_secs(1);
        e.tally(Duration::from_millis(500));
        assert_eq!(e, Duration::from_millis(1500));
    }
}
