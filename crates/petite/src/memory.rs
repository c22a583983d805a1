//! In-process measurement: a background sampler of `/proc/self/status` and `/proc/self/io`, and
//! per-stage records (wall time, peak RSS, peak RssAnon, bytes read and written).
//!
//! Why a sampler and not only `VmHWM`: `VmHWM` is the peak of RSS alone and can only be reset for
//! the whole process (`/proc/self/clear_refs`, not permitted everywhere); the anonymous part —
//! the memory a Jetson cannot get back by evicting clean file pages — has no kernel high-water
//! mark at all. A 10 ms sampler sees every plateau that matters (engines take seconds).

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One reading of `/proc/self/status` (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Status {
    /// `VmHWM`: the kernel's peak RSS of the process so far.
    pub hwm: u64,
    /// `VmRSS`.
    pub rss: u64,
    /// `RssAnon`.
    pub anon: u64,
    /// `RssFile`.
    pub file: u64,
}

/// Reads `/proc/self/status` (through petite-weights' one reader); `None` off Linux or if the
/// fields are missing.
pub fn status() -> Option<Status> {
    petite_weights::residency::rss().map(|r| Status {
        hwm: r.peak,
        rss: r.total,
        anon: r.anon,
        file: r.file,
    })
}

/// What bounds this process's memory when no budget is given, and how much that is in all (its
/// own RSS included): the limit of its memory cgroup where one is set (a container, `memcap`:
/// the kernel kills beyond it), else the kernel's `MemAvailable` plus the process's own RSS.
/// `None` where neither can be read.
pub fn machine_memory() -> Option<(&'static str, u64)> {
    let own = status().map_or(0, |s| s.rss);
    let available = petite_engine::gpu::mem_available(
        &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
    )
    .map(|a| a + own);
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    match (
        cgroup_limit(&groups, Path::new("/sys/fs/cgroup")),
        available,
    ) {
        (Some(l), a) if a.is_none_or(|a| l < a) => Some(("cgroup memory limit", l)),
        (_, a) => a.map(|a| ("memory available", a)),
    }
}

/// The memory limit of the cgroup `groups` (`/proc/self/cgroup` text) names, read under `root`:
/// v2 `memory.max` (`max`: none), v1 `memory.limit_in_bytes` (a page-rounded `i64::MAX`: none).
fn cgroup_limit(groups: &str, root: &Path) -> Option<u64> {
    for line in groups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let path = path.trim_start_matches('/');
        let file = match controllers {
            "" => root.join(path).join("memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                root.join("memory").join(path).join("memory.limit_in_bytes")
            }
            _ => continue,
        };
        let text = std::fs::read_to_string(file).ok()?;
        return text.trim().parse::<u64>().ok().filter(|&l| l < 1 << 62);
    }
    None
}

/// `(read_bytes, write_bytes)` of `/proc/self/io`: bytes this process made the storage layer
/// fetch and send (page-cache hits are not reads).
pub fn io_bytes() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    let mut r = None;
    let mut w = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("read_bytes:") {
            r = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("write_bytes:") {
            w = v.trim().parse().ok();
        }
    }
    Some((r?, w?))
}

#[derive(Default)]
struct Peaks {
    rss: AtomicU64,
    anon: AtomicU64,
}

impl Peaks {
    fn observe(&self, s: &Status) {
        self.rss.fetch_max(s.rss, Ordering::Relaxed);
        self.anon.fetch_max(s.anon, Ordering::Relaxed);
    }
    fn reset_to(&self, s: &Status) {
        self.rss.store(s.rss, Ordering::Relaxed);
        self.anon.store(s.anon, Ordering::Relaxed);
    }
}

/// What one stage took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    /// Stage name (`convert`, `plan`, `engines`, `save`, ...).
    pub name: String,
    /// Wall seconds.
    pub seconds: f64,
    /// Peak `VmRSS` seen during the stage (sampled every 10 ms, plus start and end).
    pub peak_rss: u64,
    /// Peak `RssAnon` seen during the stage.
    pub peak_anon: u64,
    /// Storage bytes read during the stage (`/proc/self/io` `read_bytes`).
    pub bytes_read: u64,
    /// Storage bytes written during the stage (`write_bytes`).
    pub bytes_written: u64,
    /// Whether the stage's work was reused from an earlier run (cache hit).
    pub reused: bool,
}

/// The sampler and the stages recorded so far. Dropping it stops the thread.
pub struct Recorder {
    peaks: Arc<Peaks>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stages: Mutex<Vec<StageRecord>>,
    start: Instant,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("stages", &self.stages)
            .finish()
    }
}

/// A stage in progress; [`Recorder::end`] closes it.
#[derive(Debug)]
pub struct Stage {
    name: String,
    t0: Instant,
    io0: (u64, u64),
}

