//! Real mounts in temporary directories, driven through std::fs, child processes and
//! fjall. Needs root and /dev/fuse.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use shoal_faultfs::{FaultFs, FaultFsOptions, MountedFaultFs, PAGE_SIZE};

const PAGE: usize = PAGE_SIZE as usize;

/// A mount in a fresh temporary directory. Field order matters: the mount goes before
/// its directory.
struct Fixture {
    fs: MountedFaultFs,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with(FaultFsOptions::default())
    }

    fn with(options: FaultFsOptions) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::mount(dir.path(), options).unwrap();
        Fixture { fs, _dir: dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.fs.mountpoint().join(name)
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn write_synced(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

fn is_mounted(path: &Path) -> bool {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
    let path = path.to_str().unwrap();
    mounts.lines().any(|l| l.split(' ').nth(1) == Some(path))
}

struct Statvfs {
    blocks: u64,
    bfree: u64,
    bavail: u64,
    bsize: u64,
}

fn statvfs(path: &Path) -> Statvfs {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0, "{}", std::io::Error::last_os_error());
    Statvfs { blocks: st.f_blocks, bfree: st.f_bfree, bavail: st.f_bavail, bsize: st.f_frsize }
}

fn fallocate(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset as libc::off_t, len as libc::off_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn mount_is_listed_and_drop_unmounts() {
    let dir = tempfile::tempdir().unwrap();
    let canonical = dir.path().canonicalize().unwrap();
    let fs = FaultFs::mount(dir.path(), FaultFsOptions::default()).unwrap();
    assert!(is_mounted(&canonical));
    fs::write(canonical.join("a"), b"x").unwrap();
    drop(fs);
    assert!(!is_mounted(&canonical));
    assert!(!canonical.join("a").exists(), "the directory's own contents show again");
}

#[test]
fn panic_unwinding_unmounts() {
    let dir = tempfile::tempdir().unwrap();
    let canonical = dir.path().canonicalize().unwrap();
    let result = std::panic::catch_unwind(|| {
        let _fs = FaultFs::mount(&canonical, FaultFsOptions::default()).unwrap();
        assert!(is_mounted(&canonical));
        panic!("test failure inside a mount");
    });
    assert!(result.is_err());
    assert!(!is_mounted(&canonical));
}

#[test]
fn explicit_unmount_reports_success() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::mount(dir.path(), FaultFsOptions::default()).unwrap();
    let path = fs.mountpoint().to_owned();
    fs.unmount().unwrap();
    assert!(!is_mounted(&path));
}

#[test]
fn fsynced_data_survives_power_cut() {
    let fx = Fixture::new();
    let data = pattern(3 * PAGE + 123, 1);
    write_synced(&fx.path("a"), &data);
    assert_eq!(fx.fs.unsynced_bytes(), 0);
    assert!(fx.fs.fsyncs() >= 1);
    let report = fx.fs.power_cut();
    assert_eq!(report.files, 0);
    assert_eq!(fs::read(fx.path("a")).unwrap(), data);
}

#[test]
fn unsynced_new_file_loses_its_content_but_not_its_name() {
    let fx = Fixture::new();
    fs::write(fx.path("new"), pattern(10_000, 2)).unwrap();
    assert_eq!(fx.fs.unsynced_bytes(), 3 * PAGE_SIZE);
    let report = fx.fs.power_cut();
    assert_eq!((report.files, report.pages), (1, 3));
    assert_eq!(fs::metadata(fx.path("new")).unwrap().len(), 0);
    assert_eq!(fs::read(fx.path("new")).unwrap(), b"");
    assert_eq!(fx.fs.used_bytes(), 0);
}

#[test]
fn unsynced_overwrite_append_and_truncate_are_reverted() {
    let fx = Fixture::new();
    let data = pattern(4 * PAGE + 100, 3);
    for name in ["overwritten", "appended", "truncated", "extended"] {
        write_synced(&fx.path(name), &data);
    }
    {
        let f = OpenOptions::new().write(true).open(fx.path("overwritten")).unwrap();
        f.write_all_at(&[0xee; 5000], PAGE as u64 + 7).unwrap();
        let mut f = OpenOptions::new().append(true).open(fx.path("appended")).unwrap();
        f.write_all(&pattern(3 * PAGE, 9)).unwrap();
        OpenOptions::new().write(true).open(fx.path("truncated")).unwrap().set_len(10).unwrap();
        OpenOptions::new().write(true).open(fx.path("extended")).unwrap().set_len(1 << 30).unwrap();
    }
    assert_ne!(fs::read(fx.path("overwritten")).unwrap(), data);
    assert_eq!(fs::metadata(fx.path("truncated")).unwrap().len(), 10);
    assert!(fx.fs.unsynced_bytes() > 0);

    let report = fx.fs.power_cut();
    assert_eq!(report.files, 4);
    for name in ["overwritten", "appended", "truncated", "extended"] {
        assert_eq!(fs::metadata(fx.path(name)).unwrap().len(), data.len() as u64, "{name}");
        assert!(fs::read(fx.path(name)).unwrap() == data, "{name} is back to its fsynced content");
    }
    assert_eq!(fx.fs.unsynced_bytes(), 0);
}

#[test]
fn only_writes_after_the_last_fsync_are_lost() {
    let fx = Fixture::new();
    let mut f = File::create(fx.path("log")).unwrap();
    f.write_all(b"one,").unwrap();
    f.sync_data().unwrap();
    f.write_all(b"two,").unwrap();
    f.sync_all().unwrap();
    f.write_all(b"three").unwrap();
    drop(f);
    fx.fs.power_cut();
    assert_eq!(fs::read(fx.path("log")).unwrap(), b"one,two,");
}

#[test]
fn o_sync_writes_are_durable() {
    use std::os::unix::fs::OpenOptionsExt;
    let fx = Fixture::new();
    let mut f = OpenOptions::new().create(true).truncate(true).write(true).custom_flags(libc::O_DSYNC).open(fx.path("a")).unwrap();
    f.write_all(b"synchronous").unwrap();
    drop(f);
    fx.fs.power_cut();
    assert_eq!(fs::read(fx.path("a")).unwrap(), b"synchronous");
}

#[test]
fn open_file_sees_reverted_content_after_power_cut() {
    // Not the supported contract (stop processes first), but the invalidation must work.
    let fx = Fixture::new();
    let data = pattern(2 * PAGE, 4);
    write_synced(&fx.path("a"), &data);
    let mut f = OpenOptions::new().read(true).write(true).open(fx.path("a")).unwrap();
    let mut buf = vec![0; data.len()];
    f.read_exact(&mut buf).unwrap();
    f.write_all_at(&[1; 3 * PAGE], 0).unwrap();
    f.read_exact_at(&mut buf[..PAGE], 0).unwrap();
    assert_eq!(&buf[..PAGE], &[1; PAGE][..]);
    assert_eq!(f.metadata().unwrap().len(), 3 * PAGE_SIZE);
    fx.fs.power_cut();
    assert_eq!(f.metadata().unwrap().len(), data.len() as u64);
    let mut after = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut after).unwrap();
    assert!(after == data);
}

