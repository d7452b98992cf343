//! The pool that runs CPU-heavy request work (parsing large documents, answering lookups
//! over them) away from the tokio threads that do network I/O for every client.
//!
//! Its threads run at a lower OS priority ([`CPU_POOL_NICE`]): when a flood of heavy
//! requests and a trickle of cheap ones compete for the cores, the kernel runs the I/O
//! threads (which answer the cheap requests inline) first, and the flood slows down instead
//! of its neighbours. With idle cores the pool runs at full speed; niceness only decides
//! who waits when there is contention.

use std::sync::Arc;

use shoal_storage::threads::lower_this_thread;

use crate::ApiError;

/// How much lower than the I/O threads the pool runs (Linux `nice` units; CFS gives a
/// nice-10 thread about a tenth of a nice-0 thread's share when both want the core).
pub const CPU_POOL_NICE: i32 = 10;

#[derive(Clone)]
pub struct CpuPool {
    pool: Arc<rayon::ThreadPool>,
}

impl CpuPool {
    /// One thread per core, each lowered to [`CPU_POOL_NICE`].
    pub fn new() -> Result<CpuPool, std::io::Error> {
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("shoal-cpu-{i}"))
            .start_handler(|_| lower_this_thread(CPU_POOL_NICE))
            .build()
            .map_err(std::io::Error::other)?;
        Ok(CpuPool { pool: Arc::new(pool) })
    }

    /// Runs `work` on the pool and waits for it without blocking an I/O thread.
    pub async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.pool.spawn(move || {
            let _ = tx.send(work());
        });
        rx.await.map_err(|_| ApiError::internal("CPU worker failed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value of the calling thread, from `/proc/thread-self/stat` (field 19).
    #[cfg(target_os = "linux")]
    fn own_nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        // The command name (field 2) may hold spaces; fields after it are space-separated.
        let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        after_comm.split_whitespace().nth(16).and_then(|n| n.parse().ok()).unwrap_or(i32::MIN)
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn pool_threads_run_below_the_io_threads() {
        let pool = CpuPool::new().unwrap();
        let io_nice = own_nice();
        let pool_nice = pool.run(own_nice).await.unwrap();
        assert_eq!(pool_nice, (io_nice + CPU_POOL_NICE).min(19), "io threads at {io_nice}");
        let name = pool.run(|| std::thread::current().name().map(str::to_string)).await.unwrap();
        assert!(name.is_some_and(|n| n.starts_with("shoal-cpu-")));
    }
}
