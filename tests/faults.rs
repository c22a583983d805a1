//! Faults (issue 13), each with its exact outcome: what the user sees, the exit code, what is
//! left on disk, and whether a re-run then finishes with the bytes of an undisturbed export.
//! A mapped input truncated while it is read (SIGBUS / EFAULT), an input changed between stages,
//! two exports into one directory, a full disk, damaged cache files of each kind, unreadable
//! and unwritable paths. Processes are paused at known points through the hidden
//! `PETITE_TEST_STOP_AT` hook (the child stops itself with SIGSTOP; the test waits for the stop,
//! changes the input, sends SIGCONT), so nothing here depends on timing.
mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime};

use common::{Scratch, case, ok, outputs, petite, report, resume, spawn_stopped};

const EXIT_CHANGED: i32 = 74;

/// A private copy of golden case `name` (config, checkpoint, inputs) under `dir`.
fn copy_case(name: &str, dir: &Path) -> PathBuf {
    let c = dir.join(name);
    std::fs::create_dir_all(&c).unwrap();
    for f in ["config.json", "model.safetensors", "inputs.safetensors"] {
        std::fs::copy(case(name).join(f), c.join(f)).unwrap();
    }
    c
}

fn export_cmd(c: &Path, out: &Path) -> Command {
    let mut cmd = common::export_cmd(c, out);
    cmd.args(["--engine-cap", "64KiB"]);
    cmd
}

/// The run's stderr; when it failed, checked to end in the one error line (`common::error_line`).
fn stderr(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    if !o.status.success() {
        // Shown with --nocapture: the fault table's error lines as a user sees them.
        eprintln!("[{:?}] {}", o.status.code(), common::error_line(&err));
    }
    err
}

/// The stderr of a run that stopped because an input changed under it: exit
/// [`EXIT_CHANGED`], an error rather than a panic.
fn failed_as_changed(o: &Output) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(EXIT_CHANGED), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Names under `dir` (recursively, relative, sorted), with each file's size.
fn listing(dir: &Path) -> Vec<(String, u64)> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<(String, u64)>) {
        let Ok(rd) = std::fs::read_dir(d) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().display().to_string();
            if p.is_dir() {
                out.push((format!("{rel}/"), 0));
                walk(base, &p, out);
            } else {
                out.push((rel, e.metadata().unwrap().len()));
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, dir, &mut v);
    v.sort();
    v
}

fn names(dir: &Path) -> Vec<String> {
    listing(dir).into_iter().map(|(n, _)| n).collect()
}

