//! One query's share of the node's query memory.
//!
//! Every query gets its own [`QueryPool`] over the node's one pool (a `FairSpillPool`):
//! a reservation must fit both the query's cap and the node's, so a single query cannot
//! take everything, and many queries together cannot take more than the node allows.
//! Operators that can spill (sorts, joins, aggregates) do so when refused; others fail
//! the query with a resources-exhausted error.
//!
//! DataFusion has node pools and per-consumer tracking but no per-query cap on a shared
//! pool, hence this small wrapper.
//!
//! A distributed statement runs as several tasks on each member (one per stage), each with
//! its own session; [`StatementPools`] gives every task of one statement on a member the
//! same pool, so that the cap holds for the statement there, as it does on one node.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation};

#[derive(Debug)]
pub struct QueryPool {
    node: Arc<dyn MemoryPool>,
    limit: usize,
    used: AtomicUsize,
}

impl QueryPool {
    pub fn new(node: Arc<dyn MemoryPool>, limit: usize) -> QueryPool {
        QueryPool { node, limit, used: AtomicUsize::new(0) }
    }
}

impl std::fmt::Display for QueryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "query pool ({} of {} bytes) over {}", self.used.load(Ordering::Relaxed), self.limit, self.node)
    }
}

impl MemoryPool for QueryPool {
    fn name(&self) -> &str {
        "shoal-query"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.node.register(consumer);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.node.unregister(consumer);
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.node.grow(reservation, additional);
        self.used.fetch_add(additional, Ordering::AcqRel);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.node.shrink(reservation, shrink);
        self.used.fetch_sub(shrink, Ordering::AcqRel);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            if used.saturating_add(additional) > self.limit {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "{} wants {additional} more bytes; the query has used {used} of its {} bytes",
                    reservation.consumer().name(),
                    self.limit
                )));
            }
            match self.used.compare_exchange_weak(used, used + additional, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        if let Err(e) = self.node.try_grow(reservation, additional) {
            self.used.fetch_sub(additional, Ordering::AcqRel);
            return Err(e);
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.limit)
    }
}

/// The pools of the statements running on this node, by statement id, each shared by the
/// statement's tasks here and dropped with the last of them.
#[derive(Debug, Default)]
pub struct StatementPools {
    by_id: Mutex<HashMap<String, Weak<QueryPool>>>,
}

impl StatementPools {
    /// Statement `id`'s pool on this node: the one its other tasks here hold, or a new one
    /// capped at `limit` over `node`.
    pub fn pool(&self, id: &str, node: &Arc<dyn MemoryPool>, limit: usize) -> Arc<QueryPool> {
        let mut by_id = self.by_id.lock();
        if let Some(pool) = by_id.get(id).and_then(Weak::upgrade) {
            return pool;
        }
        // Statements that ended leave dead entries; they go as new ones come.
        by_id.retain(|_, p| p.strong_count() > 0);
        let pool = Arc::new(QueryPool::new(Arc::clone(node), limit));
        by_id.insert(id.to_string(), Arc::downgrade(&pool));
        pool
    }

    /// Registers the coordinator's own pool of statement `id`, so that the tasks it runs
    /// for itself share it.
    pub fn adopt(&self, id: &str, pool: &Arc<QueryPool>) {
        let mut by_id = self.by_id.lock();
        by_id.retain(|_, p| p.strong_count() > 0);
        by_id.insert(id.to_string(), Arc::downgrade(pool));
    }

    /// Statements with a live pool here.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.by_id.lock().values().filter(|p| p.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::GreedyMemoryPool;

    #[test]
    fn the_tasks_of_one_statement_share_its_cap_on_a_member() {
        let node: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(10_000));
        let pools = StatementPools::default();
        let (t1, t2) = (pools.pool("s1", &node, 600), pools.pool("s1", &node, 600));
        assert!(Arc::ptr_eq(&t1, &t2), "two tasks of one statement, one pool");
        let other = pools.pool("s2", &node, 600);
        assert!(!Arc::ptr_eq(&t1, &other));
        let (d1, d2): (Arc<dyn MemoryPool>, Arc<dyn MemoryPool>) = (t1.clone(), t2.clone());
        let r1 = MemoryConsumer::new("join").register(&d1);
        let r2 = MemoryConsumer::new("aggregate").register(&d2);
        r1.try_grow(400).unwrap();
        assert!(r2.try_grow(300).is_err(), "the second task is held to what the first left of the cap");
        r2.try_grow(200).unwrap();
        drop((r1, r2, d1, d2, t1, t2));
        assert_eq!(pools.live(), 1, "a statement's pool goes with its last task");
        // The coordinator's own pool is shared by the tasks it runs for itself.
        let mine = Arc::new(QueryPool::new(Arc::clone(&node), 600));
        pools.adopt("s3", &mine);
        assert!(Arc::ptr_eq(&pools.pool("s3", &node, 600), &mine));
        drop(other);
        drop(mine);
        assert_eq!(pools.live(), 0);
    }

    #[test]
    fn a_query_is_held_to_its_cap_and_the_node_to_its_own() {
        let node: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(1000));
        let a: Arc<dyn MemoryPool> = Arc::new(QueryPool::new(Arc::clone(&node), 600));
        let b: Arc<dyn MemoryPool> = Arc::new(QueryPool::new(Arc::clone(&node), 600));
        let ra = MemoryConsumer::new("a").register(&a);
        let rb = MemoryConsumer::new("b").register(&b);
        ra.try_grow(500).unwrap();
        assert!(ra.try_grow(200).is_err(), "over the query's cap");
        assert_eq!(a.reserved(), 500);
        rb.try_grow(400).unwrap();
        assert!(rb.try_grow(150).is_err(), "over the node's cap though within the query's");
        assert_eq!((b.reserved(), node.reserved()), (400, 900));
        ra.shrink(300);
        rb.try_grow(150).unwrap();
        drop(ra);
        drop(rb);
        assert_eq!((a.reserved(), b.reserved(), node.reserved()), (0, 0, 0));
    }
}
