// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use std::path::Path;

pub const MAGIC_BYTES: &[u8] = &[b'F', b'J', b'L', 3];

pub const KEYSPACES_FOLDER: &str = "keyspaces";

pub const LOCK_FILE: &str = "lock";
pub const VERSION_MARKER: &str = "version";

pub const LSM_CURRENT_VERSION_MARKER: &str = "current";

/// SHOAL-PATCH: removes `folder` and everything in it, each folder listed whole before
/// anything in it is removed. `std::fs::remove_dir_all`, which unlinks while it lists, spun
/// without end in `getdents64` on the FUSE fault filesystem of Shoal's power-cut tests.
pub fn remove_folder(folder: &Path) -> std::io::Result<()> {
    remove_under(folder, true)
}

/// SHOAL-PATCH: removes every file in `folder` and its subfolders, keeping the folders;
/// listed as [`remove_folder`] lists.
pub fn remove_files(folder: &Path) -> std::io::Result<()> {
    remove_under(folder, false)
}

fn remove_under(folder: &Path, folders_too: bool) -> std::io::Result<()> {
    let entries = std::fs::read_dir(folder)?.collect::<std::io::Result<Vec<_>>>()?;
    for entry in entries {
        if entry.file_type()?.is_dir() {
            remove_under(&entry.path(), folders_too)?;
        } else {
            log::trace!("Removing {}", entry.path().display());
            std::fs::remove_file(entry.path())?;
        }
    }
    if folders_too {
        std::fs::remove_dir(folder)?;
    }
    Ok(())
}

#[cfg(not(target_os = "windows"))]
pub fn fsync_directory<P: AsRef<Path>>(path: P) -> std::io::Result<()> {
    let path = path.as_ref();

    let file = std::fs::File::open(path).inspect_err(|e| {
        log::error!("Failed to open directory at {}: {e:?}", path.display());
    })?;

    debug_assert!(file.metadata()?.is_dir());

    file.sync_all().inspect_err(|e| {
        log::error!("Failed to fsync directory at {}: {e:?}", path.display());
    })
}

#[cfg(target_os = "windows")]
pub fn fsync_directory<P: AsRef<Path>>(_path: P) -> std::io::Result<()> {
    // Cannot fsync directory on Windows
    Ok(())
}
