//! mount(2) and umount2(2) done directly, without `fusermount`: this crate runs as root
//! in tests, and the machines it runs on have `/dev/fuse` but no fusermount binary.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::FaultFsError;

/// The FUSE device the kernel talks through.
const DEV_FUSE: &str = "/dev/fuse";

/// What `/proc/mounts` shows as the mount's source.
const SOURCE: &std::ffi::CStr = c"shoal-faultfs";

/// The filesystem type: FUSE with a subtype, so `mount` lists it as `fuse.shoal-faultfs`.
const FSTYPE: &std::ffi::CStr = c"fuse.shoal-faultfs";

/// A live mount: unmounting is explicit (`unmount`), so the owner decides when.
#[derive(Debug)]
pub(crate) struct RawMount {
    mountpoint: CString,
}

/// Opens `/dev/fuse` and mounts it at `mountpoint` (a canonical directory path). Returns
/// the device for the FUSE session and the mount.
pub(crate) fn mount(mountpoint: &Path) -> Result<(OwnedFd, RawMount), FaultFsError> {
    let path = CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| FaultFsError::BadMountpoint { path: mountpoint.to_owned(), reason: "contains a NUL byte" })?;
    // std opens with O_CLOEXEC: children spawned by the test must not inherit the device.
    let dev = OpenOptions::new().read(true).write(true).open(DEV_FUSE).map_err(|source| FaultFsError::OpenDevice { source })?;
    let fd: OwnedFd = dev.into();
    // SAFETY: getuid and getgid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // rootmode: the root is a directory (S_IFDIR, in octal). allow_other: processes of any
    // user may use the mount (the server under test may drop privileges).
    // default_permissions: the kernel checks modes itself.
    let options =
        format!("fd={},rootmode={:o},user_id={uid},group_id={gid},allow_other,default_permissions", fd.as_raw_fd(), libc::S_IFDIR);
    let options =
        CString::new(options).map_err(|_| FaultFsError::BadMountpoint { path: mountpoint.to_owned(), reason: "bad mount options" })?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            SOURCE.as_ptr(),
            path.as_ptr(),
            FSTYPE.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            options.as_ptr().cast::<libc::c_void>(),
        )
    };
    if rc != 0 {
        return Err(FaultFsError::Mount { path: mountpoint.to_owned(), source: io::Error::last_os_error() });
    }
    Ok((fd, RawMount { mountpoint: path }))
}

impl RawMount {
    /// Detaches the mount (MNT_DETACH): it disappears from the tree at once, even while a
    /// process still has files open in it; the kernel finishes once they are closed.
    pub(crate) fn unmount(&self) -> io::Result<()> {
        // SAFETY: the path is a NUL-terminated string that outlives the call.
        let rc = unsafe { libc::umount2(self.mountpoint.as_ptr(), libc::MNT_DETACH) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        // EINVAL: not a mount point any more (someone ran `umount -l` already).
        if err.raw_os_error() == Some(libc::EINVAL) {
            Ok(())
        } else {
            Err(err)
        }
    }
}
