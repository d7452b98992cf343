//! Per-class concurrency limits: a flood of one kind of request (sub-document lookups, SQL,
//! analytics, writes, index scans) cannot take every core and starve key/value reads.
//!
//! Each class has a number of requests that may run at once and a queue of those waiting
//! for a turn; a request that finds the queue full is refused at once with
//! `503 unavailable` (it costs the node nothing but the refusal). Key/value reads,
//! collection calls and operations endpoints are not limited: they are cheap and they are
//! what the limits protect.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// Requests of one class waiting for a turn, beyond which more are refused, per running slot.
pub const QUEUE_PER_SLOT: usize = 64;
/// Writes in flight per core. A write runs inline for microseconds, but a `persist` write
/// then holds its slot while it waits for the group fsync: the slots bound how many share
/// one fsync, so they must be many (at 16 per core, 32 writers per fsync capped `persist`
/// at about 8,000 writes/s here; bench/results, issue 12 write path).
pub const WRITE_SLOTS_PER_CORE: usize = 128;

/// The classes that are limited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Subdoc,
    Query,
    Analytics,
    Write,
    IndexScan,
}

impl Class {
    fn name(self) -> &'static str {
        match self {
            Class::Subdoc => "subdoc",
            Class::Query => "query",
            Class::Analytics => "analytics",
            Class::Write => "write",
            Class::IndexScan => "index_scan",
        }
    }

    /// The class of an operation name (see `ops::ROUTES`); `None` is not limited.
    pub fn of(op: &str) -> Option<Class> {
        Some(match op {
            "subdoc_lookup" | "subdoc_mutate" => Class::Subdoc,
            "query" => Class::Query,
            "analytics" => Class::Analytics,
            "doc_put" | "doc_remove" | "doc_touch" | "doc_unlock" | "bulk" => Class::Write,
            "index_scan" => Class::IndexScan,
            _ => return None,
        })
    }

    /// Requests of the class that run at once on a node with `cores` cores. Sub-document
    /// work is CPU on the low-priority pool, so a few per core keep it busy. This is a
    /// trade measured in bench/results/2026-11-23-issue11-speed.md: 2 per core holds a small
    /// get's p99 within 1.3–1.9× of its value alone during a HARD lookup flood but halves
    /// the flood's own rate; 16 per core gives the flood a third more and the gets 2.3–4.1×.
    /// SQL spreads
    /// over every core by itself; analytics even more so; writes mostly wait for the
    /// engine.
    fn slots(self, cores: usize) -> usize {
        match self {
            Class::Subdoc => 2 * cores,
            Class::Query => cores,
            Class::Analytics => 2,
            Class::Write => WRITE_SLOTS_PER_CORE * cores,
            Class::IndexScan => 2 * cores,
        }
    }
}

struct Gate {
    class: Class,
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue_max: usize,
}

/// The gates of every limited class.
#[derive(Clone)]
pub struct Limits {
    gates: Arc<Vec<Gate>>,
}

impl Limits {
    pub fn new(cores: usize) -> Limits {
        let cores = cores.max(1);
        let gates = [Class::Subdoc, Class::Query, Class::Analytics, Class::Write, Class::IndexScan]
            .into_iter()
            .map(|class| {
                let slots = class.slots(cores);
                Gate { class, running: Arc::new(Semaphore::new(slots)), waiting: AtomicUsize::new(0), queue_max: slots * QUEUE_PER_SLOT }
            })
            .collect();
        Limits { gates: Arc::new(gates) }
    }

    fn gate(&self, class: Class) -> Option<&Gate> {
        self.gates.iter().find(|g| g.class == class)
    }
}

/// Why a request got no turn.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// The class's queue is full.
    QueueFull,
    /// The gate is closed: the node is shutting down.
    Closed,
}