impl Recorder {
    /// Starts the background sampler (period `every`).
    pub fn start(every: Duration) -> Recorder {
        let peaks = Arc::new(Peaks::default());
        let stop = Arc::new(AtomicBool::new(false));
        if let Some(s) = status() {
            peaks.reset_to(&s);
        }
        let (p, st) = (peaks.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("petite-memory-sampler".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    if let Some(s) = status() {
                        p.observe(&s);
                    }
                    std::thread::sleep(every);
                }
            })
            .ok();
        Recorder {
            peaks,
            stop,
            thread,
            stages: Mutex::new(Vec::new()),
            start: Instant::now(),
        }
    }

    /// Opens a stage: resets the sampled peaks to the current figures.
    pub fn begin(&self, name: &str) -> Stage {
        if let Some(s) = status() {
            self.peaks.reset_to(&s);
        }
        Stage {
            name: name.to_string(),
            t0: Instant::now(),
            io0: io_bytes().unwrap_or_default(),
        }
    }

    /// Closes a stage and records it.
    pub fn end(&self, stage: Stage, reused: bool) -> StageRecord {
        if let Some(s) = status() {
            self.peaks.observe(&s);
        }
        let io1 = io_bytes().unwrap_or_default();
        let rec = StageRecord {
            name: stage.name,
            seconds: stage.t0.elapsed().as_secs_f64(),
            peak_rss: self.peaks.rss.load(Ordering::Relaxed),
            peak_anon: self.peaks.anon.load(Ordering::Relaxed),
            bytes_read: io1.0.saturating_sub(stage.io0.0),
            bytes_written: io1.1.saturating_sub(stage.io0.1),
            reused,
        };
        self.stages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rec.clone());
        rec
    }

    /// Stages recorded so far, in order.
    pub fn stages(&self) -> Vec<StageRecord> {
        self.stages
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Seconds since the recorder started.
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `n` bytes as GiB/MiB/KiB text ([`petite_weights::human_bytes`], the one formatter).
pub use petite_weights::human_bytes as human;

/// Parses a byte size: `512MiB`, `1GiB`, `64KiB`, `1.5GiB`, `100MB` or a plain byte count
/// (binary units are powers of 1024, decimal ones powers of 1000; integers are exact).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "kib" | "K" | "k" => 1 << 10,
        "MiB" | "mib" | "M" | "m" => 1 << 20,
        "GiB" | "gib" | "G" | "g" => 1 << 30,
        "TiB" | "tib" | "T" | "t" => 1 << 40,
        "KB" | "kB" | "kb" => 1_000,
        "MB" | "mb" => 1_000_000,
        "GB" | "gb" => 1_000_000_000,
        "TB" | "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "expected a size like 512MiB, 1GiB or 65536, found unit `{other}` in `{s}`"
            ));
        }
    };
    if num.is_empty() {
        return Err(format!(
            "expected a size like 512MiB, 1GiB or 65536, found `{s}`"
        ));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("size `{s}` does not fit in 64 bits"));
    }
    let f: f64 = num
        .parse()
        .map_err(|_| format!("expected a size like 512MiB, 1GiB or 65536, found `{s}`"))?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("size `{s}` does not fit in 64 bits"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {

    /// The cgroup's limit is found for v2 and v1 layouts; "no limit" values count as none.
    #[test]
    fn cgroup_limit_reads_v2_and_v1() {
        let d = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let p = d.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        write("box/memory.max", "1073741824\n");
        assert_eq!(cgroup_limit("0::/box\n", d.path()), Some(1 << 30));
        write("box/memory.max", "max\n");
        assert_eq!(cgroup_limit("0::/box\n", d.path()), None);
        write("memory/job/memory.limit_in_bytes", "536870912\n");
        let v1 = "5:devices:/\n4:memory:/job\n0::/\n";
        assert_eq!(cgroup_limit(v1, d.path()), Some(512 << 20));
        write("memory/job/memory.limit_in_bytes", "9223372036854771712\n");
        assert_eq!(cgroup_limit(v1, d.path()), None);
        assert_eq!(cgroup_limit("", d.path()), None);
    }
    use super::*;

    #[test]
    fn status_and_io_are_read() {
        let s = status().expect("linux /proc/self/status");
        assert!(s.rss > 0 && s.hwm >= s.rss && s.anon > 0);
        assert!(io_bytes().is_some());
    }

    #[test]
    fn stage_sees_a_transient_allocation() {
        let r = Recorder::start(Duration::from_millis(2));
        let st = r.begin("alloc");
        let before = status().unwrap().anon;
        let v = vec![1u8; 64 << 20];
        std::thread::sleep(Duration::from_millis(50));
        drop(std::hint::black_box(v));
        let rec = r.end(st, false);
        assert!(
            rec.peak_anon >= before + (60 << 20),
            "peak anon {} vs before {before}",
            rec.peak_anon
        );
        assert_eq!(r.stages().len(), 1);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("MiB").is_err());
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("100MB"), Ok(100_000_000));
        assert_eq!(parse_size("8gib"), Ok(8 << 30));
        assert!(parse_size("512 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_size("99999999999999TiB").is_err());
    }
}
