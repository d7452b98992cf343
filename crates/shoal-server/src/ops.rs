//! Operations: health, node description, Prometheus metrics, and per-request telemetry.

use std::time::Instant;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::auth::Rule;
use crate::docs::json_response;
use crate::AppState;

/// Latency buckets in seconds: 50 µs to 10 s.
const LATENCY_BUCKETS_SECS: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Installs the process-wide Prometheus recorder once; later calls get the same handle.
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full("shoal_request_duration_seconds".into()), LATENCY_BUCKETS_SECS)
                .map(|b| b.build_recorder())
                .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics shows only storage gauges");
            }
            describe_metrics();
            handle
        })
        .clone()
}

/// Times and counts a request's `response` under its operation's name.
pub(crate) async fn timed(op: &'static str, response: impl std::future::Future<Output = Response>) -> Response {
    let start = Instant::now();
    let response = response.await;
    let status = status_class(response.status());
    metrics::histogram!("shoal_request_duration_seconds", "op" => op).record(start.elapsed().as_secs_f64());
    metrics::counter!("shoal_requests_total", "op" => op, "status" => status).increment(1);
    response
}

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

/// Every endpoint: method, route as registered in [`crate::router`], the operation name its
/// metrics carry (static strings keep the label set small; a request that matches no route
/// is `other`), and who may call it ([`Rule`]; the router refuses a route not here).
pub const ROUTES: &[(&str, &str, &str, Rule)] = &[
    ("GET", "/v1/health", "health", Rule::Open),
    ("GET", "/v1/node", "node", Rule::Monitor),
    ("GET", "/metrics", "metrics", Rule::Monitor),
    ("GET", "/v1/collections", "collection_list", Rule::User),
    ("PUT", "/v1/collections/{c}", "collection_create", Rule::ClusterAdmin),
    ("DELETE", "/v1/collections/{c}", "collection_drop", Rule::ClusterAdmin),
    ("GET", "/v1/collections/{c}/docs/{key}", "doc_get", Rule::ReadOrLock),
    ("PUT", "/v1/collections/{c}/docs/{key}", "doc_put", Rule::Write),
    ("DELETE", "/v1/collections/{c}/docs/{key}", "doc_remove", Rule::Write),
    ("POST", "/v1/collections/{c}/docs/{key}/touch", "doc_touch", Rule::Write),
    ("POST", "/v1/collections/{c}/docs/{key}/unlock", "doc_unlock", Rule::Write),
    ("POST", "/v1/collections/{c}/docs/{key}/lookup", "subdoc_lookup", Rule::Read),
    ("POST", "/v1/collections/{c}/docs/{key}/mutate", "subdoc_mutate", Rule::Write),
    ("POST", "/v1/collections/{c}/_get", "multi_get", Rule::Read),
    ("POST", "/v1/collections/{c}/_bulk", "bulk", Rule::Write),
    ("GET", "/v1/collections/{c}/changes", "changes", Rule::Read),
    ("GET", "/v1/collections/{c}/indexes", "index_list", Rule::Read),
    ("POST", "/v1/collections/{c}/indexes", "index_create", Rule::ClusterAdmin),
    ("POST", "/v1/collections/{c}/indexes/_build", "index_build_many", Rule::ClusterAdmin),
    ("DELETE", "/v1/collections/{c}/indexes/{name}", "index_drop", Rule::ClusterAdmin),
    ("POST", "/v1/collections/{c}/indexes/{name}/build", "index_build", Rule::ClusterAdmin),
    ("POST", "/v1/collections/{c}/indexes/{name}/scan", "index_scan", Rule::Read),
    ("POST", "/v1/query", "query", Rule::User),
    ("POST", "/v1/analytics", "analytics", Rule::User),
    ("POST", "/v1/_internal/{op}", "internal", Rule::Members),
    ("GET", "/v1/cluster", "cluster_info", Rule::Monitor),
    ("GET", "/v1/cluster/map", "cluster_map", Rule::User),
    ("PUT", "/v1/cluster/settings", "cluster_settings", Rule::ClusterAdmin),
    ("POST", "/v1/cluster/failover", "cluster_failover", Rule::ClusterAdmin),
    ("POST", "/v1/cluster/recover", "cluster_recover", Rule::ClusterAdmin),
    ("POST", "/v1/cluster/rebalance", "cluster_rebalance", Rule::ClusterAdmin),
    ("GET", "/v1/cluster/rebalance", "cluster_rebalance_status", Rule::Monitor),
    ("DELETE", "/v1/cluster/rebalance", "cluster_rebalance_stop", Rule::ClusterAdmin),
    ("GET", "/v1/whoami", "whoami", Rule::User),
    ("GET", "/v1/users", "user_list", Rule::ClusterAdmin),
    ("PUT", "/v1/users/{name}", "user_put", Rule::ClusterAdmin),
    ("DELETE", "/v1/users/{name}", "user_delete", Rule::ClusterAdmin),
    ("GET", "/v1/collections/{c}/docs/", "doc_get_empty_key", Rule::Read),
    ("PUT", "/v1/collections/{c}/docs/", "doc_put_empty_key", Rule::Write),
    ("DELETE", "/v1/collections/{c}/docs/", "doc_remove_empty_key", Rule::Write),
    ("POST", "/v1/cluster/nodes", "cluster_add_node", Rule::ClusterAdmin),
];

