//! Where statements run, and how they stop.
//!
//! A statement's operators are CPU-bound Rust futures. Run on the node's runtime, a heavy
//! one (a cross join) held its I/O threads: `/v1/health`, `/metrics` and the calls between
//! members went unanswered for tens of seconds (seen on 3 nodes sharing 2 cores), long
//! enough for a member to be failed over, and a client that went away could not be noticed.
//! So statements — the coordinator's part and the tasks a member runs for others — run on
//! their own runtime ([`query_handle`]), one thread per core, each a little below the I/O
//! threads' priority ([`QUERY_NICE`]).
//!
//! A statement whose client goes away is dropped, and with it (DataFusion's spawned tasks
//! abort on drop, datafusion-distributed's streams end) every task of it on every member —
//! but a task stops only where it yields, and an operator that makes many batches from
//! what it holds (a cross join) never waits on its input. [`YieldingJoins`] wraps every
//! join's output in DataFusion's `CooperativeExec`, which spends the task's tokio budget per
//! batch, so that such a task yields (and can be stopped) every 128 batches.

use std::sync::{Arc, OnceLock};

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::Result;
use datafusion::config::ConfigOptions;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::joins::{CrossJoinExec, HashJoinExec, NestedLoopJoinExec, SortMergeJoinExec, SymmetricHashJoinExec};
use datafusion::physical_plan::ExecutionPlan;

/// How much lower than the I/O threads statements run (Linux `nice` units): when a heavy
/// statement and requests compete for the cores, the kernel runs the requests first.
pub const QUERY_NICE: i32 = 5;

/// Where statements run: the query runtime (built on first use; one thread per core), or,
/// if its threads could not be started, the caller's runtime (logged once).
pub fn query_handle() -> tokio::runtime::Handle {
    static RUNTIME: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("shoal-query")
            .on_thread_start(|| shoal_storage::threads::lower_this_thread(QUERY_NICE))
            .enable_all()
            .build()
            .map_err(|e| tracing::error!(error = %e, "cannot start the query runtime; statements run on the node's"))
            .ok()
    });
    match runtime {
        Some(rt) => rt.handle().clone(),
        None => tokio::runtime::Handle::current(),
    }
}

/// Spawns `future` so that an idle worker of the current runtime starts it now, not once
/// the spawning task yields.
///
/// tokio puts a task spawned from one of its workers in that worker's next-task slot, which
/// no other worker takes from: the task waits until its spawner yields. A statement's
/// planning does not yield for milliseconds, and the small tables it asks the members for
/// while it plans ([`crate::gather`]) waited for it to end. A second, empty task spawned
/// after moves the first to the worker's queue, and tokio wakes an idle worker to take it.
pub fn spawn_started<F>(future: F) -> AbortOnDrop<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let task = AbortOnDrop(tokio::spawn(future));
    drop(tokio::spawn(async {}));
    task
}

/// A spawned task aborted when its handle is dropped (its caller went away): a statement,
/// or a call made for one.
pub struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    pub async fn join(mut self) -> Result<T, tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Wraps every join's output in `CooperativeExec` (see the module doc).
#[derive(Debug, Default)]
pub struct YieldingJoins;

fn is_join(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<CrossJoinExec>().is_some()
        || plan.downcast_ref::<NestedLoopJoinExec>().is_some()
        || plan.downcast_ref::<HashJoinExec>().is_some()
        || plan.downcast_ref::<SortMergeJoinExec>().is_some()
        || plan.downcast_ref::<SymmetricHashJoinExec>().is_some()
}

impl PhysicalOptimizerRule for YieldingJoins {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|p| {
            Ok(match is_join(&p) {
                true => Transformed::yes(Arc::new(CooperativeExec::new(p)) as Arc<dyn ExecutionPlan>),
                false => Transformed::no(p),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "yielding_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    #[test]
    fn a_task_spawned_by_one_that_holds_its_worker_starts_on_another() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        rt.block_on(async {
            tokio::spawn(async {
                let started = Arc::new(AtomicBool::new(false));
                let flag = Arc::clone(&started);
                let task = spawn_started(async move { flag.store(true, Ordering::SeqCst) });
                // The spawner holds its worker, as planning does, until the task has run (or
                // gives up: a task left in the spawner's next-task slot would not run).
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !started.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert!(started.load(Ordering::SeqCst), "the task waited for its spawner to yield");
                task.join().await.unwrap();
            })
            .await
            .unwrap();
        });
    }

    #[tokio::test]
    async fn every_join_yields_through_a_cooperative_wrapper() {
        let state = datafusion::execution::SessionStateBuilder::new()
            .with_default_features()
            .with_physical_optimizer_rule(Arc::new(YieldingJoins))
            .build();
        let ctx = SessionContext::from(state);
        let df = ctx
            .sql("SELECT count(*) FROM (VALUES (1), (2)) a(x), (VALUES (3)) b(y), (VALUES (4)) c(z) WHERE a.x + b.y + c.z > 0")
            .await
            .unwrap();
        let plan = df.clone().create_physical_plan().await.unwrap();
        let text = datafusion::physical_plan::displayable(plan.as_ref()).indent(true).to_string();
        let joins = text.lines().filter(|l| l.contains("JoinExec")).count();
        let wrapped = text.lines().filter(|l| l.contains("CooperativeExec")).count();
        assert!(joins >= 2 && wrapped >= joins, "{text}");
        assert_eq!(df.collect().await.unwrap()[0].num_rows(), 1);
    }
}