/// Free blocks once they reach `expected`, or what they are after the kernel's pending
/// releases have had ample time to arrive.
fn free_blocks_once_released(fx: &Fixture, expected: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let free = statvfs(fx.fs.mountpoint()).bfree;
        if free == expected || std::time::Instant::now() > deadline {
            return free;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn capacity_gives_enospc_and_statfs_tells_the_truth() {
    let fx = Fixture::with(FaultFsOptions::default().with_capacity(16 * PAGE_SIZE));
    let st = statvfs(fx.fs.mountpoint());
    assert_eq!((st.blocks, st.bfree, st.bavail, st.bsize), (16, 16, 16, PAGE_SIZE));

    fs::write(fx.path("a"), pattern(8 * PAGE, 5)).unwrap();
    let st = statvfs(fx.fs.mountpoint());
    assert_eq!((st.blocks, st.bfree, st.bavail), (16, 8, 8));
    assert_eq!(fx.fs.used_bytes(), 8 * PAGE_SIZE);

    let err = fs::write(fx.path("b"), pattern(9 * PAGE, 6)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");

    let f = OpenOptions::new().create(true).truncate(true).write(true).open(fx.path("c")).unwrap();
    assert_eq!(fallocate(&f, 0, 9 * PAGE_SIZE).unwrap_err().raw_os_error(), Some(libc::ENOSPC));
    fallocate(&f, 0, 8 * PAGE_SIZE).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 8 * PAGE_SIZE);
    assert_eq!(statvfs(fx.fs.mountpoint()).bfree, 0);
    // Extending with set_len is sparse: no space needed.
    f.set_len(1 << 30).unwrap();
    // Overwriting allocated pages needs no space either.
    f.write_all_at(b"inside", 100).unwrap();
    assert_eq!(f.write_all_at(b"x", 20 * PAGE_SIZE).unwrap_err().raw_os_error(), Some(libc::ENOSPC));
    drop(f);

    fs::remove_file(fx.path("a")).unwrap();
    // The kernel sends a closed file's release after close(2) returns, so the unlinked
    // file's pages are freed when that release arrives, which may come after the unlink.
    assert_eq!(free_blocks_once_released(&fx, 8), 8);
    fx.fs.set_capacity(32 * PAGE_SIZE);
    assert_eq!(statvfs(fx.fs.mountpoint()).blocks, 32);
    assert_eq!(fx.fs.capacity(), 32 * PAGE_SIZE);
    assert!(fx.fs.stats().enospc_errors >= 3);
}

#[test]
fn failing_fsync_reports_eio_and_keeps_data_undurable() {
    let fx = Fixture::new();
    write_synced(&fx.path("a"), b"durable");
    fx.fs.fail_fsync(true);
    let mut f = OpenOptions::new().write(true).truncate(true).open(fx.path("a")).unwrap();
    f.write_all(b"never durable").unwrap();
    assert_eq!(f.sync_all().unwrap_err().raw_os_error(), Some(libc::EIO));
    assert_eq!(f.sync_data().unwrap_err().raw_os_error(), Some(libc::EIO));
    let dir = File::open(fx.fs.mountpoint()).unwrap();
    assert_eq!(dir.sync_all().unwrap_err().raw_os_error(), Some(libc::EIO));
    drop((f, dir));
    assert_eq!(fx.fs.stats().failed_fsyncs, 3);
    assert_eq!(fs::read(fx.path("a")).unwrap(), b"never durable");
    fx.fs.power_cut();
    assert_eq!(fs::read(fx.path("a")).unwrap(), b"durable");

    fx.fs.fail_fsync(false);
    write_synced(&fx.path("a"), b"durable again");
    File::open(fx.fs.mountpoint()).unwrap().sync_all().unwrap();
    fx.fs.power_cut();
    assert_eq!(fs::read(fx.path("a")).unwrap(), b"durable again");
    assert_eq!(fx.fs.stats().dir_fsyncs, 1);
}

#[test]
fn failing_writes_report_eio() {
    let fx = Fixture::new();
    fs::write(fx.path("a"), b"before").unwrap();
    fx.fs.fail_writes(true);
    let err = fs::write(fx.path("a"), b"after").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    fx.fs.fail_writes(false);
    assert!(fx.fs.stats().failed_writes >= 1);
    fs::write(fx.path("a"), b"after").unwrap();
    assert_eq!(fs::read(fx.path("a")).unwrap(), b"after");
}

#[test]
fn namespace_operations() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.path("d/e/f")).unwrap();
    fs::write(fx.path("d/one"), b"1").unwrap();
    fs::write(fx.path("d/two"), b"2").unwrap();
    fs::write(fx.path("d/e/three"), b"3").unwrap();

    let mut names: Vec<_> = fs::read_dir(fx.path("d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, ["e", "one", "two"]);
    assert!(fs::read_dir(fx.path("d")).unwrap().any(|e| e.unwrap().file_type().unwrap().is_dir()));

    assert_eq!(fs::copy(fx.path("d/one"), fx.path("d/copy")).unwrap(), 1);
    assert_eq!(fs::read(fx.path("d/copy")).unwrap(), b"1");
    fs::remove_file(fx.path("d/copy")).unwrap();
    fs::rename(fx.path("d/one"), fx.path("d/e/moved")).unwrap();
    assert_eq!(fs::read(fx.path("d/e/moved")).unwrap(), b"1");
    assert!(!fx.path("d/one").exists());
    fs::rename(fx.path("d/two"), fx.path("d/e/three")).unwrap();
    assert_eq!(fs::read(fx.path("d/e/three")).unwrap(), b"2");
    fs::rename(fx.path("d/e"), fx.path("top")).unwrap();
    assert_eq!(fs::read(fx.path("top/three")).unwrap(), b"2");
    assert_eq!(fs::rename(fx.path("top"), fx.path("top/f/inside")).unwrap_err().raw_os_error(), Some(libc::EINVAL));

    assert_eq!(fs::remove_dir(fx.path("top")).unwrap_err().kind(), ErrorKind::DirectoryNotEmpty);
    fs::remove_file(fx.path("top/moved")).unwrap();
    assert_eq!(fs::read(fx.path("top/moved")).unwrap_err().kind(), ErrorKind::NotFound);

    // Many entries, deleted while listed (remove_dir_all does that).
    for i in 0..300 {
        fs::write(fx.path(&format!("top/f/file-{i:03}")), b"x").unwrap();
    }
    assert_eq!(fs::read_dir(fx.path("top/f")).unwrap().count(), 300);
    fs::remove_dir_all(fx.path("top")).unwrap();
    assert!(!fx.path("top").exists());
    let mut left: Vec<_> = fs::read_dir(fx.fs.mountpoint()).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["d"]);
    assert_eq!(fs::read_dir(fx.path("d")).unwrap().count(), 0);

    // Names survive a power cut without any fsync (metadata is not simulated).
    fs::write(fx.path("d/kept"), b"content").unwrap();
    fx.fs.power_cut();
    assert_eq!(fs::metadata(fx.path("d/kept")).unwrap().len(), 0);
}

#[test]
fn other_processes_can_use_the_mount() {
    let fx = Fixture::new();
    let out = Command::new("sh")
        .arg("-c")
        .arg("echo x > f && mkdir d && mv f d/g && cat d/g && ls -a d")
        .current_dir(fx.fs.mountpoint())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "x\n.\n..\ng\n");
    assert_eq!(fs::read(fx.path("d/g")).unwrap(), b"x\n");

    let out = Command::new("sh").arg("-c").arg("df -k . | tail -1").current_dir(fx.fs.mountpoint()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    fx.fs.power_cut();
    assert_eq!(fs::read(fx.path("d/g")).unwrap(), b"");
}

#[test]
fn exclusive_flock_is_exclusive() {
    let fx = Fixture::new();
    let first = File::create(fx.path("LOCK")).unwrap();
    first.try_lock().unwrap();
    let second = OpenOptions::new().read(true).write(true).open(fx.path("LOCK")).unwrap();
    assert!(matches!(second.try_lock(), Err(fs::TryLockError::WouldBlock)));
    // Another process too.
    let status = Command::new("sh")
        .arg("-c")
        .arg("command -v flock >/dev/null || exit 2; flock -n LOCK true")
        .current_dir(fx.fs.mountpoint())
        .status()
        .unwrap();
    assert!(matches!(status.code(), Some(1) | Some(2)), "{status:?}");
    first.unlock().unwrap();
    second.try_lock().unwrap();
}

#[test]
fn mmap_reads_see_file_content() {
    let fx = Fixture::new();
    let data = pattern(3 * PAGE + 17, 7);
    write_synced(&fx.path("m"), &data);
    let f = File::open(fx.path("m")).unwrap();
    let len = data.len();
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    assert_ne!(ptr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    let mapped = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }.to_vec();
    assert_eq!(unsafe { libc::munmap(ptr, len) }, 0);
    assert!(mapped == data);
}

// ---- fjall on the mount ----

/// Set (to a database path) only in the child process the fjall tests start.
const FJALL_CHILD_ENV: &str = "SHOAL_FAULTFS_FJALL_CHILD_DB";
const KEYSPACE: &str = "docs";

/// The child process: writes one key with an fsync and one that only reaches the OS,
/// then dies without any cleanup, as a process killed at that moment would.
#[test]
#[ignore = "started by the fjall tests as a child process"]
fn fjall_child_writer() {
    let Some(path) = std::env::var_os(FJALL_CHILD_ENV) else { return };
    let db = fjall::Database::builder(&path).open().unwrap();
    let ks = db.keyspace(KEYSPACE, fjall::KeyspaceCreateOptions::default).unwrap();
    ks.insert("persisted", "yes").unwrap();
    db.persist(fjall::PersistMode::SyncAll).unwrap();
    ks.insert("buffered", "only in the OS").unwrap();
    db.persist(fjall::PersistMode::Buffer).unwrap();
    // SAFETY: ends the process at once; nothing runs after it.
    unsafe { libc::_exit(0) };
}

fn run_fjall_child(db: &Path) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fjall_child_writer", "--ignored", "--nocapture", "--test-threads=1"])
        .env(FJALL_CHILD_ENV, db)
        .output()
        .unwrap();
    assert!(out.status.success(), "child failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

fn read_fjall(db: &Path) -> (Option<String>, Option<String>) {
    let db = fjall::Database::builder(db).open().unwrap();
    let ks = db.keyspace(KEYSPACE, fjall::KeyspaceCreateOptions::default).unwrap();
    let get = |k: &str| ks.get(k).unwrap().map(|v| String::from_utf8(v.to_vec()).unwrap());
    (get("persisted"), get("buffered"))
}

#[test]
fn fjall_after_a_crash_without_power_cut_keeps_buffered_writes() {
    let fx = Fixture::new();
    let db = fx.path("db");
    run_fjall_child(&db);
    assert!(fx.fs.unsynced_bytes() > 0, "the buffered write reached the filesystem unsynced");
    let (persisted, buffered) = read_fjall(&db);
    assert_eq!(persisted.as_deref(), Some("yes"));
    assert_eq!(buffered.as_deref(), Some("only in the OS"));
}

#[test]
fn fjall_after_power_cut_keeps_persisted_and_loses_unpersisted_writes() {
    let fx = Fixture::new();
    let db = fx.path("db");
    run_fjall_child(&db);
    assert!(fx.fs.unsynced_bytes() > 0, "the buffered write reached the filesystem unsynced");
    let report = fx.fs.power_cut();
    assert!(report.pages > 0);
    let (persisted, buffered) = read_fjall(&db);
    assert_eq!(persisted.as_deref(), Some("yes"));
    assert_eq!(buffered, None);
    // And the database works on after recovery.
    {
        let db = fjall::Database::builder(&db).open().unwrap();
        let ks = db.keyspace(KEYSPACE, fjall::KeyspaceCreateOptions::default).unwrap();
        ks.insert("after", "recovery").unwrap();
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    fx.fs.power_cut();
    let db = fjall::Database::builder(&db).open().unwrap();
    let ks = db.keyspace(KEYSPACE, fjall::KeyspaceCreateOptions::default).unwrap();
    assert!(ks.get("after").unwrap().is_some());
}