/// An endpoint of [`ROUTES`]: method, route, operation name, rule.
pub type Route = (&'static str, &'static str, &'static str, Rule);

/// The endpoint of `method` on the route a request matched (`None`: no route matched, or
/// the route has no such method).
pub(crate) fn route_of(method: &str, route: Option<&str>) -> Option<&'static Route> {
    let route = route?;
    ROUTES.iter().find(|(m, r, _, _)| *m == method && *r == route)
}

pub(crate) fn operation_name(method: &str, route: Option<&str>) -> &'static str {
    route_of(method, route).map_or("other", |(_, _, op, _)| op)
}

/// Help text of every metric the node exports (Prometheus' `# HELP` lines).
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!("shoal_requests_total", "HTTP requests answered, by operation and status class");
    describe_counter!("shoal_login_failures_total", "Requests refused for wrong or unknown credentials");
    describe_histogram!("shoal_request_duration_seconds", Unit::Seconds, "Time to answer an HTTP request, by operation");
    describe_counter!("shoal_subdoc_parsed_cache_total", "Sub-document requests by how the parsed-tree cache served them");
    describe_counter!("shoal_analytics_rebuilds_total", "Analytics partitions quarantined and rebuilt after their files failed a check");
    describe_counter!("shoal_analytics_changes_applied_total", "Changes the analytics shadows applied from the change streams");
    describe_counter!(
        "shoal_analytics_rows_adopted_total",
        "Analytics rows taken with partitions copied here by files, from the source's shadow (not rebuilt from the documents)"
    );
    describe_gauge!("shoal_analytics_tasks_running", "Shadow scans this node runs for distributed analytics statements");
    describe_counter!(
        "shoal_analytics_scanned_bytes_total",
        Unit::Bytes,
        "Bytes of column values this node's shadow scans produced (its own statements and its tasks of others')"
    );
    describe_counter!(
        "shoal_analytics_planned_early_total",
        "Distributed statements planned on their tables as last found, while the members were asked again: by whether the plan ran or the members' answers differed and it was planned again"
    );
    describe_histogram!(
        "shoal_analytics_lag_seconds",
        Unit::Seconds,
        "Age of the changes an analytics shadow applied, when it applied them"
    );
    describe_gauge!("shoal_documents", "Live documents, by collection");
    describe_gauge!("shoal_document_bytes", Unit::Bytes, "Bytes of live documents, by collection");
    describe_gauge!("shoal_changes", "Changes made to a collection so far: the sum of its partitions' high seqnos");
    describe_gauge!("shoal_disk_bytes", Unit::Bytes, "Bytes the storage engine holds on disk");
    describe_gauge!("shoal_analytics_rows", "Live rows of a collection's analytics shadow on this node (its active and replica copies)");
    describe_counter!("shoal_fsyncs_total", "Journal fsyncs done since the node started");
    describe_counter!("shoal_index_rebuilds_total", "Indexes rebuilt from the documents because their storage was found damaged");
    describe_gauge!(
        "shoal_index_memtable_bytes",
        Unit::Bytes,
        "Bytes of index entries in memory not yet flushed to the index tables (active and sealed memtables)"
    );
    describe_gauge!(
        "shoal_index_memtables_held_bytes",
        Unit::Bytes,
        "Bytes of index memtables in memory, flushed ones not yet let go of included"
    );
    describe_counter!(
        shoal_node::index_moves::PLACED_MISSING_REBUILDS_METRIC,
        "Index partitions placed on this node and found missing outside a rebalance, rebuilt from the change streams"
    );
    describe_gauge!("shoal_uptime_seconds", Unit::Seconds, "Seconds since the node started");
    describe_gauge!("shoal_storage_writable", "1 when the storage takes writes, 0 when it is full or failed");
    describe_gauge!("shoal_queries_running", "SQL statements running now, by path");
    describe_counter!("shoal_connections_refused_total", "Connections closed at once because the node was at its connection cap");
    describe_gauge!("shoal_connections", "Open client connections");
    describe_counter!(
        "shoal_tls_handshake_failures_total",
        "Connections to the TLS port that did not complete a handshake (plain HTTP, a certificate refused, garbage, too slow)"
    );
    describe_counter!("shoal_tls_reloads_total", "TLS files read again on SIGHUP, by outcome (ok, failed)");
    describe_counter!("shoal_requests_shed_total", "Requests refused because their class was at its concurrency limit, by class");
    describe_gauge!("shoal_partitions", "Partitions this node holds, by state (active, replica, pending, dead)");
    describe_gauge!("shoal_replication_lag_seqnos", "Changes of this node's active copies a replica has not acknowledged, by replica node");
    describe_gauge!(
        "shoal_replication_lag_seconds",
        Unit::Seconds,
        "How long a lagging replica has not acknowledged this node's changes, by replica node (0 when caught up)"
    );
    describe_gauge!(
        "shoal_partitions_retired",
        "Copies this node handed over and retired (never served again) whose data it has not discarded yet"
    );
    describe_gauge!("shoal_cluster_map_version", "The partition map version this node has applied");
    describe_counter!(
        "shoal_replica_rollbacks_total",
        "Replica copies on this node rolled back to follow an active's history (after a failover; never in a rebalance)"
    );
    describe_counter!("shoal_failovers_total", "Failovers this node ran as metadata leader, by kind (auto, manual, any)");
}

