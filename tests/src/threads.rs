//! This process's threads as Linux names them, for tests that check a thread has ended.

/// Names of this process's live threads (Linux keeps a name's first 15 bytes).
pub fn names() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim_end().to_string())
        .collect()
}

/// Whether a live thread of this process is named `name`.
pub fn alive(name: &str) -> bool {
    names().iter().any(|n| n == name)
}

/// Whether no live thread is named `name` within `wait`: a joined thread leaves
/// /proc/self/task a moment after the join returned.
pub fn gone_within(name: &str, wait: std::time::Duration) -> bool {
    let start = std::time::Instant::now();
    while alive(name) {
        if start.elapsed() > wait {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    true
}
