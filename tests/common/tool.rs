//! Stand-in tools (a fake `trtexec`, a Python that fails to import) written by tests and then
//! executed: the one helper every test package uses to write them.
//!
//! Linux refuses to execute a file that any process holds open for writing (`ETXTBSY`, "Text
//! file busy"). A file written with `std::fs::write` is open for writing in this process for a
//! moment; if another test thread forks a child in that moment, the child inherits the
//! descriptor and holds it until it execs (close-on-exec closes it only then), and executing the
//! script meanwhile fails at random. So the bytes are never opened for writing here: a
//! short-lived `sh` child writes and marks them executable, and has exited when this returns.
//! Nobody inherits that child's descriptors, so no descriptor open for writing on the tool can
//! outlive the write in any process.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Writes `script` (a whole file, `#!` line included) to `path` as an executable (0755) and
/// returns `path`. Panics naming the path when the write fails.
pub fn write_tool(path: &Path, script: &str) -> PathBuf {
    // The script travels as an argument, not through a pipe: no descriptor of ours is involved.
    let status = Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"printf '%s' "$2" > "$1" && chmod 0755 "$1""#)
        .arg("sh")
        .arg(path)
        .arg(script)
        .status()
        .unwrap_or_else(|e| panic!("cannot start /bin/sh to write {}: {e}", path.display()));
    assert!(
        status.success(),
        "writing {} failed: {status}",
        path.display()
    );
    path.to_path_buf()
}