/// The node's real state: whether storage takes writes, and how the index and analytics
/// maintainers are doing. 503 when the node cannot serve writes (disk full, read-only).
pub async fn health(State(state): State<AppState>) -> Response {
    let storage = state.engine.store().health();
    let tasks = |r: shoal_storage::TaskReport| serde_json::json!({"maintainers": r.running, "failing": r.failing, "errors": r.errors, "last_error": r.last_error.as_deref().map(crate::error::public_reason)});
    let (indexes, analytics) = (state.engine.indexes().health.report(), state.engine.shadows().health.report());
    let degraded = indexes.failing || analytics.failing;
    let status = match (storage.writable(), degraded) {
        (false, _) => "unavailable",
        (true, true) => "degraded",
        (true, false) => "ok",
    };
    let mut storage_json = serde_json::json!({"state": storage.as_str(), "writable": storage.writable()});
    match &storage {
        shoal_storage::StorageState::Ok => {}
        shoal_storage::StorageState::DiskFull { path, free_bytes, poisoned } => {
            let then = if *poisoned { "; the node restarts once space is freed" } else { "" };
            storage_json["reason"] = format!("data path {} has {free_bytes} bytes free, below the reserve{then}", path + 1).into();
        }
        shoal_storage::StorageState::Restart => {
            storage_json["reason"] = "restarting to reopen the storage engine after a full disk".into();
        }
        shoal_storage::StorageState::Failed { reason } => storage_json["reason"] = crate::error::public_reason(reason).into(),
    }
    let body = serde_json::json!({
        "status": status,
        "storage": storage_json,
        "indexes": tasks(indexes),
        "analytics": tasks(analytics),
    });
    let code = if storage.writable() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json_response(code, body.to_string().into_bytes())
}

