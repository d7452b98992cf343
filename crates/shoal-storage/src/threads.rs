//! Thread priorities: background work (copies, CPU-heavy request work) runs below the
//! threads that serve requests, so that the kernel gives the cores to requests first.

/// Lowers the calling thread's scheduling priority by `nice` (Linux: `setpriority` on the
/// thread id affects that thread only). Elsewhere, or if refused, the thread keeps its
/// priority. Hand-written: one libc call; a crate would wrap the same call.
pub fn lower_this_thread(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take no pointers and only affect this thread.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "could not lower a thread's priority");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}
