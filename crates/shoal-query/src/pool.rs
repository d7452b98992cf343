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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::GreedyMemoryPool;

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