/// Sets `path`'s length (what another process's `truncate` does).
fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// Puts `bytes` back at `path` with modification time `mtime` (the checkpoint's identity,
/// which names the cache and engine files, is then the original one again).
fn restore(path: &Path, bytes: &[u8], mtime: SystemTime) {
    std::fs::write(path, bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
}

fn mtime(p: &Path) -> SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

/// A clean export of `c` (the bytes every recovered run must reproduce).
fn clean(c: &Path, out: &Path) -> (Vec<u8>, Vec<u8>) {
    ok(export_cmd(c, out).output().unwrap());
    outputs(out)
}

#[test]
fn checkpoint_truncated_during_convert_is_a_clear_error_and_the_rerun_recovers() {
    let s = Scratch::new("sigbus-convert");
    let c = copy_case("two_cams_mqa", &s.0);
    let model = c.join("model.safetensors");
    let (bytes, t) = (std::fs::read(&model).unwrap(), mtime(&model));
    let want = clean(&c, &s.0.join("clean"));
    let out = s.0.join("out");
    let child = spawn_stopped(&mut export_cmd(&c, &out), "convert");
    truncate(&model, 4096);
    let o = resume(child);
    let err = failed_as_changed(&o);
    let head = format!(
        "petite: error: checkpoint changed or truncated while it was being read: {} (SIGBUS reading byte ",
        model.display()
    );
    assert!(err.starts_with(&head), "{err}");
    assert!(
        err.ends_with(
            ": the file is shorter than when it was opened, or its device failed; nothing was \
             published; re-run once it is stable)\n"
        ),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // Left: the lock file (the reference backend writes no mapping file; the checkpoint's
    // truncation is caught as its fingerprint is read).
    assert_eq!(names(&out), vec![".petite.lock".to_string()]);

    restore(&model, &bytes, t);
    ok(export_cmd(&c, &out).output().unwrap());
    assert_eq!(outputs(&out), want);
    assert!(
        !names(&out).iter().any(|n| n.contains("petite-tmp")),
        "{:?}",
        names(&out)
    );
}

#[test]
fn partial_pte_damaged_after_a_kill_is_named_and_its_segments_rewritten() {
    let s = Scratch::new("damaged-partial");
    let c = copy_case("two_cams_mqa", &s.0);
    let want = clean(&c, &s.0.join("clean"));
    let out = s.0.join("out");
    // Killed after the first engine is written into the partial prefix.pte and journaled.
    let mut child = spawn_stopped(&mut export_cmd(&c, &out), "engine:prefix:0");
    child.kill().unwrap();
    child.wait().unwrap();
    let partial = std::fs::read_dir(out.join("engines"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".pte.partial"))
        .expect("the partial prefix.pte stays for the re-run");
    truncate(&partial, 4096);
    // The re-run finds the journaled segment's bytes gone and writes it again.
    let o = ok(export_cmd(&c, &out).output().unwrap());
    let err = stderr(&o);
    assert!(
        err.starts_with(&format!(
            "petite: partial .pte {} is damaged (segment ",
            partial.display()
        )) && err.ends_with(" differs from its journal entry); rebuilding it\n"),
        "{err}"
    );
    assert_eq!(report(&out)["engines"]["reused"], 0);
    assert_eq!(outputs(&out), want);
    assert!(!out.join("engines").exists());
}

#[test]
fn checkpoint_changed_between_stages_is_refused_before_publishing() {
    let s = Scratch::new("identity");
    let c = copy_case("two_cams_mqa", &s.0);
    let model = c.join("model.safetensors");
    let (bytes, t) = (std::fs::read(&model).unwrap(), mtime(&model));
    let want = clean(&c, &s.0.join("clean"));
    let out = s.0.join("out");
    let child = spawn_stopped(&mut export_cmd(&c, &out), "engine:prefix:0");
    // Rewritten in place, same size and bytes, later modification time.
    restore(&model, &bytes, t + Duration::from_secs(10));
    let o = resume(child);
    let err = failed_as_changed(&o);
    assert!(
        err.contains(&format!(
            "checkpoint changed or truncated while it was being read: {} (modified in place \
             (same size, new modification time)); nothing built from it was published; re-run \
             once it is stable",
            model.display()
        )),
        "{err}"
    );
    for f in ["prefix.pte", "step.pte", "report.json"] {
        assert!(!out.join(f).exists(), "{f}");
    }
    assert!(
        !names(&out).iter().any(|n| n.contains("petite-tmp")),
        "{:?}",
        names(&out)
    );
    // Back to the original identity: the engines written before the change (the whole partial
    // prefix.pte, kept unrenamed when the check before its rename failed) are reused.
    restore(&model, &bytes, t);
    ok(export_cmd(&c, &out).output().unwrap());
    let r = report(&out);
    let prefix_engines = r["programs"]["prefix"]["engines"].as_array().unwrap().len();
    assert!(prefix_engines >= 2);
    assert_eq!(r["engines"]["reused"], prefix_engines, "{}", r["engines"]);
    assert_eq!(outputs(&out), want);
}

#[test]
fn a_second_export_into_the_same_directory_fails_at_once_and_the_first_is_unharmed() {
    let s = Scratch::new("lock");
    let c = copy_case("two_cams_mqa", &s.0);
    let want = clean(&c, &s.0.join("clean"));
    let out = s.0.join("out");
    let first = spawn_stopped(&mut export_cmd(&c, &out), "engine:prefix:1");
    let before = listing(&out);
    let t0 = Instant::now();
    let o = export_cmd(&c, &out).output().unwrap();
    let took = t0.elapsed();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}: another petite process (pid {}) is writing into this output directory; wait \
             for it to finish or choose another --out (lock: {}/.petite.lock, released when \
             that process ends)",
            out.display(),
            first.id(),
            out.display()
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert_eq!(
        listing(&out),
        before,
        "the second export touched the first's files"
    );
    let o = resume(first);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(outputs(&out), want);

    // A lock left by a killed export does not block: the kernel drops a dead holder's flock.
    let out2 = s.0.join("out2");
    let mut killed = spawn_stopped(&mut export_cmd(&c, &out2), "engine:prefix:1");
    killed.kill().unwrap(); // SIGKILL ends a stopped process too
    killed.wait().unwrap();
    assert!(out2.join(".petite.lock").exists());
    ok(export_cmd(&c, &out2).output().unwrap());
    assert!(report(&out2)["engines"]["reused"].as_u64().unwrap() >= 2);
    assert_eq!(outputs(&out2), want);
}

/// `cmd` with every file it writes limited to `bytes` (RLIMIT_FSIZE; SIGXFSZ ignored, so a
/// write past it fails with EFBIG where a full disk fails with ENOSPC).
fn with_file_limit(cmd: &mut Command, bytes: u64) -> &mut Command {
    // SAFETY: runs in the child between fork and exec, calling only async-signal-safe
    // functions (signal, setrlimit) with a live local.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: libc::RLIM_INFINITY,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

#[test]
fn disk_full_at_each_stage_names_the_file_leaves_no_final_file_and_the_rerun_finishes() {
    let s = Scratch::new("fsize");
    let c = copy_case("two_cams_mqa", &s.0);
    let want = clean(&c, &s.0.join("clean"));
    // 64 KiB: the partial prefix.pte (~360 KiB, engines written into it) fails in its first
    // engines; 256 KiB: in its last ones. The re-run resumes it.
    for (limit, file_part) in [
        (64 << 10, "/engines/prefix-"),
        (256 << 10, "/engines/prefix-"),
    ] {
        let out = s.0.join(format!("out-{limit}"));
        let o = with_file_limit(&mut export_cmd(&c, &out), limit)
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("{}{file_part}", out.display())),
            "{limit}: {err}"
        );
        assert!(err.contains("File too large (os error 27)"), "{err}");
        for f in ["prefix.pte", "step.pte", "report.json"] {
            assert!(!out.join(f).exists(), "{limit}: {f}");
        }
        assert!(
            !names(&out).iter().any(|n| n.contains("petite-tmp")),
            "{limit}: {:?}",
            names(&out)
        );
        ok(export_cmd(&c, &out).output().unwrap());
        assert_eq!(outputs(&out), want, "{limit}");
    }
}

