//! `report.json` (written next to the outputs, temporary name then rename) and the one-screen
//! summary table printed at the end of an export.

use std::io::Write;
use std::path::Path;

use crate::memory::{StageRecord, human};
use crate::{Error, Result};

/// Writes `value` as pretty JSON to `path` through a temporary name in the same directory.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("report"),
        std::process::id()
    ));
    let text = serde_json::to_string_pretty(value)?;
    let res = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, "create", e))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.write_all(b"\n"))
            .and_then(|_| f.sync_all())
            .map_err(|e| Error::io(&tmp, "write", e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "rename into place", e))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Reads a JSON file (an existing report to extend).
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, "read", e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadJson {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// The summary table: one row per stage (wall, peak RSS, peak RssAnon, read, written) and a
/// total row (peaks are the maxima over stages).
pub fn table(stages: &[StageRecord], total_seconds: f64) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<12} {:>9} {:>11} {:>11} {:>11} {:>11}\n",
        "stage", "wall", "peak RSS", "peak anon", "read", "written"
    ));
    let row = |name: &str, secs: f64, r: u64, a: u64, rd: u64, wr: u64, tag: &str| {
        format!(
            "{:<12} {:>8.1}s {:>11} {:>11} {:>11} {:>11}{}\n",
            name,
            secs,
            human(r),
            human(a),
            human(rd),
            human(wr),
            tag
        )
    };
    for st in stages {
        s.push_str(&row(
            &st.name,
            st.seconds,
            st.peak_rss,
            st.peak_anon,
            st.bytes_read,
            st.bytes_written,
            if st.reused { "  (reused)" } else { "" },
        ));
    }
    s.push_str(&row(
        "total",
        total_seconds,
        stages.iter().map(|s| s.peak_rss).max().unwrap_or(0),
        stages.iter().map(|s| s.peak_anon).max().unwrap_or(0),
        stages.iter().map(|s| s.bytes_read).sum(),
        stages.iter().map(|s| s.bytes_written).sum(),
        "",
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_a_row_per_stage_and_total_maxima() {
        let st = |n: &str, r: u64| StageRecord {
            name: n.into(),
            seconds: 1.0,
            peak_rss: r,
            peak_anon: r / 2,
            bytes_read: 10,
            bytes_written: 20,
            reused: false,
        };
        let t = table(&[st("load", 1 << 30), st("save", 3 << 30)], 2.0);
        assert_eq!(t.lines().count(), 4);
        let total = t.lines().last().unwrap();
        assert!(
            total.contains("3.00 GiB") && total.contains("40 B"),
            "{total}"
        );
    }

    #[test]
    fn json_is_written_atomically() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("report.json");
        write_json(&p, &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(read_json(&p).unwrap()["a"], 1);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        assert!(write_json(&d.path().join("no/such/dir/r.json"), &serde_json::json!(1)).is_err());
    }
}
