//! Thread priorities: background work (copies, CPU-heavy request work) runs below the
//! threads that serve requests, so that the kernel gives the cores to requests first.
//! Hand-written: two libc calls; a crate would wrap the same calls.

/// The nice value a thread takes where [`idle_this_thread`] cannot make it idle.
pub const IDLE_FALLBACK_NICE: i32 = 19;

/// Lowers the calling thread's scheduling priority by `nice` (Linux: `setpriority` on the
/// thread id affects that thread only). Elsewhere, or if refused, the thread keeps its
/// priority.
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

/// Runs the calling thread only on cores no other thread wants (Linux `SCHED_IDLE`): a
/// request thread that wakes takes the core from it at once, where a nice thread keeps the
/// core until its slice ends (during a partition copy on 2 shared cores the foreground's p99
/// was 8.0–10.5 ms with the copy threads at nice 10 and 5.2–6.9 ms at `SCHED_IDLE`, against
/// 1.1–1.8 ms before the copy). Where that is refused, the thread takes
/// [`IDLE_FALLBACK_NICE`].
pub fn idle_this_thread() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` outlives the call; pid 0 is the calling thread, and only its
        // scheduling policy changes.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        if rc == 0 {
            return;
        }
        tracing::debug!(error = %std::io::Error::last_os_error(), "could not make a thread idle; lowering its priority instead");
    }
    lower_this_thread(IDLE_FALLBACK_NICE);
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn an_idle_thread_is_idle_and_its_neighbours_are_not() {
        let policy = std::thread::spawn(|| {
            idle_this_thread();
            // SAFETY: no pointers; asks the calling thread's policy.
            unsafe { libc::sched_getscheduler(0) }
        })
        .join()
        .unwrap_or(-1);
        assert_eq!(policy, libc::SCHED_IDLE);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER, "only the thread that asked is idle");
    }
}