/// Unmounts on drop.
struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Needs root and the right to mount a tmpfs, so it is not part of `cargo test`; `cargo xtask
/// ci` runs it as its own step (`cargo test -p petite --test faults -- --ignored`), where it
/// fails, never passes silently, when it cannot mount.
#[test]
#[ignore = "needs root to mount a tmpfs; run by `cargo xtask ci` (cargo test -p petite --test faults -- --ignored)"]
fn a_real_full_disk_says_no_space_and_the_rerun_after_freeing_space_finishes() {
    let s = Scratch::new("enospc");
    let c = copy_case("two_cams_mqa", &s.0);
    let want = clean(&c, &s.0.join("clean"));
    let mnt = s.0.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "mounting a small tmpfs needs root: run this test as root"
    );
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=300k", "tmpfs"])
        .arg(&mnt)
        .status();
    assert!(
        st.as_ref().is_ok_and(|s| s.success()),
        "cannot mount a tmpfs at {} ({st:?}): this test needs CAP_SYS_ADMIN",
        mnt.display()
    );
    let _m = Mount(mnt.clone());
    let out = mnt.join("out");
    let o = export_cmd(&c, &out).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("No space left on device (os error 28)"),
        "{err}"
    );
    assert!(err.contains(&out.display().to_string()), "{err}");
    for f in ["prefix.pte", "step.pte", "report.json"] {
        assert!(!out.join(f).exists(), "{f}");
    }
    assert!(
        !names(&out).iter().any(|n| n.contains("petite-tmp")),
        "{:?}",
        names(&out)
    );
    // Space freed: the same run finishes with the same bytes.
    let st = Command::new("mount")
        .args(["-o", "remount,size=64m"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success());
    ok(export_cmd(&c, &out).output().unwrap());
    assert_eq!(outputs(&out), want);
}