pub async fn node(State(state): State<AppState>) -> Response {
    let store = state.engine.store();
    let body = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "partitions": store.partitions(),
        "data_paths": store.data_paths().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "analytics_partitions": state.engine.shadows().partitions(),
        "uptime_secs": state.started.elapsed().as_secs(),
        "recovered_unclean": store.recovered_unclean(),
        "collections": store.list_collections().len(),
        "memory": memory(),
    });
    json_response(StatusCode::OK, body.to_string().into_bytes())
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    let store = state.engine.store();
    for c in store.list_collections() {
        metrics::gauge!("shoal_documents", "collection" => c.name.clone()).set(c.docs as f64);
        metrics::gauge!("shoal_document_bytes", "collection" => c.name.clone()).set(c.bytes as f64);
        if let Some(coll) = store.collection(&c.name) {
            let high: u64 = coll.high_seqnos().iter().sum();
            metrics::gauge!("shoal_changes", "collection" => c.name.clone()).set(high as f64);
            if let Some(shadow) = state.engine.shadows().shadow(coll.id()) {
                metrics::gauge!("shoal_analytics_rows", "collection" => c.name.clone()).set(shadow.rows() as f64);
            }
        }
    }
    metrics::gauge!("shoal_disk_bytes").set(store.disk_bytes() as f64);
    metrics::counter!("shoal_fsyncs_total").absolute(store.fsync_count());
    let indexes = state.engine.indexes();
    metrics::gauge!("shoal_index_memtable_bytes").set(indexes.memtable_bytes() as f64);
    metrics::gauge!("shoal_index_memtables_held_bytes").set(indexes.memtables_held_bytes() as f64);
    metrics::gauge!("shoal_storage_writable").set(if store.health().writable() { 1.0 } else { 0.0 });
    metrics::gauge!("shoal_uptime_seconds").set(state.started.elapsed().as_secs_f64());
    let cluster = state.cluster.stats();
    for (partition_state, n) in cluster.partitions {
        metrics::gauge!("shoal_partitions", "state" => partition_state).set(n as f64);
    }
    for lag in cluster.replicas {
        let replica = lag.replica.to_string();
        metrics::gauge!("shoal_replication_lag_seqnos", "replica" => replica.clone()).set(lag.seqnos as f64);
        metrics::gauge!("shoal_replication_lag_seconds", "replica" => replica).set(lag.seconds);
    }
    metrics::gauge!("shoal_cluster_map_version").set(cluster.map_version as f64);
    metrics::gauge!("shoal_partitions_retired").set(cluster.retired as f64);
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

/// The process's resident and peak resident memory, from /proc (Linux); nulls elsewhere.
fn memory() -> serde_json::Value {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    serde_json::json!({"rss_bytes": field("VmRSS:"), "peak_rss_bytes": field("VmHWM:")})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_has_its_own_operation_name() {
        let mut names: Vec<&str> = ROUTES.iter().map(|r| r.2).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "operation names repeat");
        assert!(!names.contains(&"other"));
        assert_eq!(operation_name("POST", Some("/v1/query")), "query");
        assert_eq!(operation_name("GET", Some("/v1/query")), "other");
        assert_eq!(operation_name("GET", None), "other");
    }
}
