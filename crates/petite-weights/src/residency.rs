//! This process's memory as the kernel reports it, for residency checks and benchmarks.

use std::collections::HashMap;

/// Resident memory of this process, in bytes, from `/proc/self/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rss {
    /// Total resident set (`VmRSS`).
    pub total: u64,
    /// Anonymous pages (`RssAnon`): heap, stacks.
    pub anon: u64,
    /// File-backed pages mapped into this process (`RssFile`): e.g. touched weights.
    pub file: u64,
    /// Peak resident set (`VmHWM`).
    pub peak: u64,
}

/// Reads `/proc/self/status`. `None` where there is no procfs (non-Linux).
pub fn rss() -> Option<Rss> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let mut kv: HashMap<&str, u64> = HashMap::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(':') {
            let v = v.trim();
            if let Some(kb) = v
                .strip_suffix(" kB")
                .and_then(|n| n.trim().parse::<u64>().ok())
            {
                kv.insert(k, kb * 1024);
            }
        }
    }
    Some(Rss {
        total: *kv.get("VmRSS")?,
        anon: *kv.get("RssAnon")?,
        file: *kv.get("RssFile")?,
        peak: *kv.get("VmHWM")?,
    })
}