#[test]
fn damaged_cache_files_are_rebuilt_with_a_notice_never_trusted() {
    let s = Scratch::new("damaged");
    let c = copy_case("two_cams_mqa", &s.0);
    let want = clean(&c, &s.0.join("clean"));
    let out = s.0.join("out");
    ok(export_cmd(&c, &out).arg("--keep-engines").output().unwrap());
    let engine = out
        .join("engines")
        .join(
            report(&out)["programs"]["prefix"]["engines"][1]["name"]
                .as_str()
                .unwrap(),
        )
        .with_extension("ref.safetensors");
    let rerun = || ok(export_cmd(&c, &out).arg("--keep-engines").output().unwrap());
    type Damage = fn(&Path, &[u8]) -> (Vec<u8>, String);
    let damages: [(&str, Damage); 4] = [
        ("truncated", |_, b| {
            (
                b[..b.len() / 2].to_vec(),
                format!("{} bytes, sealed at {}", b.len() / 2, b.len()),
            )
        }),
        ("wrong size", |_, b| {
            let mut v = b.to_vec();
            v.extend_from_slice(&[0; 100]);
            (v, format!("{} bytes, sealed at {}", b.len() + 100, b.len()))
        }),
        ("corrupted header", |_, b| {
            let mut v = b.to_vec();
            v[9] ^= 0x20; // inside the JSON header
            (v, "its SHA-256 differs from its seal".into())
        }),
        ("a flipped data byte", |_, b| {
            let mut v = b.to_vec();
            let i = v.len() - 7;
            v[i] ^= 1;
            (v, "its SHA-256 differs from its seal".into())
        }),
    ];
    // (The reference backend writes no mapping file; its engine files are the cache.)
    for (what, file) in [("engine file", &engine)] {
        for (how, damage) in &damages {
            let good = std::fs::read(file).unwrap();
            let (bad, why) = damage(file, &good);
            std::fs::write(file, &bad).unwrap();
            let o = rerun();
            assert_eq!(
                stderr(&o),
                format!(
                    "petite: {what} {} is damaged ({why}); rebuilding it\n",
                    file.display()
                ),
                "{what}, {how}"
            );
            assert_eq!(report(&out)["engines"]["built"], 1, "{how}");
            assert_eq!(std::fs::read(file).unwrap(), good, "{what}, {how}: rebuilt");
            assert_eq!(outputs(&out), want, "{what}, {how}");
        }
    }
    // A cache file without a seal (an older petite, or a copy) is not trusted either.
    std::fs::remove_file(petite_weights::seal::sidecar(&engine)).unwrap();
    let o = rerun();
    assert!(
        stderr(&o).starts_with(&format!(
            "petite: engine file {} is damaged (no seal (",
            engine.display()
        )),
        "{}",
        stderr(&o)
    );
    assert_eq!(outputs(&out), want);

    // A damaged .pte from an earlier run is removed as soon as a run starts in the directory,
    // even one that then fails (here: the disk fills while writing the partial prefix.pte).
    let good_step = std::fs::read(out.join("step.pte")).unwrap();
    let pte = std::fs::read(out.join("prefix.pte")).unwrap();
    std::fs::write(out.join("prefix.pte"), &pte[..pte.len() / 3]).unwrap();
    let o = with_file_limit(&mut export_cmd(&c, &out), 64 << 10)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(&format!(
            "petite: {}: left by an earlier run and refused by the .pte verifier (",
            out.join("prefix.pte").display()
        )),
        "{err}"
    );
    assert!(err.contains("); removed it\n"), "{err}");
    assert!(!out.join("prefix.pte").exists());
    assert_eq!(std::fs::read(out.join("step.pte")).unwrap(), good_step);
}