/// A place in a class's queue, given back however the wait ends: with a turn, refused, or
/// abandoned because the client went away and axum dropped the request's future.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    /// A turn of this class: at once when a slot is free, else after a wait in the queue,
    /// or refused when the queue is full.
    async fn admit(&self) -> Result<OwnedSemaphorePermit, Refused> {
        if let Ok(p) = Arc::clone(&self.running).try_acquire_owned() {
            return Ok(p);
        }
        let place = Waiting(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue_max {
            return Err(Refused::QueueFull);
        }
        let permit = Arc::clone(&self.running).acquire_owned().await.map_err(|_| Refused::Closed);
        drop(place);
        permit
    }
}

/// Waits for a turn of the request's class (or refuses it when too many wait), then runs it.
pub async fn limit(limits: axum::extract::State<Limits>, matched: Option<MatchedPath>, req: Request, next: Next) -> Response {
    let op = crate::ops::operation_name(req.method().as_str(), matched.as_ref().map(|m| m.as_str()));
    let Some(gate) = Class::of(op).and_then(|c| limits.gate(c)) else {
        return next.run(req).await;
    };
    let permit = match gate.admit().await {
        Ok(p) => p,
        Err(Refused::QueueFull) => {
            metrics::counter!("shoal_requests_shed_total", "class" => gate.class.name()).increment(1);
            return ApiError::unavailable(format!("too many {} requests at once; try again shortly", gate.class.name())).into_response();
        }
        Err(Refused::Closed) => return ApiError::unavailable("the node is shutting down").into_response(),
    };
    let response = next.run(req).await;
    drop(permit);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_heavy_operations_only() {
        for (_, _, op, _) in crate::ops::ROUTES {
            let class = Class::of(op);
            match *op {
                "doc_get" | "multi_get" | "health" | "metrics" | "node" | "changes" => assert_eq!(class, None, "{op}"),
                "subdoc_lookup" | "query" | "analytics" | "doc_put" | "bulk" | "index_scan" => assert!(class.is_some(), "{op}"),
                _ => {}
            }
        }
        let limits = Limits::new(2);
        assert_eq!(limits.gate(Class::Subdoc).map(|g| g.running.available_permits()), Some(4));
    }

    fn one_slot_gate(queue_max: usize) -> Gate {
        Gate { class: Class::Query, running: Arc::new(Semaphore::new(1)), waiting: AtomicUsize::new(0), queue_max }
    }

    /// A client that goes away while queued (axum drops its request's future) gives its place
    /// back: before, the count only came down once a turn came, so a burst of disconnects
    /// filled the queue for good and the class answered 503 for the rest of the node's life.
    #[tokio::test]
    async fn abandoned_waits_give_their_place_back() {
        let gate = one_slot_gate(4);
        let held = gate.admit().await.expect("a free slot");
        for _ in 0..100 {
            let wait = gate.admit();
            tokio::pin!(wait);
            assert!(futures::poll!(wait.as_mut()).is_pending(), "the only slot is held");
            assert_eq!(gate.waiting.load(Ordering::Acquire), 1);
        }
        assert_eq!(gate.waiting.load(Ordering::Acquire), 0, "every abandoned wait left the queue");
        drop(held);
        assert!(gate.admit().await.is_ok(), "the class still admits after 100 abandoned waits");
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_a_turn_frees_its_place() {
        let gate = one_slot_gate(1);
        let held = gate.admit().await.expect("a free slot");
        let first = gate.admit();
        tokio::pin!(first);
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert_eq!(gate.admit().await.err(), Some(Refused::QueueFull), "one waits, the queue holds one");
        assert_eq!(gate.waiting.load(Ordering::Acquire), 1, "the refusal gave its place back");
        drop(held);
        let turn = first.await.expect("the waiter gets the freed slot");
        assert_eq!(gate.waiting.load(Ordering::Acquire), 0);
        drop(turn);
        gate.running.close();
        assert_eq!(gate.admit().await.err(), Some(Refused::Closed), "a closed gate refuses");
        assert_eq!(gate.waiting.load(Ordering::Acquire), 0);
    }
}
