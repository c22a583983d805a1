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

/// Resident bytes (`Rss`, pages mapped into this process) of the mapping that contains address
/// `addr`, from `/proc/self/smaps`. Exact (a page-table walk), and unlike `RssFile` it counts one
/// mapping only, so other files' pages do not blur the figure. `None` without procfs or when no
/// mapping contains `addr`.
pub fn mapping_rss(addr: usize) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = a <= addr && addr < b;
            continue;
        }
        if inside && let Some(v) = line.strip_prefix("Rss:") {
            return v
                .trim()
                .strip_suffix(" kB")?
                .trim()
                .parse::<u64>()
                .ok()
                .map(|k| k * 1024);
        }
    }
    None
}