/// `cmd` run as an unprivileged user when this test runs as root (permission bits bind only
/// non-root users), else unchanged.
fn unprivileged(cmd: &mut Command) -> &mut Command {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // std drops root's supplementary groups (setgroups) before switching to these.
        cmd.uid(65534).gid(65534);
    }
    cmd
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn unreadable_and_unwritable_paths_are_named_and_nothing_is_published() {
    let s = Scratch::new("perm");
    chmod(&s.0, 0o777);
    let c = copy_case("two_cams_mqa", &s.0);
    chmod(&c, 0o755);
    let model = c.join("model.safetensors");

    // Unreadable checkpoint: refused before the output directory exists.
    chmod(&model, 0o000);
    let out = s.0.join("out-a");
    let o = unprivileged(&mut export_cmd(&c, &out)).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}: open: Permission denied (os error 13)",
            model.display()
        )),
        "{err}"
    );
    assert!(!out.exists());
    chmod(&model, 0o644);

    // An output directory that cannot be written.
    let out = s.0.join("out-b");
    std::fs::create_dir(&out).unwrap();
    chmod(&out, 0o555);
    let o = unprivileged(&mut export_cmd(&c, &out)).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}: write into output directory: Permission denied (os error 13)",
            out.display()
        )),
        "{err}"
    );
    assert_eq!(names(&out), Vec::<String>::new());

    // An engines directory that cannot be written: named at the partial prefix.pte, nothing
    // published.
    let out = s.0.join("out-c");
    std::fs::create_dir_all(out.join("engines")).unwrap();
    chmod(&out, 0o777);
    chmod(&out.join("engines"), 0o555);
    let o = unprivileged(&mut export_cmd(&c, &out)).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{}/prefix-", out.join("engines").display()))
            && err.contains(".pte.partial: open: Permission denied (os error 13)"),
        "{err}"
    );
    for f in ["prefix.pte", "step.pte", "report.json"] {
        assert!(!out.join(f).exists(), "{f}");
    }
}

#[test]
fn convert_and_verify_turn_a_truncated_input_into_a_clear_error() {
    let s = Scratch::new("cli");
    let c = copy_case("two_cams_mqa", &s.0);
    let model = c.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();

    // petite convert: the source truncated while it is converted.
    let out = s.0.join("bf16.safetensors");
    let child = spawn_stopped(
        petite()
            .arg("convert")
            .arg("--checkpoint")
            .arg(&model)
            .arg("--out")
            .arg(&out),
        "convert-cli",
    );
    truncate(&model, 4096);
    let o = resume(child);
    let err = failed_as_changed(&o);
    assert!(
        err.starts_with(&format!(
            "petite: error: checkpoint changed or truncated while it was being read: {} (SIGBUS",
            model.display()
        )),
        "{err}"
    );
    assert!(!out.exists());
    std::fs::write(&model, &bytes).unwrap();
    ok(petite()
        .arg("convert")
        .arg("--checkpoint")
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap());
    assert!(!s.0.join("bf16.safetensors.petite-tmp").exists());

    // petite verify: prefix.pte truncated while its engines run from its mapping.
    let dir = s.0.join("export");
    ok(export_cmd(&c, &dir).output().unwrap());
    let prefix = dir.join("prefix.pte");
    let good = std::fs::read(&prefix).unwrap();
    let child = spawn_stopped(&mut common::verify_cmd(&c, &dir), "verify");
    truncate(&prefix, 4096);
    let o = resume(child);
    let err = failed_as_changed(&o);
    assert!(
        err.contains(&format!(
            ".pte program changed or truncated while it was being read: {} (",
            prefix.display()
        )),
        "{err}"
    );
    std::fs::write(&prefix, &good).unwrap();
    ok(common::verify_cmd(&c, &dir).output().unwrap());
}
