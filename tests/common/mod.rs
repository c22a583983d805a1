//! Helpers the `petite` binary's end-to-end tests share: running the binary, finding a golden
//! case, a scratch directory per test, and reading what a run left behind.
// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod policy;
mod tool;
#[allow(unused_imports)] // not every test file runs a stand-in tool
pub use tool::write_tool;

/// The `petite` binary, with backtraces off so error text is what a user sees.
pub fn petite() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_petite"));
    c.env("RUST_BACKTRACE", "0");
    c
}

/// The lerobot golden cases (`testdata/pi05`), one directory each.
pub fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/pi05")
}

/// One golden case by name.
pub fn case(name: &str) -> PathBuf {
    goldens().join(name)
}

/// A fresh directory under the temp dir, removed on drop. Named after the test file and the
/// process so test files and concurrent runs do not collide.
pub struct Scratch(pub PathBuf);
impl Scratch {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "petite-{}-{tag}-{}",
            env!("CARGO_CRATE_NAME"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `petite export` of golden case `c` into `out`; the caller adds backend and other flags.
pub fn export_cmd(c: &Path, out: &Path) -> Command {
    let mut cmd = petite();
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(c.join("model.safetensors"))
        .arg("--config")
        .arg(c.join("config.json"))
        .arg("--out")
        .arg(out);
    cmd
}

/// `petite verify` of the files in `dir` against golden case `c`'s checkpoint and config.
pub fn verify_cmd(c: &Path, dir: &Path) -> Command {
    let mut cmd = petite();
    cmd.arg("verify")
        .arg("--dir")
        .arg(dir)
        .arg("--checkpoint")
        .arg(c.join("model.safetensors"))
        .arg("--config")
        .arg(c.join("config.json"));
    cmd
}

/// `o`, after asserting the run succeeded (stderr and stdout in the message if not).
pub fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    o
}

/// The `report.json` an export (and verify) wrote into `dir`.
pub fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap()
}

/// The bytes of the two programs an export wrote into `dir`: (`prefix.pte`, `step.pte`).
pub fn outputs(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(dir.join("prefix.pte")).unwrap(),
        std::fs::read(dir.join("step.pte")).unwrap(),
    )
}

/// A failed run's stderr ends in exactly one error line, `petite: error: <what> (<cause>)`,
/// whatever failed (notices and progress may come before it): no "Caused by:" list, no `Error:`
/// debug report, no cause said twice. Returns that line.
pub fn error_line(err: &str) -> &str {
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains("petite: error: "))
        .collect();
    assert_eq!(errors.len(), 1, "one error line expected:\n{err}");
    let last = lines.last().unwrap().trim_start_matches('\r').trim();
    assert!(
        last.starts_with("petite: error: "),
        "the error line is last:\n{err}"
    );
    assert!(
        !err.contains("Caused by") && !err.contains("Error: "),
        "{err}"
    );
    last
}

/// Spawns `cmd` with the stop hook at `point` and waits until the child has stopped there.
pub fn spawn_stopped(cmd: &mut Command, point: &str) -> Child {
    let mut child = cmd
        .env("PETITE_TEST_STOP_AT", point)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let t0 = Instant::now();
    let failure = loop {
        let mut status = 0;
        // SAFETY: `status` is a live int; the pid is our own unreaped child. WUNTRACED reports
        // a stop without reaping; WNOHANG keeps the loop bounded.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED | libc::WNOHANG) };
        if r == pid {
            if libc::WIFSTOPPED(status) {
                return child;
            }
            // Reaped by waitpid already: std's wait below then reports ECHILD, which is fine.
            break format!("child ended (status {status:#x}) before stop point {point}");
        }
        if t0.elapsed() > Duration::from_secs(120) {
            break format!("never reached {point}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    panic!("{failure}");
}

/// Resumes a stopped child and collects its output.
pub fn resume(child: Child) -> Output {
    // SAFETY: kill takes no pointers; the pid is our own stopped, unreaped child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) };
    child.wait_with_output().unwrap()
}
