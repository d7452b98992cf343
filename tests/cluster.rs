//! A cluster of real `shoal` processes on loopback: joining, metadata through the log,
//! rebalance, replication with majority durability, forwarding, failover after `kill -9`,
//! recovery — and the calls that must be refused.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::cluster::{
    get_json, index_cluster, index_node_args, joined, member_states, node_id, rebalance, start_cluster, wait_for, IndexCluster, PARTITIONS,
    SECRET,
};
use common::Node;
use serde_json::{json, Value};

/// Majority write of `{"v": value}` to `key` through `node`; answers the status and body.
async fn put(http: &reqwest::Client, node: &Node, key: &str, value: i64, durability: &str) -> (u16, Value) {
    let r = http
        .put(node.u(&format!("/v1/collections/c/docs/{key}?durability={durability}")))
        .body(json!({"v": value}).to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A `_bulk` of NDJSON `lines` through `node` at `durability`: its answer's lines.
async fn bulk(http: &reqwest::Client, node: &Node, lines: &str, durability: &str) -> Vec<Value> {
    let r = http.post(node.u(&format!("/v1/collections/c/_bulk?durability={durability}"))).body(lines.to_string()).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_three_node_cluster_forms_replicates_fails_over_and_recovers() {
    let mut nodes = start_cluster(3, &[]);
    let http = common::client_builder().timeout(Duration::from_secs(30)).build().unwrap();
    let info = wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    let mut states = member_states(&info);
    states.sort();
    assert_eq!(states, ["active", "added", "added"], "joined nodes are added and hold nothing: {info}");
    let cluster_id = info["cluster_id"].as_str().unwrap().to_string();
    for n in &nodes[1..] {
        let (_, v) = get_json(&http, &n.u("/v1/cluster")).await;
        assert_eq!(v["cluster_id"], cluster_id, "every member answers for the same cluster");
    }

    // A collection created on one member exists on all.
    let r = http.put(nodes[2].u("/v1/collections/c")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 201);
    for n in &nodes {
        wait_for(&http, &n.u("/v1/collections"), "the collection everywhere", |v| {
            v.as_array().is_some_and(|a| a.iter().any(|c| c["name"] == "c"))
        })
        .await;
    }
    let r = http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 409, "a second create is refused cluster-wide");

    // Bring the added nodes in (asked of a member that is not the leader: it forwards).
    rebalance(&http, &nodes[1], &[]).await;
    let (_, map) = get_json(&http, &nodes[2].u("/v1/cluster/map")).await;
    let parts = map["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 16);
    let mut actives = std::collections::HashMap::new();
    for p in parts {
        let replicas = p["replicas"].as_array().unwrap();
        assert_eq!(replicas.len(), 1, "one replica per partition: {p}");
        assert_ne!(replicas[0], p["active"], "copies on distinct nodes: {p}");
        *actives.entry(p["active"].as_u64().unwrap()).or_insert(0) += 1;
    }
    assert_eq!(actives.len(), 3, "every node holds actives: {map}");

    // Majority writes through every node (forwarded to the active in one hop).
    const KEYS: i64 = 120;
    for i in 0..KEYS {
        let (status, body) = put(&http, &nodes[i as usize % 3], &format!("k{i}"), i, "majority").await;
        assert!(status == 200, "majority write k{i}: {status} {body}");
    }
    for n in &nodes {
        for i in (0..KEYS).step_by(7) {
            let (status, v) = get_json(&http, &n.u(&format!("/v1/collections/c/docs/k{i}?consistency=majority"))).await;
            assert_eq!((status, v["v"].as_i64()), (200, Some(i)), "majority read of k{i} through {}", n.url);
        }
    }
    // A `_bulk` at a majority level, through one member, over keys on every member: each
    // written line is confirmed by a majority, a failed condition is a confirmed observation.
    let lines: String = (0..KEYS)
        .map(|i| json!({"op": "upsert", "key": format!("b{i}"), "value": {"v": i}}).to_string() + "\n")
        .chain([json!({"op": "insert", "key": "k0", "value": {"v": -1}}).to_string() + "\n"])
        .collect();
    let answers = bulk(&http, &nodes[1], &lines, "majority").await;
    assert_eq!(answers.len(), KEYS as usize + 1);
    for a in &answers[..KEYS as usize] {
        assert!(a["token"]["seqno"].as_u64().is_some(), "a majority _bulk line: {a}");
    }
    assert_eq!(answers[KEYS as usize]["error"], "doc_exists", "{}", answers[KEYS as usize]);
    for i in (0..KEYS).step_by(11) {
        let (status, v) = get_json(&http, &nodes[2].u(&format!("/v1/collections/c/docs/b{i}?consistency=majority"))).await;
        assert_eq!((status, v["v"].as_i64()), (200, Some(i)), "b{i} after a majority _bulk");
    }
    // A smart client (routing itself) is told where a key lives instead of being forwarded.
    let first_id = get_json(&http, &nodes[0].u("/v1/cluster")).await.1["node"].as_u64();
    let misrouted = (0..KEYS)
        .map(|i| format!("k{i}"))
        .find(|k| parts[usize::from(shoal_storage::partition_of(k.as_bytes(), 16))]["active"].as_u64() != first_id)
        .unwrap();
    let r = http.get(nodes[0].u(&format!("/v1/collections/c/docs/{misrouted}"))).header("x-shoal-route", "direct").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 421);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "not_my_partition");
    assert!(body["map_version"].as_u64().is_some(), "{body}");
    // The header members mark a forwarded request with means nothing from a client: the
    // request is forwarded as any other (not refused, not held waiting for a map).
    for routed_by in [u64::MAX.to_string(), "not a version".to_string()] {
        let r = http
            .get(nodes[0].u(&format!("/v1/collections/c/docs/{misrouted}")))
            .header("x-shoal-forwarded", &routed_by)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "a client's x-shoal-forwarded {routed_by:?}");
    }

    // kill -9 a node that is not the metadata leader: it is failed over automatically.
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let leader = info["leader"].as_u64().unwrap();
    let victim = (0..3).find(|&i| node_id(&info, &nodes[i]) != Some(leader)).unwrap();
    let victim_id = node_id(&info, &nodes[victim]).unwrap();
    let survivor = (0..3).find(|&i| i != victim).unwrap();
    let killed_at = Instant::now();
    nodes[victim].kill9();
    wait_for(&http, &nodes[survivor].u("/v1/cluster"), "automatic failover", |v| {
        v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(victim_id) && n["state"] == "failed"))
    })
    .await;
    // Every acknowledged majority write is still there, through both survivors.
    let mut unavailable_for = Duration::ZERO;
    for n in (0..3).filter(|&i| i != victim) {
        for i in 0..KEYS {
            let url = nodes[n].u(&format!("/v1/collections/c/docs/k{i}"));
            let v = wait_for(&http, &url, "a key after failover", |v| v.get("v").is_some()).await;
            assert_eq!(v["v"].as_i64(), Some(i), "k{i} after failover");
        }
        unavailable_for = unavailable_for.max(killed_at.elapsed());
    }
    eprintln!("failover: every key readable {:.1} s after the kill -9 (auto-failover timeout 5 s)", unavailable_for.as_secs_f64());
    // With the failed copy's slot still counted, majority writes to partitions that lost a
    // copy are refused up front; none and persist writes work everywhere.
    let mut impossible = 0;
    for i in 0..KEYS {
        let (status, body) = put(&http, &nodes[survivor], &format!("k{i}"), i + 1000, "majority").await;
        match status {
            200 => {}
            503 if body["error"] == "durability_impossible" => impossible += 1,
            _ => panic!("majority write k{i} after failover: {status} {body}"),
        }
        let (status, body) = put(&http, &nodes[survivor], &format!("k{i}"), i + 2000, "persist").await;
        assert_eq!(status, 200, "persist write k{i} after failover: {body}");
    }
    assert!(impossible > 0, "some partitions lost a copy, and majority writes to them must say so");
    // The same for a `_bulk`: refused lines are written nowhere, the others are confirmed.
    let lines: String =
        (0..KEYS).map(|i| json!({"op": "upsert", "key": format!("k{i}"), "value": {"v": i + 4000}}).to_string() + "\n").collect();
    let answers = bulk(&http, &nodes[survivor], &lines, "majority").await;
    let mut refused = 0;
    for (i, a) in answers.iter().enumerate() {
        let want = if a["error"] == "durability_impossible" {
            refused += 1;
            i as i64 + 2000
        } else {
            assert!(a["token"]["seqno"].as_u64().is_some(), "a majority _bulk line after failover: {a}");
            i as i64 + 4000
        };
        let (status, v) = get_json(&http, &nodes[survivor].u(&format!("/v1/collections/c/docs/k{i}"))).await;
        assert_eq!((status, v["v"].as_i64()), (200, Some(want)), "k{i} after a majority _bulk: {a}");
    }
    assert_eq!(refused, impossible, "the _bulk refuses the partitions the single writes found short of a majority");

    // The node comes back: recovered and rebalanced in, it holds copies again and majority
    // writes work on every key.
    nodes[victim].restart();
    let r = http.post(nodes[survivor].u("/v1/cluster/recover")).json(&json!({"node": victim_id})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    rebalance(&http, &nodes[survivor], &[]).await;
    for i in 0..KEYS {
        let (status, body) = put(&http, &nodes[i as usize % 3], &format!("k{i}"), i + 3000, "majority").await;
        assert_eq!(status, 200, "majority write k{i} after recovery: {body}");
    }
    for n in &nodes {
        for i in (0..KEYS).step_by(5) {
            let (status, v) = get_json(&http, &n.u(&format!("/v1/collections/c/docs/k{i}?consistency=majority"))).await;
            assert_eq!((status, v["v"].as_i64()), (200, Some(i + 3000)), "k{i} through {} after recovery", n.url);
        }
    }
}

/// With two replicas and two collections, a replica can be ahead in one collection and
/// behind in the other, each holding `majority` writes the other lacks (two pulls read the
/// collections at different moments). A failover then promotes one and has it catch up
/// from the other first: nothing acknowledged is lost. The lag is made by the fault layer
/// ("hold"), which leaves one collection's replicated changes unapplied on a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoted_replica_first_catches_up_in_every_collection_from_the_others() {
    let mut nodes = start_cluster(3, &["--fault-injection"]);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    let r =
        http.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"replicas": 2, "auto_failover_timeout_s": 3600})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
    for c in ["x", "y"] {
        assert_eq!(http.put(nodes[0].u(&format!("/v1/collections/{c}"))).send().await.unwrap().status().as_u16(), 201);
    }
    rebalance(&http, &nodes[0], &[]).await;
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let leader = info["leader"].as_u64().unwrap();
    let victim = (0..3).find(|&i| node_id(&info, &nodes[i]) != Some(leader)).unwrap();
    let victim_id = node_id(&info, &nodes[victim]).unwrap();
    let (b, c) = match victim {
        0 => (1, 2),
        1 => (0, 2),
        _ => (0, 1),
    };
    let urls: Vec<String> = nodes.iter().map(|n| n.u("/v1/_internal/faults")).collect();
    let hold = |node: usize, collections: Vec<&'static str>| {
        let (http, url) = (http.clone(), urls[node].clone());
        async move {
            let r = http
                .post(url)
                .header("x-shoal-cluster-secret", SECRET)
                .json(&json!({"cut": [], "hold": collections}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap_or_default());
        }
    };
    // An unknown collection is a clear error.
    let r = http
        .post(nodes[b].u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", SECRET)
        .json(&json!({"cut": [], "hold": ["nope"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    // b applies x and not y, c applies y and not x: x's majority is the victim and b, y's
    // the victim and c.
    hold(b, vec!["y"]).await;
    hold(c, vec!["x"]).await;
    let (_, map) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let parts = map["partitions"].as_array().unwrap().clone();
    let on_victim = |k: &String| parts[usize::from(shoal_storage::partition_of(k.as_bytes(), 16))]["active"].as_u64() == Some(victim_id);
    let keys: Vec<String> = (0..400).map(|i| format!("k{i}")).filter(on_victim).take(30).collect();
    assert!(keys.len() >= 10, "keys on the victim's partitions: {}", keys.len());
    for (i, k) in keys.iter().enumerate() {
        for coll in ["x", "y"] {
            let r = http
                .put(nodes[victim].u(&format!("/v1/collections/{coll}/docs/{k}?durability=majority")))
                .body(json!({"v": i, "c": coll}).to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200, "majority write {coll}/{k}: {}", r.text().await.unwrap_or_default());
        }
    }
    // The victim dies; the lag is then released (nothing more can come from the victim).
    nodes[victim].kill9();
    hold(b, vec![]).await;
    hold(c, vec![]).await;
    let r = http.post(nodes[b].u("/v1/cluster/failover")).json(&json!({"node": victim_id})).send().await.unwrap();
    let status = r.status().as_u16();
    let report: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{report}");
    assert!(report["promoted"].as_u64().unwrap() > 0 && report["unavailable"].as_array().unwrap().is_empty(), "{report}");
    // Every acknowledged write of both collections, through both survivors.
    for n in [b, c] {
        for (i, k) in keys.iter().enumerate() {
            for coll in ["x", "y"] {
                let (status, v) = get_json(&http, &nodes[n].u(&format!("/v1/collections/{coll}/docs/{k}"))).await;
                assert_eq!(
                    (status, v["v"].as_u64(), v["c"].as_str()),
                    (200, Some(i as u64), Some(coll)),
                    "{coll}/{k} through {}: {v}",
                    nodes[n].url
                );
            }
        }
    }
}

#[tokio::test]
async fn wrong_secrets_and_bad_cluster_calls_are_refused() {
    let mut nodes = start_cluster(1, &[]);
    let first = &mut nodes[0];
    let http = common::client();
    wait_for(&http, &first.u("/v1/cluster"), "the founding node", |v| member_states(v) == ["active"]).await;

    // Calls between members need the secret.
    for secret in [None, Some("wrong-secret-123")] {
        let mut r = http.post(first.u("/v1/_internal/propose")).body("{}");
        if let Some(s) = secret {
            r = r.header("x-shoal-cluster-secret", s);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401);
        assert_eq!(r.json::<Value>().await.unwrap()["error"], "unauthorized");
    }
    // With it, a malformed message is a clear error, not a crash.
    // ("faults" is there only on nodes started with --fault-injection.)
    let names: Vec<String> = (0..=shoal_query::distributed::FIELDS_TABLES_MAX).map(|i| format!("c{i}")).collect();
    let many_collections = serde_json::json!({"collections": names, "map_version": 1, "request_plus": false, "timeout_ms": 10}).to_string();
    for (op, body) in [
        ("propose", "{"),
        ("pull", "\u{0}\u{1}garbage"),
        ("export", "\u{ff}garbage"),
        ("docs", "\u{ff}\u{ff}\u{ff}garbage"),
        ("catch-up", "{\"failed\": 1"),
        ("join", "[]"),
        ("nope", "{}"),
        ("raft-vote", "1"),
        ("faults", "{}"),
        ("feed", "\u{ff}\u{ff}garbage"),
        ("highs", "{\"collection\": 7}"),
        ("index-export", "{\"collection\": \"c\""),
        ("index-adopt", "[1, 2]"),
        ("index-prepare", "{\"collection\": \"c\", \"parts\": \"all\", \"applied\": 1}"),
        ("index-scan", "{\"collection\": \"c\", \"index\": \"i\", \"parts\": \"all\"}"),
        ("shadow-fields", "{\"collection\": 5}"),
        ("shadow-fields", "{\"collections\": [], \"map_version\": 1, \"request_plus\": false, \"timeout_ms\": 10}"),
        ("shadow-fields", many_collections.as_str()),
        ("shadow-rows", "\u{ff}\u{ff}garbage"),
        ("shadow-export", "\u{ff}\u{ff}garbage"),
        ("applied", "{\"index\": \"ten\"}"),
    ] {
        let r = http
            .post(first.u(&format!("/v1/_internal/{op}")))
            .header("x-shoal-cluster-secret", SECRET)
            .header("connection", "upgrade")
            .header("upgrade", "shoal-copy")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert!(status == 400 || status == 404, "{op}: {status} {v}");
        assert_eq!(v["error"], "bad_request", "{op}: {v}");
    }

    // An export answers only over a connection that switches to the copy protocol.
    // Postcard: `from` = 1 (a varint), the partition 0, `files` = true.
    let ask = vec![1u8, 0, 1];
    let r = http.post(first.u("/v1/_internal/export")).header("x-shoal-cluster-secret", SECRET).body(ask.clone()).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert!(status == 400 && v["reason"].as_str().is_some_and(|r| r.contains("Upgrade: shoal-copy")), "{status} {v}");
    // An export for a node the map does not name as a replica is refused, not streamed.
    let r = http
        .post(first.u("/v1/_internal/export"))
        .header("x-shoal-cluster-secret", SECRET)
        .header("connection", "upgrade")
        .header("upgrade", "shoal-copy")
        .body(ask)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409, "{}", r.text().await.unwrap_or_default());
    // So are a partition's analytics rows (a move's shadow export; postcard: `from` = 1,
    // partition 0).
    let r = http
        .post(first.u("/v1/_internal/shadow-export"))
        .header("x-shoal-cluster-secret", SECRET)
        .header("connection", "upgrade")
        .header("upgrade", "shoal-copy")
        .body(vec![1u8, 0])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409, "{}", r.text().await.unwrap_or_default());

    // A page of documents asked under another map version (SQL that ran across a map
    // change) is refused, not answered from the wrong partitions. Postcard: collection "c",
    // map_version 99, no `after`, max 10, no keys.
    let ask = vec![1u8, b'c', 99, 0, 10, 0];
    let r = http.post(first.u("/v1/_internal/docs")).header("x-shoal-cluster-secret", SECRET).body(ask).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    assert!(status == 409 && text.contains("map changed"), "{status} {text}");

    // An oversized call is refused before it is read whole: the pull, and the index
    // service's calls (feeds, highs, copies of index partitions, routed scans).
    let huge = bytes::Bytes::from(vec![b'x'; 64 * 1024 * 1024 + 1]);
    for op in std::iter::once("pull").chain(common::INTERNAL_BODY_CALLS) {
        let r = http.post(first.u(&format!("/v1/_internal/{op}"))).header("x-shoal-cluster-secret", SECRET).body(huge.clone()).send().await;
        if let Ok(r) = r {
            // (The node may close the connection before the client has sent everything.)
            assert_eq!(r.status().as_u16(), 413, "{op}");
        }
    }
    // The analytics workers' gRPC service (on the same port) takes calls from members
    // only; with the secret, garbage is a gRPC error, not a crash.
    let h2 = common::client_builder().http2_prior_knowledge().build().unwrap();
    for (secret, garbage) in
        [(None, vec![0u8, 0, 0, 0, 3, 1, 2, 3]), (Some(SECRET), vec![0u8, 0, 0, 0, 3, 1, 2, 3]), (Some(SECRET), b"nonsense".to_vec())]
    {
        let mut r = h2.post(first.u("/worker.WorkerService/CoordinatorChannel")).header("content-type", "application/grpc").body(garbage);
        if let Some(s) = secret {
            r = r.header("x-shoal-cluster-secret", s);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        let grpc = r.headers().get("grpc-status").map(|v| v.to_str().unwrap_or("").to_string());
        let _ = r.bytes().await;
        if secret.is_none() {
            assert_eq!(status, 401, "a worker call without the secret");
        } else {
            assert!(status != 500, "a garbage worker call: {status} {grpc:?}");
        }
    }
    // A message past WORKER_MESSAGE_MAX_BYTES is refused by the length in its frame's
    // header, before the node holds it: only the header and a few bytes are sent.
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(shoal_query::distributed::WORKER_MESSAGE_MAX_BYTES + 1).unwrap().to_be_bytes());
    frame.extend_from_slice(&[7u8; 16]);
    let r = h2
        .post(first.u("/worker.WorkerService/CoordinatorChannel"))
        .header("content-type", "application/grpc")
        .header("x-shoal-cluster-secret", SECRET)
        .body(frame)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let grpc = r.headers().get("grpc-status").map(|v| v.to_str().unwrap_or("").to_string());
    let message = r.headers().get("grpc-message").map(|v| v.to_str().unwrap_or("").to_string()).unwrap_or_default();
    let _ = r.bytes().await;
    assert_eq!(status, 200, "gRPC answers its errors in its status");
    let message = message.replace("%20", " ");
    assert!(grpc.as_deref().is_some_and(|g| g != "0") && message.contains("too large"), "an oversized worker message: {grpc:?} {message}");
    let (status, _) = get_json(&http, &first.u("/v1/cluster")).await;
    assert_eq!(status, 200, "the node still answers");
    // A key request's body is kept (to send again on a newer map) up to
    // FORWARD_BODY_MAX_BYTES: past it `413` before it is read whole; a document past
    // DOC_MAX_BYTES within that is the write path's `413`. Nothing is written.
    assert_eq!(http.put(first.u("/v1/collections/big")).send().await.unwrap().status(), 201);
    for len in [shoal_storage::DOC_MAX_BYTES + 1, shoal_server::routing::FORWARD_BODY_MAX_BYTES + 1] {
        let mut doc = vec![b' '; len];
        doc[0] = b'1';
        let r = http.put(first.u("/v1/collections/big/docs/k")).body(doc).send().await;
        if let Ok(r) = r {
            assert_eq!(r.status().as_u16(), 413, "{len} bytes");
        }
        let r = http.get(first.u("/v1/collections/big/docs/k")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404, "nothing written from {len} bytes");
    }

    // Settings out of range, unknown nodes, malformed bodies.
    let cases: &[(&str, &str, Value, u16, &str)] = &[
        ("PUT", "/v1/cluster/settings", json!({"replicas": 4}), 400, "bad_request"),
        ("PUT", "/v1/cluster/settings", json!({"auto_failover_timeout_s": 1}), 400, "bad_request"),
        ("PUT", "/v1/cluster/settings", json!({"bogus": 1}), 400, "bad_request"),
        ("POST", "/v1/cluster/failover", json!({"node": 12345}), 404, "node_not_found"),
        ("POST", "/v1/cluster/recover", json!({"node": 12345}), 404, "node_not_found"),
        ("POST", "/v1/cluster/failover", json!({"node": "x"}), 400, "bad_request"),
        ("POST", "/v1/cluster/rebalance", json!({"eject": [12345]}), 404, "node_not_found"),
        ("POST", "/v1/cluster/rebalance", json!({"eject": "all"}), 400, "bad_request"),
        ("DELETE", "/v1/cluster/rebalance", json!(null), 409, "bad_request"),
    ];
    for (method, path, body, status, code) in cases {
        let r = http.request(method.parse().unwrap(), first.u(path)).body(body.to_string()).send().await.unwrap();
        let got = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!((got, v["error"].as_str().unwrap_or("")), (*status, *code), "{method} {path} {body}: {v}");
    }
    // The last node cannot be failed over: it holds every copy.
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    let me = info["node"].as_u64().unwrap();
    let r = http.post(first.u("/v1/cluster/failover")).json(&json!({"node": me})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 409, "{}", r.text().await.unwrap_or_default());
    // Valid settings are applied and shown.
    let r = http.put(first.u("/v1/cluster/settings")).json(&json!({"replicas": 2, "auto_failover_timeout_s": 7})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    assert_eq!((info["replicas"].as_u64(), info["settings"]["auto_failover_timeout_s"].as_u64()), (Some(2), Some(7)));

    // A node with the wrong secret cannot join: it stops with a clear error.
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--partitions", PARTITIONS, "--analytics-partitions", "0"])
        .arg("--data-path")
        .arg(tmp.path().join("d"))
        .args(["--cluster-secret", "not-the-secret", "--join", &first.addr()])
        .env("SHOAL_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unauthorized"), "{stderr}");
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    assert_eq!(member_states(&info).len(), 1, "nothing was added: {info}");

    // A node whose data belongs to another cluster cannot be joined to this one.
    let mut other = Node::start(&["--cluster-secret", SECRET, "--partitions", PARTITIONS, "--analytics-partitions", "0"]);
    wait_for(&http, &other.u("/v1/cluster"), "another one-node cluster", |v| member_states(v) == ["active"]).await;
    other.stop();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--partitions", PARTITIONS, "--analytics-partitions", "0"])
        .arg("--data-path")
        .arg(&other.dir)
        .args(["--cluster-secret", SECRET, "--join", &first.addr()])
        .env("SHOAL_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("belongs to cluster"), "{stderr}");

    // The founding node restarts into the same cluster by itself.
    first.stop();
    first.restart();
    let info = wait_for(&http, &first.u("/v1/cluster"), "the restarted node", |v| member_states(v) == ["active"]).await;
    assert_eq!(info["node"].as_u64(), Some(me));
}

/// A member that cannot enter its cluster (restarted while the two other members of its
/// three-node cluster are down: no quorum, so no lease) waits `STARTUP_WAIT` for it and then
/// answers `503` saying why: never a hang, never an answer from a copy it may not serve.
/// (A two-node cluster serves on with one node by design: README, "Cluster".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_enter_its_cluster_says_so() {
    let mut nodes = start_cluster(3, &[]);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    // A key whose active copy is on the member that restarts.
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let (_, map) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let second = node_id(&info, &nodes[1]).expect("a member");
    let partitions = u16::try_from(map["partitions"].as_array().map_or(0, Vec::len)).unwrap();
    let key = (0..1000)
        .map(|i| format!("k{i}"))
        .find(|k| map["partitions"][usize::from(shoal_storage::partition_of(k.as_bytes(), partitions))]["active"].as_u64() == Some(second))
        .expect("the second member is active for some partition");
    let (status, body) = put(&http, &nodes[1], &key, 1, "persist").await;
    assert_eq!(status, 200, "{body}");
    nodes[0].kill9();
    nodes[2].kill9();
    nodes[1].kill9();
    nodes[1].restart();
    let url = nodes[1].u(&format!("/v1/collections/c/docs/{key}"));
    let r = http.get(&url).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let v: Value = r.json().await.unwrap();
    assert!(v["reason"].as_str().unwrap_or("").contains("still entering its cluster"), "{v}");
    // Its peer back, it serves what it had.
    nodes[0].restart();
    wait_for(&http, &url, "the document, once back in the cluster", |v| v["v"] == 1).await;
}

/// A node answers the first request after a restart (even one sent before it finished
/// entering its one-node cluster) instead of refusing it.
#[tokio::test]
async fn a_restarted_node_serves_its_first_request() {
    let mut node = Node::start(&["--partitions", PARTITIONS]);
    let http = common::client_builder().timeout(Duration::from_secs(30)).build().unwrap();
    assert_eq!(http.put(node.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    for round in 0..3 {
        let (status, body) = put(&http, &node, "k", round, "persist").await;
        assert_eq!(status, 200, "{body}");
        assert!(node.stop());
        node.restart();
        let r = http.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap();
        assert_eq!(r.status(), 200, "round {round}: {}", r.text().await.unwrap_or_default());
        assert_eq!(r.json::<Value>().await.unwrap()["v"], round);
    }
}

/// `_get`, `_bulk` and index scans asked of any member span the partitions of every
/// member: each key is read or written where its active copy is, and scans merge the
/// members' rows in index order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_key_requests_and_scans_span_the_members() {
    let nodes = start_cluster(3, &["--analytics-partitions", "2"]);
    let http = common::client_builder().timeout(Duration::from_secs(30)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    let r = http.post(nodes[1].u("/v1/collections/c/indexes")).json(&json!({"name": "by_n", "keys": ["n"]})).send().await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());

    // One _bulk through one member writes keys held by all three, answering in order.
    const KEYS: usize = 90;
    let mut body = String::new();
    for i in 0..KEYS {
        body.push_str(&json!({"op": "upsert", "key": format!("k{i:03}"), "value": {"n": i % 30, "i": i}}).to_string());
        body.push('\n');
        if i == 10 {
            body.push_str("{not json}\n");
        }
    }
    let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let lines: Vec<Value> = r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), KEYS + 1);
    assert_eq!(lines[11]["error"], "invalid_json", "the bad line keeps its place: {}", lines[11]);
    for (n, line) in lines.iter().enumerate().filter(|(n, _)| *n != 11) {
        let i = if n < 11 { n } else { n - 1 };
        assert_eq!(line["key"], format!("k{i:03}"), "{line}");
        assert!(line["cas"].is_string(), "k{i:03} written wherever its partition lives: {line}");
    }
    // The keys really are spread over the members.
    let (_, map) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let holders: std::collections::HashSet<u64> = (0..KEYS)
        .map(|i| map["partitions"][usize::from(shoal_storage::partition_of(format!("k{i:03}").as_bytes(), 16))]["active"].as_u64().unwrap())
        .collect();
    assert_eq!(holders.len(), 3, "the keys live on all three members");

    // One _get through another member reads them all, in the order asked.
    let mut keys: Vec<Value> = (0..KEYS).rev().map(|i| Value::from(format!("k{i:03}"))).collect();
    keys.push(Value::from("missing"));
    keys.push(Value::from(7));
    let r = http.post(nodes[2].u("/v1/collections/c/_get")).json(&json!({ "keys": keys })).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let docs: Value = r.json().await.unwrap();
    let docs = docs["docs"].as_array().unwrap();
    assert_eq!(docs.len(), KEYS + 2);
    for (d, i) in docs.iter().zip((0..KEYS).rev()) {
        assert_eq!((&d["key"], &d["value"]["i"]), (&Value::from(format!("k{i:03}")), &Value::from(i)), "{d}");
    }
    assert_eq!(docs[KEYS]["error"], "doc_not_found");
    assert_eq!(docs[KEYS + 1]["error"], "invalid_key");

    // Change feeds through any member cover every member's partitions.
    let feed = |node: &Node, query: String| {
        let (http, url) = (http.clone(), node.u(&format!("/v1/collections/c/changes?{query}")));
        async move {
            let r = http.get(url).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let lines: Vec<Value> = r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            let last = lines.last().and_then(|l| l["last"].as_str()).unwrap_or_else(|| panic!("no last token: {lines:?}")).to_string();
            let keys: Vec<String> = lines.iter().filter_map(|l| l["key"].as_str().map(str::to_string)).collect();
            assert!(lines.iter().all(|l| l.get("error").is_none()), "{lines:?}");
            (keys, last)
        }
    };
    let (mut keys, last) = feed(&nodes[1], String::new()).await;
    keys.sort();
    let every: Vec<String> = (0..KEYS).map(|i| format!("k{i:03}")).collect();
    assert_eq!(keys, every, "one normal feed lists every key once");
    // In pages of 7: every key once across the pages, none repeated.
    let (mut paged, mut since) = (Vec::new(), String::new());
    loop {
        let (keys, last) = feed(&nodes[2], format!("limit=7&since={since}")).await;
        assert!(keys.len() <= 7, "{keys:?}");
        if keys.is_empty() {
            break;
        }
        paged.extend(keys);
        since = last;
    }
    paged.sort();
    assert_eq!(paged, every, "paged feeds resume exactly where the cut was");
    // From the first feed's token: only what came after, whichever member is asked.
    for i in 0..5 {
        let (status, body) = put(&http, &nodes[i % 3], &format!("late{i}"), 1, "none").await;
        assert_eq!(status, 200, "{body}");
    }
    let (mut keys, last) = feed(&nodes[0], format!("since={last}")).await;
    keys.sort();
    assert_eq!(keys, ["late0", "late1", "late2", "late3", "late4"]);
    // A long poll from there waits for the next change, wherever it lands.
    let waiter = tokio::spawn(feed(&nodes[2], format!("feed=longpoll&timeout=20000&since={last}")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(put(&http, &nodes[0], "later", 1, "none").await.0, 200);
    let (keys, _) = waiter.await.unwrap();
    assert_eq!(keys, ["later"]);
    // A continuous feed cut by its limit.
    let (keys, _) = feed(&nodes[1], "feed=continuous&limit=3&timeout=20000".to_string()).await;
    assert_eq!(keys.len(), 3, "{keys:?}");

    // Scans through each member see every member's rows once, merged in index order.
    for node in &nodes {
        let scan = |body: Value| {
            let http = http.clone();
            let url = node.u("/v1/collections/c/indexes/by_n/scan");
            async move {
                let r = http.post(url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.json::<Value>().await.unwrap()["rows"].as_array().unwrap().clone()
            }
        };
        let all = scan(json!({"consistency": "request_plus"})).await;
        let got: Vec<(i64, String)> = all.iter().map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string())).collect();
        let mut want: Vec<(i64, String)> = (0..KEYS).map(|i| ((i % 30) as i64, format!("k{i:03}"))).collect();
        want.sort();
        assert_eq!(got, want, "every row once, in index order, through {}", node.url);
        let eq = scan(json!({"eq": [4], "include_docs": true, "consistency": "request_plus"})).await;
        let ids: Vec<&str> = eq.iter().map(|r| r["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["k004", "k034", "k064"]);
        assert!(eq.iter().all(|r| r["doc"]["n"] == 4), "{eq:?}");
        let top = scan(json!({"descending": true, "limit": 4, "consistency": "request_plus"})).await;
        let ids: Vec<&str> = top.iter().map(|r| r["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["k089", "k059", "k029", "k088"], "the limit applies to the merged rows");
    }

    // SQL through each member (each holds only some partitions active) reads every
    // member's partitions once: counts, sums, groups, key lookups and an indexed field.
    let sql = |node: &Node, statement: &str, consistency: &str| {
        let http = http.clone();
        let url = node.u("/v1/query");
        let body = json!({"sql": statement, "consistency": consistency});
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            let status = r.status();
            let v: Value = r.json().await.unwrap();
            assert_eq!(status, 200, "{v}");
            v["rows"].as_array().unwrap().clone()
        }
    };
    let sum: usize = (0..KEYS).sum();
    for node in &nodes {
        for consistency in ["not_bounded", "request_plus"] {
            let rows = sql(node, "SELECT count(*), sum(i) FROM c WHERE meta_id LIKE 'k%'", consistency).await;
            assert_eq!(rows, vec![json!([KEYS, sum])], "every document once through {}", node.url);
        }
        let rows = sql(node, "SELECT count(*) FROM c", "not_bounded").await;
        assert_eq!(rows, vec![json!([KEYS + 6])], "with the late writes");
        let rows = sql(node, "SELECT n, count(*) FROM c WHERE meta_id LIKE 'k%' GROUP BY n ORDER BY n", "not_bounded").await;
        let want: Vec<Value> = (0..30).map(|n| json!([n, 3])).collect();
        assert_eq!(rows, want);
        let rows =
            sql(node, "SELECT meta_id, i FROM c WHERE meta_id IN ('k004', 'k050', 'k089', 'nope') ORDER BY meta_id", "not_bounded").await;
        assert_eq!(rows, vec![json!(["k004", 4]), json!(["k050", 50]), json!(["k089", 89])], "key lookups reach each key's member");
        let rows = sql(node, "SELECT meta_id FROM c WHERE n = 4 ORDER BY meta_id", "request_plus").await;
        assert_eq!(rows, vec![json!(["k004"]), json!(["k034"]), json!(["k064"])], "an indexed field, across members");
    }
    // A member holding no partition yet (joined, not rebalanced in) answers too, its
    // schema learnt from the others' documents.
    let join = nodes[0].addr();
    let fourth = Node::start(&["--cluster-secret", SECRET, "--partitions", PARTITIONS, "--analytics-partitions", "0", "--join", &join]);
    wait_for(&http, &fourth.u("/v1/cluster"), "four members, seen by the fourth", |v| member_states(v).len() == 4).await;
    let rows = sql(&fourth, "SELECT n, count(*), sum(i) FROM c WHERE meta_id LIKE 'k%' GROUP BY n ORDER BY n", "not_bounded").await;
    let want: Vec<Value> = (0..30).map(|n| json!([n, 3, 3 * n + 90])).collect();
    assert_eq!(rows, want, "every member's documents, through a member holding none");
    // Analytics on a node holding only some partitions runs on the members' shadows, each
    // scanning its own active partitions; a node holding none (analytics off there)
    // coordinates alone.
    for node in nodes.iter().chain([&fourth]) {
        let r = http
            .post(node.u("/v1/analytics"))
            .json(&json!({"sql": "SELECT n, count(*), sum(i) FROM c WHERE meta_id LIKE 'k%' GROUP BY n ORDER BY n"}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["rows"].as_array().unwrap(), &want, "analytics through {}", node.url);
        assert_eq!(v["metrics"]["engine"], "columnar across members", "{v}");
    }
}

/// A DDL change answered by one member holds on every member at once: a collection or an
/// index made through one is there on the others for the very next request, and a dropped
/// collection is gone from them (the author waits for the members to apply it — before,
/// a write to another member right after a `201` could answer `404`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ddl_answered_by_one_member_holds_on_every_member_at_once() {
    let nodes = start_cluster(3, &[]);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    rebalance(&http, &nodes[0], &[]).await;
    for round in 0..6 {
        let (via, other, third) = (&nodes[round % 3], &nodes[(round + 1) % 3], &nodes[(round + 2) % 3]);
        let coll = format!("/v1/collections/ddl{round}");
        let r = http.put(via.u(&coll)).send().await.unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());
        for (n, node) in [other, third].into_iter().enumerate() {
            let r = http.put(node.u(&format!("{coll}/docs/k{n}"))).json(&json!({"v": round})).send().await.unwrap();
            let status = r.status().as_u16();
            assert!(
                status == 200 || status == 201,
                "round {round}: a write right after the create: {status} {}",
                r.text().await.unwrap_or_default()
            );
        }
        let create = json!({"name": "by_v", "keys": ["v"]});
        let r = http.post(other.u(&format!("{coll}/indexes"))).json(&create).send().await.unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());
        for node in [third, via] {
            let scan = json!({"eq": [round], "consistency": "request_plus", "timeout_ms": 30_000});
            let r = http.post(node.u(&format!("{coll}/indexes/by_v/scan"))).json(&scan).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            assert_eq!(status, 200, "round {round}: a scan right after the index's create: {v}");
            assert_eq!(v["rows"].as_array().map(Vec::len), Some(2), "round {round}: {v}");
        }
        let r = http.delete(third.u(&coll)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        for node in [via, other] {
            let r = http.get(node.u(&format!("{coll}/docs/k0"))).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            assert_eq!(
                (status, v["error"].as_str()),
                (404, Some("collection_not_found")),
                "round {round}: a read right after the drop: {v}"
            );
        }
    }
}

/// SQL spread over the members reads each member's documents in pages, each cut at
/// `DOCS_ANSWER_MAX_DOCS` (8,192) documents or `DOCS_ANSWER_MAX_BYTES` (16 MiB, at least one
/// document): members holding more than a page of either answer every document once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sql_pages_a_members_documents_at_its_count_and_byte_caps() {
    let nodes = start_cluster(3, &[]);
    let http = common::client_builder().timeout(Duration::from_secs(120)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    for c in ["many", "big"] {
        assert_eq!(http.put(nodes[0].u(&format!("/v1/collections/{c}"))).send().await.unwrap().status(), 201);
    }
    rebalance(&http, &nodes[0], &[]).await;
    // About 10,000 active documents per member: more than one page of 8,192 each.
    const MANY: usize = 30_000;
    for chunk in (0..MANY).collect::<Vec<_>>().chunks(5_000) {
        let mut body = String::new();
        for i in chunk {
            body.push_str(&json!({"op": "upsert", "key": format!("m{i:05}"), "value": {"i": i}}).to_string());
            body.push('\n');
        }
        let r = http.post(nodes[0].u("/v1/collections/many/_bulk")).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    // About 20 MiB of documents per member: more than one page of 16 MiB each.
    const BIG: usize = 60;
    let pad = "x".repeat(1024 * 1024);
    for i in 0..BIG {
        let r =
            http.put(nodes[i % 3].u(&format!("/v1/collections/big/docs/b{i:02}"))).json(&json!({"pad": pad, "i": i})).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    }
    let (_, map) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let active_on = |node: u64, keys: &mut dyn Iterator<Item = String>| {
        keys.filter(|k| map["partitions"][usize::from(shoal_storage::partition_of(k.as_bytes(), 16))]["active"].as_u64() == Some(node))
            .count()
    };
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let ids: Vec<u64> = nodes.iter().map(|n| node_id(&info, n).unwrap()).collect();
    assert!(
        ids.iter().any(|id| active_on(*id, &mut (0..MANY).map(|i| format!("m{i:05}"))) > 8_192),
        "some member holds more than a page of documents"
    );
    assert!(ids.iter().any(|id| active_on(*id, &mut (0..BIG).map(|i| format!("b{i:02}"))) > 16), "some member holds more than 16 MiB");
    for node in &nodes {
        for (statement, want) in [
            ("SELECT count(*), sum(i) FROM many", json!([MANY, (0..MANY).sum::<usize>()])),
            ("SELECT count(*), sum(i), min(length(pad)) FROM big", json!([BIG, (0..BIG).sum::<usize>(), 1024 * 1024])),
        ] {
            let r = http.post(node.u("/v1/query")).json(&json!({"sql": statement})).send().await.unwrap();
            let status = r.status();
            let v: Value = r.json().await.unwrap();
            assert_eq!(status, 200, "{statement}: {v}");
            assert_eq!(v["rows"], json!([want]), "{statement} through {}", node.url);
        }
    }
}

/// A copy of a member's data directory started at another address would claim the
/// member's node id: it stops with a clear error, and the member is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_data_directory_cannot_pose_as_its_member() {
    let mut nodes = start_cluster(2, &[]);
    let http = common::client_builder().timeout(Duration::from_secs(30)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    assert!(nodes[1].stop());
    let copy = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp").arg("-a").arg(&nodes[1].dir).arg(copy.path().join("d")).status().unwrap();
    assert!(status.success());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["serve", "--listen", "127.0.0.1:0", "--partitions", PARTITIONS, "--analytics-partitions", "0"])
        .arg("--data-path")
        .arg(copy.path().join("d"))
        .args(["--cluster-secret", SECRET, "--join", &nodes[0].addr()])
        .env("SHOAL_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the copy must not start");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("copied data directory"), "{stderr}");
    // The member itself comes back at its address.
    nodes[1].restart();
    let info = wait_for(&http, &nodes[1].u("/v1/cluster"), "the member back", |v| member_states(v).len() == 2).await;
    assert!(info["node"].as_u64().is_some(), "{info}");
}

/// A rebalance builds a new copy of a large partition from the active's files (its
/// keyspace's table and blob files, adopted whole), then catches it up from the change stream; writes
/// acknowledged by a majority while it runs survive the loss of the node the data came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_copies_large_partitions_as_files_and_loses_nothing() {
    let status = files_rebalance(false).await;
    let moves = status["moves"].as_array().unwrap();
    assert!(moves.iter().all(|m| m["method"] == "files"), "every copy was built from files: {status}");
    let partitions = || moves.iter().filter(|m| m["kind"] == "partition");
    assert!(partitions().all(|m| m["shipped"] == "files"), "every copy's snapshot came as the keyspace's files: {status}");
    // The index is placed on the nodes (all run the index service): its partitions moved
    // as files too, and moving data partitions moved no index entry.
    assert!(moves.iter().any(|m| m["kind"] == "index"), "index partitions moved to the new nodes: {status}");
    // The index stage's own length, within the rebalance's (it runs beside the data moves).
    let (stage, whole) = (status["index_stage_s"].as_f64(), status["elapsed_s"].as_f64().unwrap_or(0.0));
    assert!(stage.is_some_and(|s| s > 0.0 && s <= whole), "the index stage's length within the rebalance's {whole} s: {status}");
    assert!(status["bytes_done"].as_u64().unwrap() > 12_000 * 20, "the copies' bytes are counted: {status}");
    // One kind of byte, so a finished rebalance is at 100 % (it showed 13 % when compressed
    // file bytes were counted against document bytes).
    assert_eq!(status["bytes_done"], status["bytes_total"], "a finished rebalance is whole: {status}");
    // The plan gave every move its bytes before any copy started: its source partition's
    // live documents. The copy carries its tables as they are on disk: the records (keys,
    // metadata, by-sequence entries) in LZ4-compressed blocks, with the writes made since
    // the plan. Here the documents are about 26 bytes, smaller than a record's key, metadata
    // and by-sequence entry together (a CI run carried 4.6x the plan), so the factor is
    // wide: it still catches bytes counted from the wrong files or not at all. (An index
    // partition's move counts its files, and no document bytes.)
    for m in partitions() {
        let (planned, done) = (m["bytes_planned"].as_u64().unwrap_or(0), m["bytes_done"].as_u64().unwrap_or(0));
        assert!(planned > 0 && done > 0 && done <= planned * 16 && done * 4 >= planned, "planned {planned}, carried {done}: {m}");
        // A move is caught up only once its copy is whole: never on the positions an ingest
        // set before the copy said it was done.
        let finished = m["copy_finished_unix_ms"].as_u64();
        assert!(finished.is_some_and(|f| Some(f) >= m["copy_started_unix_ms"].as_u64()), "a move done on a copy under way: {m}");
    }
    assert_eq!(
        status["bytes_planned"].as_u64(),
        Some(moves.iter().map(|m| m["bytes_planned"].as_u64().unwrap_or(0)).sum::<u64>()),
        "{status}"
    );
}

/// A copy by files whose link breaks midway is dropped and built from the change stream
/// instead; the rebalance still ends, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_cut_off_midway_falls_back_to_the_stream_and_loses_nothing() {
    let status = files_rebalance(true).await;
    let moves = status["moves"].as_array().unwrap();
    assert!(moves.iter().any(|m| m["method"] == "stream"), "a broken copy fell back to the stream: {status}");
    // A stream copy's bytes are counted too: not only its first consistent batch (a read
    // from the active's in-memory tail is consistent at every one; 268 kB of 1.6 MB were
    // shown), but until the move is handed over, which may leave the last
    // `CATCH_UP_SLACK` changes (about a third of these partitions) uncounted. (An index
    // partition's copy cut off too is rebuilt from the streams, with no document bytes.)
    for m in moves.iter().filter(|m| m["method"] == "stream" && m["kind"] == "partition") {
        let (planned, done) = (m["bytes_planned"].as_u64().unwrap_or(0), m["bytes_done"].as_u64().unwrap_or(0));
        assert!(planned > 0 && done * 2 >= planned, "a stream copy carried {done} of its {planned} planned bytes: {m}");
    }
}

/// Loads a one-node cluster (4 partitions, so that each holds more than a copy by files
/// needs), adds two nodes and rebalances under a majority writer — with `cut`, the new
/// nodes are cut off from the source for a while once the copies have started (paced so
/// that they are still running) — then kills the source and reads every document and
/// index row from the copies. Answers the rebalance's final status.
async fn files_rebalance(cut: bool) -> Value {
    let mut args = vec!["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "4"];
    if cut {
        args.push("--fault-injection");
    }
    let mut first = Node::start(&args);
    first.pin_port();
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let r = http.post(first.u("/v1/collections/c/indexes")).json(&json!({"name": "by_n", "keys": ["n"]})).send().await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());
    const KEYS: usize = 12_000;
    // With a cut, documents of ~500 bytes: each partition's copy spans several chunks.
    let pad = if cut { "x".repeat(500) } else { String::new() };
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(2_000) {
        let body: String = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"n": i % 100, "i": i, "pad": pad}}).to_string() + "\n")
            .collect();
        let r = http.post(first.u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
    if cut {
        let r = http.put(first.u("/v1/cluster/settings")).json(&json!({"rebalance_mb_per_s": 4})).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    }
    // Two nodes join; the rebalance copies partitions to them while a writer runs.
    let join = first.addr();
    let mut nodes = vec![first];
    for _ in 0..2 {
        nodes.push(joined(&args, &join));
    }
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (http, url, stop) = (http.clone(), nodes[0].u("/v1/collections/c/docs"), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("w{i:05}");
                let r = http.put(format!("{url}/{key}?durability=majority")).body(json!({"n": 7, "w": i}).to_string()).send().await;
                if r.is_ok_and(|r| r.status() == 200) {
                    acked.push(i);
                }
                i += 1;
            }
            (acked, i)
        })
    };
    // Many-key requests through the other members while partitions change hands: a line or
    // key refused as misrouted is sent again on the newer map, never answered as such.
    let many = {
        let (http, bulk, get, stop) =
            (http.clone(), nodes[1].u("/v1/collections/c/_bulk"), nodes[2].u("/v1/collections/c/_get"), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut misrouted = Vec::new();
            let mut round = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let keys: Vec<String> = (0..20).map(|i| format!("b{round:04}-{i}")).collect();
                let body: String =
                    keys.iter().map(|k| json!({"op": "upsert", "key": k, "value": {"b": round}}).to_string() + "\n").collect();
                if let Ok(r) = http.post(&bulk).body(body).send().await {
                    misrouted
                        .extend(r.text().await.unwrap_or_default().lines().filter(|l| l.contains("not_my_partition")).map(String::from));
                }
                if let Ok(r) = http.post(&get).json(&json!({"keys": keys})).send().await {
                    let v: Value = r.json().await.unwrap_or(Value::Null);
                    let docs = v["docs"].as_array().cloned().unwrap_or_default();
                    misrouted.extend(docs.iter().filter(|d| d["error"] == "not_my_partition").map(Value::to_string));
                }
                round += 1;
            }
            (round, misrouted)
        })
    };
    let r = http.post(nodes[1].u("/v1/cluster/rebalance")).json(&json!({"eject": []})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 202);
    if cut {
        wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "a copy under way", |v| {
            v["moves"].as_array().is_some_and(|m| m.iter().any(|m| m["state"] == "copying" && m["bytes_done"].as_u64() > Some(0)))
        })
        .await;
        let faults = |node: &Node, cut: Vec<String>| {
            let (http, url) = (http.clone(), node.u("/v1/_internal/faults"));
            async move {
                let r = http.post(url).header("x-shoal-cluster-secret", SECRET).json(&json!({"cut": cut})).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        };
        for n in &nodes[1..] {
            faults(n, vec![join.clone()]).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        for n in &nodes[1..] {
            faults(n, Vec::new()).await;
        }
    }
    let status = wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "rebalance done", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "done", "{status}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, attempted) = writer.await.unwrap();
    let (rounds, misrouted) = many.await.unwrap();
    assert!(rounds > 0, "the many-key requests ran");
    // The first node held every copy and keeps about two of three: the ones it handed over
    // are dead at once, and their data is discarded soon after (none stays retired).
    let dead = common::metric(&http, &nodes[0], "shoal_partitions{state=\"dead\"}").await;
    assert!(dead.is_some_and(|d| d >= 1.0), "the first node handed copies over: {dead:?} dead");
    common::eventually(30, "the handed-over copies' data discarded", || async {
        common::metric(&http, &nodes[0], "shoal_partitions_retired").await == Some(0.0)
    })
    .await;
    assert!(misrouted.is_empty(), "many-key answers said misrouted: {misrouted:?}");
    let moves = status["moves"].as_array().unwrap();
    assert!(!moves.is_empty(), "the new nodes take copies: {status}");
    eprintln!(
        "rebalance: {} moves, {} bytes from files, {} majority writes acknowledged meanwhile",
        moves.len(),
        status["bytes_done"],
        acked.len()
    );

    // The node the data came from dies; its partitions fail over to the copies. Every
    // document — loaded before, and acknowledged during the rebalance — is there.
    let (_, info) = get_json(&http, &nodes[1].u("/v1/cluster")).await;
    let first_id = node_id(&info, &nodes[0]).unwrap();
    nodes[0].kill9();
    wait_for(&http, &nodes[1].u("/v1/cluster"), "failover of the first node", |v| {
        v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(first_id) && n["state"] == "failed"))
    })
    .await;
    // Every write attempted is asked for: the acknowledged ones must be there; one that
    // failed (refused, or timed out while a copy was cut off) may or may not be.
    let mut keys: Vec<String> = (0..KEYS).map(|i| format!("k{i:05}")).collect();
    keys.extend((0..attempted).map(|i| format!("w{i:05}")));
    let acked_keys: std::collections::HashSet<String> = acked.iter().map(|i| format!("w{i:05}")).collect();
    let mut written = 0;
    for (n, batch) in keys.chunks(1_000).enumerate() {
        let url = nodes[1 + n % 2].u("/v1/collections/c/_get");
        // Until the failover's promoting map is in, the dead node's partitions answer
        // `unavailable` (try again): ask again then.
        let deadline = Instant::now() + Duration::from_secs(60);
        let v = loop {
            let r = http.post(&url).json(&json!({"keys": batch})).send().await.unwrap();
            if r.status() == 200 {
                let v = r.json::<Value>().await.unwrap();
                let waiting = v["docs"].as_array().unwrap().iter().any(|d| d["error"] == "unavailable");
                if !waiting || Instant::now() > deadline {
                    break v;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        for (key, doc) in batch.iter().zip(v["docs"].as_array().unwrap()) {
            assert_eq!(doc["key"], *key);
            let present = doc.get("value").is_some();
            if key.starts_with('k') || acked_keys.contains(key) {
                assert!(present, "{key} lost after the copy and the failover: {doc}");
            } else {
                assert!(present || doc["error"] == "doc_not_found", "{key}: {doc}");
            }
            written += usize::from(present && key.starts_with('w'));
        }
    }
    // The index answers whole: its partitions on the dead node were placed again on the
    // others by the failover and rebuilt there from the streams.
    let r = http
        .post(nodes[2].u("/v1/collections/c/indexes/by_n/scan"))
        .json(&json!({"eq": [7], "consistency": "request_plus"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rows = r.json::<Value>().await.unwrap()["rows"].as_array().unwrap().len();
    assert_eq!(rows, KEYS / 100 + written, "the index on the copies has a row for every document with n = 7");
    status
}

/// `serve` flags of the move tests' nodes: 4 partitions, so that each holds more than a
/// copy by files needs.
const MOVE_ARGS: [&str; 6] = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "4"];
/// A wave whose sources answer the hand-over only after `HANDOVER_COMMIT_WITHIN` (half the
/// limit of their freezes, after which they take writes again) is not committed: the
/// rebalance fails and says why, nothing a majority acknowledged meanwhile is lost, and a
/// new rebalance moves the partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_over_answered_too_late_is_not_committed_and_loses_nothing() {
    let args = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "4", "--fault-injection"];
    let (nodes, http, join) = three_joined_nodes(&args).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    let body: String = (0..400).map(|i| json!({"op": "upsert", "key": format!("k{i:03}"), "value": {"i": i}}).to_string() + "\n").collect();
    let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=majority")).body(body).send().await.unwrap();
    assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    let fourth = joined(&args, &join);
    wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    // Every old member applies maps late, so a source freezes (and answers) only after the
    // bound; the new node does not.
    let delay = shoal_node::rebalance::HANDOVER_COMMIT_WITHIN + Duration::from_secs(1);
    let set_delay = |ms: u128| {
        let http = http.clone();
        let urls: Vec<String> = nodes.iter().map(|n| n.u("/v1/_internal/faults")).collect();
        async move {
            for url in urls {
                let r = http
                    .post(url)
                    .header("x-shoal-cluster-secret", SECRET)
                    .json(&json!({"cut": [], "map_delay_ms": ms}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
            }
        }
    };
    set_delay(delay.as_millis()).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (http, url, stop) = (http.clone(), nodes[1].u("/v1/collections/c/docs"), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0usize.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let r = http.put(format!("{url}/w{i:05}?durability=majority")).body(json!({"w": i}).to_string()).send().await;
                if r.is_ok_and(|r| r.status() == 200) {
                    acked.push(i);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            acked
        })
    };
    let r = http.post(nodes[1].u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let status = wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "the rebalance's end", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "failed", "{status}");
    assert!(status["message"].as_str().is_some_and(|m| m.contains("too close to their freezes' end")), "{status}");

    // Released, a new rebalance moves them (a map application already delayed may still
    // hold the next hand-over up: tried until one completes); everything acknowledged is there.
    set_delay(0).await;
    common::cluster::rebalance_when_possible(&http, &nodes[1], &[]).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = writer.await.unwrap();
    assert!(!acked.is_empty(), "majority writes were acknowledged meanwhile");
    let (_, info) = get_json(&http, &nodes[1].u("/v1/cluster")).await;
    let fourth_id = node_id(&info, &fourth).unwrap();
    let (_, map) = get_json(&http, &nodes[1].u("/v1/cluster/map")).await;
    assert!(map["partitions"].as_array().unwrap().iter().any(|p| p["active"] == fourth_id), "the new node took active copies: {map}");
    let keys: Vec<String> = (0..400).map(|i| format!("k{i:03}")).chain(acked.iter().map(|i| format!("w{i:05}"))).collect();
    for key in keys {
        let (status, doc) = get_json(&http, &fourth.u(&format!("/v1/collections/c/docs/{key}"))).await;
        assert_eq!(status, 200, "{key}: {doc}");
    }
}

/// Documents (of ~500 bytes, keys `k00000`...) the move tests load.
const MOVE_KEYS: usize = 12_000;

/// Three nodes started with `args` (the first founds the cluster, the others join it, on
/// pinned ports); answers them once all are members, an HTTP client and the address to join.
async fn three_joined_nodes(args: &[&str]) -> (Vec<Node>, reqwest::Client, String) {
    let mut first = Node::start(args);
    first.pin_port();
    let join = first.addr();
    let mut nodes = vec![first];
    for _ in 0..2 {
        nodes.push(joined(args, &join));
    }
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    (nodes, http, join)
}

/// Three nodes started with `args` (say [`MOVE_ARGS`]), rebalanced, with collection `c`
/// loaded with [`MOVE_KEYS`] documents (`persist`); answers them, an HTTP client and the
/// address to join.
async fn three_loaded_nodes(args: &[&str]) -> (Vec<Node>, reqwest::Client, String) {
    let (nodes, http, join) = three_joined_nodes(args).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    let pad = "x".repeat(500);
    for chunk in (0..MOVE_KEYS).collect::<Vec<_>>().chunks(2_000) {
        let body: String = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"i": i, "pad": pad}}).to_string() + "\n")
            .collect();
        let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
    (nodes, http, join)
}

/// A node can learn the map that makes it a partition's replica (the metadata, which its
/// pulls read) before its partition states follow it (an fsync later). A copy by files that
/// started in between found the partition still dead here, failed, and left the partition
/// to the unpaced change stream (seen in `shoal bench rebalance --scenarios remove`). Each
/// map here waits a while before the states follow it; every copy still goes by files.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_waits_for_the_map_that_makes_it_a_replica() {
    // 64 partitions: then some removal always copies a partition to a node that already
    // follows that partition's source for another one, whose pulls run when the map comes
    // (with 4 partitions, a third of random node ids gave none; checked with the placement).
    const PARTITIONS: u16 = 64;
    let args = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "64", "--fault-injection"];
    let (nodes, http, _) = three_joined_nodes(&args).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let (_, before) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let current: shoal_cluster::PartitionMap = serde_json::from_value(before).unwrap();
    let ids: Vec<u64> = nodes.iter().map(|n| node_id(&info, n).unwrap()).collect();
    // The plan is the leader's: placement is a pure function.
    let follows = |to: u64, source: u64, but: u16| {
        current
            .partitions
            .iter()
            .enumerate()
            .any(|(q, c)| q != usize::from(but) && c.active.0 == source && c.replicas.contains(&shoal_cluster::NodeId(to)))
    };
    let (leaving, racing) = ids
        .iter()
        .map(|&l| {
            let stay: Vec<shoal_cluster::Node> =
                ids.iter().filter(|&&i| i != l).map(|&i| shoal_cluster::Node { id: shoal_cluster::NodeId(i), weight: 1 }).collect();
            let target = shoal_cluster::place(PARTITIONS, &stay, 1, Some(&current)).unwrap();
            let racing: Vec<u16> = (0..PARTITIONS)
                .filter(|&p| {
                    let (now, then) = (&current.partitions[usize::from(p)], &target.partitions[usize::from(p)]);
                    then.nodes().any(|t| !now.holds(t) && follows(t.0, now.active.0, p))
                })
                .take(2)
                .collect();
            (l, racing)
        })
        .find(|(_, racing)| !racing.is_empty())
        .expect("some removal copies to a node that follows the source already");
    // Those partitions get enough documents to be copied by files; the others stay empty.
    let keys: Vec<String> = racing
        .iter()
        .flat_map(|&p| {
            (0..).map(|i| format!("k{i}")).filter(move |k| shoal_storage::partition_of(k.as_bytes(), PARTITIONS) == p).take(2_100)
        })
        .collect();
    for chunk in keys.chunks(2_000) {
        let body: String = chunk.iter().map(|k| json!({"op": "upsert", "key": k, "value": {"k": k}}).to_string() + "\n").collect();
        let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
    for n in &nodes {
        let r = http
            .post(n.u("/v1/_internal/faults"))
            .header("x-shoal-cluster-secret", SECRET)
            .json(&json!({"cut": [], "map_delay_ms": 1_500}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    }
    let stay = nodes.iter().position(|n| node_id(&info, n) != Some(leaving)).unwrap();
    rebalance(&http, &nodes[stay], &[leaving]).await;
    let (_, status) = get_json(&http, &nodes[stay].u("/v1/cluster/rebalance")).await;
    let moves = status["moves"].as_array().unwrap();
    for p in &racing {
        let mine: Vec<&Value> = moves.iter().filter(|m| m["id"] == *p).collect();
        assert!(!mine.is_empty(), "partition {p} moved: {status}");
        assert!(mine.iter().all(|m| m["method"] == "files"), "partition {p} was built from files: {status}");
    }
    // Past its bound a delay is refused, and changes nothing.
    let r = http
        .post(nodes[stay].u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", SECRET)
        .json(&json!({"cut": [], "map_delay_ms": 3_600_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = http.post(nodes[stay].u("/v1/collections/c/_get")).json(&json!({"keys": keys})).send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    let docs = v["docs"].as_array().unwrap_or_else(|| panic!("{v}"));
    for (key, doc) in keys.iter().zip(docs) {
        assert!(doc.get("value").is_some(), "{key} lost: {doc}");
    }
}

/// An added node takes its copies and no other copy is rebuilt: a replica long-polling
/// the active that the final map takes its partition from (and that then drops its copy)
/// was answered "roll back to 0" by the dropped, empty copy, and rebuilt itself whole
/// while the foreground load waited (seen in `shoal bench rebalance --scenarios add`).
/// Now no replica rolls back in a rebalance, and every document stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_added_node_takes_its_copies_and_no_replica_is_rebuilt() {
    let args = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "64"];
    let (mut nodes, http, join) = three_joined_nodes(&args).await;
    // A rebalance of a cluster without collections finishes (it waited for one to exist).
    rebalance(&http, &nodes[0], &[]).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    const KEYS: usize = 4_000;
    let body: String =
        (0..KEYS).map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"i": i}}).to_string() + "\n").collect();
    let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
    let text = r.text().await.unwrap();
    assert!(!text.contains("\"error\""), "a bulk line failed: {}", text.lines().find(|l| l.contains("\"error\"")).unwrap_or(""));
    nodes.push(joined(&args, &join));
    wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    rebalance(&http, &nodes[1], &[]).await;
    // Settled: every replica follows its active (the rebalance waits for that).
    for n in &nodes {
        let rollbacks = common::metric(&http, n, "shoal_replica_rollbacks_total").await.unwrap_or(0.0);
        assert_eq!(rollbacks, 0.0, "a replica copy on {} was rolled back during the rebalance", n.addr());
    }
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i:05}")).collect();
    let r = http.post(nodes[3].u("/v1/collections/c/_get")).json(&json!({"keys": keys})).send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    for (key, doc) in keys.iter().zip(v["docs"].as_array().unwrap()) {
        assert!(doc.get("value").is_some(), "{key} lost: {doc}");
    }
}

/// A node that serves nothing yet builds more copies at once (DESIGN.md: a concurrency
/// budget "larger towards an empty node"): with `rebalance_moves_per_node` at 1, a joining
/// node builds its two copies by files at the same time, while receivers that are already
/// the active of a partition build theirs one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_node_builds_more_copies_at_once() {
    let (mut nodes, http, join) = three_joined_nodes(&MOVE_ARGS).await;
    assert_eq!(http.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    rebalance(&http, &nodes[0], &[]).await;
    // Pads that LZ4 cannot shrink, so that each copy takes a second or more at 1 MB/s.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut pad = || -> String {
        (0..32)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                format!("{x:016x}")
            })
            .collect()
    };
    for chunk in (0..MOVE_KEYS).collect::<Vec<_>>().chunks(2_000) {
        let body: String = chunk
            .iter()
            .map(|i| json!({"op": "upsert", "key": format!("k{i:05}"), "value": {"i": i, "pad": pad()}}).to_string() + "\n")
            .collect();
        let r = http.post(nodes[0].u("/v1/collections/c/_bulk?durability=persist")).body(body).send().await.unwrap();
        assert!(!r.text().await.unwrap().contains("\"error\""), "a bulk line failed");
    }
    let r = http
        .put(nodes[0].u("/v1/cluster/settings"))
        .json(&json!({"rebalance_moves_per_node": 1, "rebalance_mb_per_s": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    // The copies by files into `to` in a rebalance's status: (start, end) in ms.
    let copies_into = |status: &Value, to: u64| -> Vec<(u64, u64)> {
        status["moves"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["to"] == to && m["method"] == "files")
            .map(|m| (m["copy_started_unix_ms"].as_u64().unwrap(), m["copy_finished_unix_ms"].as_u64().unwrap()))
            .collect()
    };
    let overlap = |a: (u64, u64), b: (u64, u64)| a.0 < b.1 && b.0 < a.1;

    // A fourth node joins: it is the active of nothing until its moves are handed over.
    nodes.push(joined(&MOVE_ARGS, &join));
    let info = wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    let fourth = node_id(&info, &nodes[3]).unwrap();
    rebalance(&http, &nodes[0], &[]).await;
    let (_, status) = get_json(&http, &nodes[0].u("/v1/cluster/rebalance")).await;
    let into_fourth = copies_into(&status, fourth);
    assert_eq!(into_fourth.len(), 2, "the new node builds two copies from files: {status}");
    assert!(overlap(into_fourth[0], into_fourth[1]), "the empty node built its two copies at once: {into_fourth:?}");

    // Two nodes leave; the two that stay are each the active of a partition, and take the
    // copies they lack one at a time.
    let (_, map) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let map: shoal_cluster::PartitionMap = serde_json::from_value(map).unwrap();
    let ids: Vec<u64> = nodes.iter().map(|n| node_id(&info, n).unwrap()).collect();
    let active = |id: u64| map.partitions.iter().any(|c| c.active.0 == id);
    let held = |id: u64| map.partitions.iter().filter(|c| c.holds(shoal_cluster::NodeId(id))).count();
    let (a, b) = (0..4)
        .flat_map(|a| (a + 1..4).map(move |b| (a, b)))
        .filter(|&(a, b)| active(ids[a]) && active(ids[b]))
        .min_by_key(|&(a, b)| held(ids[a]) + held(ids[b]))
        .expect("two nodes that are actives");
    let stay = [ids[a], ids[b]];
    let eject: Vec<u64> = ids.iter().copied().filter(|id| !stay.contains(id)).collect();
    rebalance(&http, &nodes[a], &eject).await;
    let (_, status) = get_json(&http, &nodes[a].u("/v1/cluster/rebalance")).await;
    let mut busiest = 0;
    for id in stay {
        let copies = copies_into(&status, id);
        busiest = busiest.max(copies.len());
        for (i, x) in copies.iter().enumerate() {
            for y in &copies[i + 1..] {
                assert!(!overlap(*x, *y), "node {id}, which serves, built two copies at once: {copies:?}");
            }
        }
    }
    assert!(busiest >= 2, "a node that stays builds two copies or more from files: {status}");
}

/// A rebalance moves each partition once its new copies have caught up, so a stop keeps
/// the moves already done and undoes only the others (API.md: "finished moves stay, a move
/// in flight is rolled back"). The test computes the plan as the leader does (placement is
/// a pure function), then holds back, on the new node, a collection that only one of its
/// partitions holds: that move cannot catch up, the other finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_rebalance_keeps_the_moves_it_finished() {
    let args = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", "4", "--fault-injection"];
    let (nodes, http, join) = three_joined_nodes(&args).await;
    for c in ["c", "slow"] {
        assert_eq!(http.put(nodes[0].u(&format!("/v1/collections/{c}"))).send().await.unwrap().status(), 201);
    }
    rebalance(&http, &nodes[0], &[]).await;
    let fourth = joined(&args, &join);
    let info = wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    let fourth_id = node_id(&info, &fourth).unwrap();
    // The leader's plan: the same placement over the same members.
    let (_, before) = get_json(&http, &nodes[0].u("/v1/cluster/map")).await;
    let current: shoal_cluster::PartitionMap = serde_json::from_value(before.clone()).unwrap();
    let mut members: Vec<u64> = info["nodes"].as_array().unwrap().iter().map(|n| n["id"].as_u64().unwrap()).collect();
    members.sort_unstable();
    let placed: Vec<shoal_cluster::Node> =
        members.iter().map(|id| shoal_cluster::Node { id: shoal_cluster::NodeId(*id), weight: 1 }).collect();
    let target = shoal_cluster::place(4, &placed, 1, Some(&current)).unwrap();
    let to_fourth: Vec<u16> = (0..4u16).filter(|p| target.partitions[usize::from(*p)].holds(shoal_cluster::NodeId(fourth_id))).collect();
    assert_eq!(to_fourth.len(), 2, "the new node takes two of the eight copies: {target:?}");
    let (stalled, finished) = (to_fourth[0], to_fourth[1]);
    // Documents everywhere in `c`; in `slow`, more than a catch-up's slack, all in one
    // partition, which the new node holds back.
    let mut body = String::new();
    for i in 0..400 {
        body.push_str(&json!({"op": "upsert", "key": format!("k{i:03}"), "value": {"i": i}}).to_string());
        body.push('\n');
    }
    assert_eq!(http.post(nodes[0].u("/v1/collections/c/_bulk")).body(body).send().await.unwrap().status(), 200);
    let slow_keys: Vec<String> =
        (0..20_000).map(|i| format!("s{i}")).filter(|k| shoal_storage::partition_of(k.as_bytes(), 4) == stalled).take(1_500).collect();
    let body: String = slow_keys.iter().map(|k| json!({"op": "upsert", "key": k, "value": {"s": 1}}).to_string() + "\n").collect();
    assert_eq!(http.post(nodes[0].u("/v1/collections/slow/_bulk")).body(body).send().await.unwrap().status(), 200);
    // Malformed fault switches are refused whole, and change nothing (checked by the copy
    // of `c` finishing below: nothing is cut or held by them).
    for bad in [
        "{",
        r#"{"cut": "x"}"#,
        r#"{"cut": [], "hold": ["no-such-collection"]}"#,
        r#"{"cut": [], "drop": true}"#,
        r#"{"cut": [], "map_delay_ms": -1}"#,
        r#"{"cut": [], "map_delay_ms": "1s"}"#,
        r#"{"cut": [], "map_delay_ms": 30001}"#,
    ] {
        let r = http.post(fourth.u("/v1/_internal/faults")).header("x-shoal-cluster-secret", SECRET).body(bad).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let code = r.json::<Value>().await.unwrap()["error"].clone();
        assert!(code == "invalid_json" || code == "bad_request", "{bad}: {code}");
    }
    let r = http
        .post(fourth.u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", SECRET)
        .json(&json!({"cut": [], "hold": ["slow"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let r = http.post(nodes[1].u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let move_state = |v: &Value, p: u16| {
        v["moves"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == p && m["to"] == fourth_id)
            .map(|m| m["state"].as_str().unwrap_or("").to_string())
    };
    wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "the unhindered move done", |v| {
        move_state(v, finished).as_deref() == Some("done")
    })
    .await;
    let r = http.delete(nodes[2].u("/v1/cluster/rebalance")).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
    let status = wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "the stop", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "stopped", "{status}");
    assert_eq!(move_state(&status, finished).as_deref(), Some("done"), "{status}");
    assert_eq!(move_state(&status, stalled).as_deref(), Some("stopped"), "{status}");
    let (_, after) = get_json(&http, &nodes[1].u("/v1/cluster/map")).await;
    let after: shoal_cluster::PartitionMap = serde_json::from_value(after).unwrap();
    assert_eq!(after.partitions[usize::from(finished)], target.partitions[usize::from(finished)], "the finished move stays");
    assert_eq!(after.partitions[usize::from(stalled)].nodes().collect::<Vec<_>>().len(), 2);
    assert!(!after.partitions[usize::from(stalled)].holds(shoal_cluster::NodeId(fourth_id)), "the move in flight is undone: {after:?}");
    let (_, info) = get_json(&http, &nodes[1].u("/v1/cluster")).await;
    let state = info["nodes"].as_array().unwrap().iter().find(|n| n["id"] == fourth_id).unwrap()["state"].clone();
    assert_eq!(state, "active", "the new node holds a copy, so it stays in: {info}");

    // Released, a new rebalance finishes the rest; every document is there.
    let r = http
        .post(fourth.u("/v1/_internal/faults"))
        .header("x-shoal-cluster-secret", SECRET)
        .json(&json!({"cut": [], "hold": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    rebalance(&http, &nodes[1], &[]).await;
    let (_, done) = get_json(&http, &nodes[1].u("/v1/cluster/map")).await;
    let done: shoal_cluster::PartitionMap = serde_json::from_value(done).unwrap();
    assert_eq!(done.partitions, target.partitions, "the plan is the same from there");
    for (coll, keys) in [("c", (0..400).map(|i| format!("k{i:03}")).collect::<Vec<_>>()), ("slow", slow_keys)] {
        let r = http.post(fourth.u(&format!("/v1/collections/{coll}/_get"))).json(&json!({"keys": keys})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        for (key, doc) in keys.iter().zip(v["docs"].as_array().unwrap()) {
            assert!(doc.get("value").is_some(), "{coll}/{key} lost: {doc}");
        }
    }
}

/// `DELETE /v1/cluster/rebalance` stops a rebalance before its final map and the map goes
/// back; a rebalance whose metadata leader is killed is taken up by the next leader, which
/// goes back when a node of its plan failed; a new rebalance then finishes and nothing is
/// lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_stops_on_request_and_outlives_its_leader() {
    let args = MOVE_ARGS;
    const KEYS: usize = MOVE_KEYS;
    let (mut nodes, http, join) = three_loaded_nodes(&args).await;
    // Copies paced to 1 MB/s, so that they are still running when the test acts.
    let settings_urls: Vec<String> = nodes.iter().map(|n| n.u("/v1/cluster/settings")).collect();
    let pace = |mb: u32| {
        let (http, urls) = (http.clone(), settings_urls.clone());
        async move {
            // Through any member that answers (one of them may be dead by then).
            for url in urls {
                if let Ok(r) = http.put(url).json(&json!({"rebalance_mb_per_s": mb})).send().await {
                    assert_eq!(r.status(), 200);
                    return;
                }
            }
            panic!("no member took the setting");
        }
    };
    pace(1).await;
    let fourth = joined(&args, &join);
    wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    let copying = |v: &Value| v["moves"].as_array().is_some_and(|m| m.iter().any(|m| m["state"] == "copying"));

    // Stopped while copying: the copies go back where they were (a partition whose active
    // role moved between staying nodes may stay moved: that move was done), the new node
    // holds nothing and is `added`.
    let (_, before) = get_json(&http, &nodes[1].u("/v1/cluster/map")).await;
    let r = http.post(nodes[1].u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "a copy under way", copying).await;
    let r = http.delete(nodes[2].u("/v1/cluster/rebalance")).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
    let status = wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "the stop", |v| v["state"] != "running").await;
    assert_eq!(status["state"], "stopped", "{status}");
    let (_, after) = get_json(&http, &nodes[1].u("/v1/cluster/map")).await;
    let holders = |p: &Value| {
        let mut n: Vec<u64> = p["replicas"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap()).collect();
        n.push(p["active"].as_u64().unwrap());
        n.sort_unstable();
        n
    };
    let (after_parts, before_parts) = (after["partitions"].as_array().unwrap(), before["partitions"].as_array().unwrap());
    assert_eq!(after_parts.len(), before_parts.len());
    for (a, b) in after_parts.iter().zip(before_parts) {
        assert_eq!(holders(a), holders(b), "the copies are back where they were: {a} against {b}");
    }
    let (_, info) = get_json(&http, &nodes[1].u("/v1/cluster")).await;
    let fourth_id = node_id(&info, &fourth).unwrap();
    let fourth_state = info["nodes"].as_array().unwrap().iter().find(|n| n["id"] == fourth_id).unwrap()["state"].clone();
    assert_eq!(fourth_state, "added", "{info}");
    let r = http.delete(nodes[2].u("/v1/cluster/rebalance")).send().await.unwrap();
    assert_eq!(r.status(), 409, "nothing to stop");

    // The metadata leader dies while copying. The next leader takes the plan up; a node of
    // the plan failed, so it goes back; a new rebalance finishes.
    let r = http.post(nodes[1].u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    wait_for(&http, &nodes[1].u("/v1/cluster/rebalance"), "a copy under way", copying).await;
    let (_, info) = get_json(&http, &nodes[1].u("/v1/cluster")).await;
    let leader = info["leader"].as_u64().unwrap();
    let victim = nodes.iter().position(|n| node_id(&info, n) == Some(leader)).expect("the leader is one of the first three");
    nodes[victim].kill9();
    let survivor = (0..3).find(|&i| i != victim).unwrap();
    wait_for(&http, &nodes[survivor].u("/v1/cluster"), "failover of the old leader", |v| {
        v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(leader) && n["state"] == "failed"))
    })
    .await;
    let status = wait_for(&http, &nodes[survivor].u("/v1/cluster/rebalance"), "the rebalance taken up and ended", |v| {
        v["state"] != "running" && v["state"] != "none"
    })
    .await;
    assert_eq!(status["state"], "failed", "a node of the plan failed: {status}");
    pace(0).await;
    // (On two shared cores a member starved meanwhile may be failed over too; it is
    // recovered and the rebalance tried again.)
    common::cluster::rebalance_when_possible(&http, &nodes[survivor], &[leader]).await;
    // Every new copy carried its partition's documents (about 3,000 each). A copy the
    // failed plan took back is retired, and a new plan giving it back within
    // `DISCARD_AFTER` discards it first: before that was taken into account, the rebalance
    // once counted such a copy caught up on the positions of data it then discarded (a move
    // "done" in 3 ms with 0 bytes), handed it the partition, and its documents were gone.
    let (_, status) = get_json(&http, &nodes[survivor].u("/v1/cluster/rebalance")).await;
    assert_eq!(status["state"], "done", "{status}");
    for m in status["moves"].as_array().unwrap() {
        assert!(m["bytes_done"].as_u64() > Some(0), "a new copy carried nothing: {m}");
    }
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i:05}")).collect();
    for batch in keys.chunks(2_000) {
        let r = http.post(fourth.u("/v1/collections/c/_get")).json(&json!({"keys": batch})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        for (key, doc) in batch.iter().zip(v["docs"].as_array().unwrap()) {
            assert!(doc.get("value").is_some(), "{key} lost: {doc}");
        }
    }
}

/// Seed 003's faults during a move: a `kill -9` of the move's target, then of its source,
/// each while a copy runs (paced, so that it is running). Each time the rebalance ends
/// `failed` (a node of its plan failed) and goes back to its old map — or `done`, when the
/// kill landed as the last copy ended — and the node comes back and is recovered; the last rebalance finishes. A majority writer runs throughout: every
/// write it was told succeeded, and every document loaded before, is readable at the end.
/// (A kill of the metadata leader mid-copy is `a_rebalance_stops_on_request_and_outlives_its_leader`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_outlives_a_kill9_of_its_target_and_then_of_its_source() {
    let args = MOVE_ARGS;
    const KEYS: usize = MOVE_KEYS;
    let (mut nodes, http, join) = three_loaded_nodes(&args).await;
    let fourth = joined(&args, &join);
    nodes.push(fourth);
    wait_for(&http, &nodes[0].u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;

    // The writer goes through every member in turn; it logs what it was told succeeded.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let docs: Vec<String> = nodes.iter().map(|n| n.u("/v1/collections/c/docs")).collect();
        let (http, stop) = (http.clone(), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let url = format!("{}/w{i:05}?durability=majority", docs[i % docs.len()]);
                let put = http.put(url).timeout(Duration::from_secs(10)).body(json!({"w": i}).to_string()).send().await;
                if put.is_ok_and(|r| r.status() == 200) {
                    acked.push(i);
                } else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                i += 1;
            }
            acked
        })
    };

    // `path` on a member other than `skip` (which is dead at times).
    fn at(nodes: &[Node], skip: usize, path: &str) -> String {
        nodes.iter().enumerate().find(|(i, _)| *i != skip).map(|(_, n)| n.u(path)).expect("another member")
    }
    let (_, info) = get_json(&http, &nodes[0].u("/v1/cluster")).await;
    let ids: Vec<u64> = nodes.iter().map(|n| node_id(&info, n).expect("every node is a member")).collect();
    for victim_is_source in [false, true] {
        // Copies paced to 1 MB/s, so that the kill lands while one runs.
        let r = http.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"rebalance_mb_per_s": 1})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let r = http.post(nodes[0].u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
        assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
        let status = wait_for(&http, &nodes[0].u("/v1/cluster/rebalance"), "a copy under way", |v| {
            v["moves"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["state"] == "copying" && m["from"].is_u64() && m["bytes_done"].as_u64() > Some(0)))
        })
        .await;
        let copying = status["moves"].as_array().unwrap().iter().find(|m| m["state"] == "copying" && m["from"].is_u64()).unwrap().clone();
        let victim_id =
            if victim_is_source { copying["from"].as_u64().expect("a copy has a source") } else { copying["to"].as_u64().unwrap() };
        let victim = ids.iter().position(|&id| id == victim_id).expect("the victim is a member");
        nodes[victim].kill9();
        wait_for(&http, &at(&nodes, victim, "/v1/cluster"), "the victim failed over", |v| {
            v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(victim_id) && n["state"] == "failed"))
        })
        .await;
        let status = wait_for(&http, &at(&nodes, victim, "/v1/cluster/rebalance"), "the rebalance ended", |v| {
            v["state"] != "running" && v["state"] != "none"
        })
        .await;
        // The kill may land just as the last copy ends (progress is polled): the rebalance
        // then finishes before the failover. Either way it ends cleanly (issue 14: "finishes
        // or stops cleanly"); what was acknowledged is checked at the end.
        assert!(status["state"] == "failed" || status["state"] == "done", "a node of the plan failed: {status}");
        // Back and recovered; the next rebalance brings it in.
        nodes[victim].restart();
        let r = http.post(at(&nodes, victim, "/v1/cluster/recover")).json(&json!({"node": victim_id})).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    }
    let r = http.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"rebalance_mb_per_s": 0})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    rebalance(&http, &nodes[0], &[]).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked = writer.await.unwrap();
    assert!(!acked.is_empty(), "the writer was told some writes succeeded");

    // Every loaded document and every acknowledged write, through every member.
    let mut keys: Vec<String> = (0..KEYS).map(|i| format!("k{i:05}")).collect();
    keys.extend(acked.iter().map(|i| format!("w{i:05}")));
    for (n, batch) in keys.chunks(2_000).enumerate() {
        let r = http.post(nodes[n % nodes.len()].u("/v1/collections/c/_get")).json(&json!({"keys": batch})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        for (key, doc) in batch.iter().zip(v["docs"].as_array().unwrap()) {
            assert!(doc.get("value").is_some(), "{key} lost: {doc}");
        }
    }
    eprintln!("kill -9 of a move's target and source: {} keys and {} acknowledged majority writes all readable", KEYS, acked.len());
}

/// `shoal cluster add HOST:PORT`: a lone node started with a plain `shoal serve` (its own
/// one-node cluster and secret) is invited by a member, restarts, joins as `added`, and a
/// rebalance gives it copies. Nodes that hold collections or are already members are
/// refused, as are malformed and unreachable addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_add_brings_in_a_lone_empty_node() {
    let nodes = start_cluster(1, &[]);
    let a = &nodes[0];
    let http = common::client_builder().timeout(Duration::from_secs(120)).build().unwrap();
    wait_for(&http, &a.u("/v1/cluster"), "the founder active", |v| member_states(v) == ["active"]).await;
    assert_eq!(http.put(a.u("/v1/collections/c")).send().await.unwrap().status().as_u16(), 201);
    const KEYS: i64 = 60;
    for i in 0..KEYS {
        let (status, body) = put(&http, a, &format!("k{i}"), i, "none").await;
        assert_eq!(status, 200, "{body}");
    }
    // Lone nodes of their own, no shared secret: one empty, one holding a collection.
    let plain = ["--partitions", PARTITIONS, "--analytics-partitions", "0"];
    let mut b = Node::start(&plain);
    b.pin_port();
    let c = Node::start(&plain);
    wait_for(&http, &b.u("/v1/cluster"), "b founded its own cluster", |v| member_states(v) == ["active"]).await;
    wait_for(&http, &c.u("/v1/cluster"), "c founded its own cluster", |v| member_states(v) == ["active"]).await;
    assert_eq!(http.put(c.u("/v1/collections/mine")).send().await.unwrap().status().as_u16(), 201);
    let b_id = get_json(&http, &b.u("/v1/cluster")).await.1["node"].as_u64().unwrap();

    let (ok, _, err) = a.cli(&["cluster", "add", &c.addr()]);
    assert!(!ok && err.contains("holds collections"), "a node with collections is refused: {err}");
    // A lone node given a secret of its own on the command line would pass it again at
    // every start, and the cluster would refuse it: refused now.
    let d = Node::start(&[&plain[..], &["--cluster-secret", "some-other-secret"]].concat());
    wait_for(&http, &d.u("/v1/cluster"), "d founded its own cluster", |v| member_states(v) == ["active"]).await;
    let (ok, _, err) = a.cli(&["cluster", "add", &d.addr()]);
    assert!(!ok && err.contains("--cluster-secret"), "a node started with another secret is refused: {err}");
    for bad in ["no-port", "host:0", "host:99999", "a/b:80", ""] {
        let r = http.post(a.u("/v1/cluster/nodes")).json(&json!({"address": bad})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "address {bad:?}");
    }
    // CLUSTER_BODY_MAX_BYTES (64 KiB) for the body of a cluster call, this one included.
    let oversized = format!(r#"{{"address": "{}:1"}}"#, "h".repeat(64 * 1024));
    let r = http.post(a.u("/v1/cluster/nodes")).body(oversized).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 413, "an oversized body");
    for body in ["{", "[]", r#"{"address": "x:1", "extra": 1}"#, r#"{"address": 7}"#, r#"{"address": "x:1", "password": "p"}"#] {
        let r = http.post(a.u("/v1/cluster/nodes")).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "body {body}");
    }
    let (ok, _, err) = a.cli(&["cluster", "add", "127.0.0.1:1"]);
    assert!(!ok && err.contains("unreachable"), "an address where nothing listens: {err}");
    let (ok, _, err) = a.cli(&["cluster", "add", &a.addr()]);
    assert!(!ok && err.contains("already a member"), "{err}");
    // An invitation is taken only with the credentials of one of the invited node's
    // administrators: none, a wrong password or a user without the right get 401/403.
    let admin = common::admin_auth();
    let anyone = common::plain_client_builder().build().unwrap();
    for (creds, status) in [
        (None, 401),
        (Some(common::basic_auth("admin", "not-the-password")), 401),
        (Some(common::basic_auth("stranger", common::ADMIN_PASSWORD)), 401),
    ] {
        let mut invitation = json!({"join": a.addr(), "secret": SECRET});
        if let Some(creds) = creds {
            invitation["admin"] = json!(creds);
        }
        let r = anyone.post(b.u("/v1/_internal/invite")).json(&invitation).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "invitation {invitation}");
    }
    let r = http
        .put(b.u("/v1/users/watcher"))
        .json(&json!({"password": "watcher-password", "roles": ["metrics_reader"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let as_watcher = json!({"join": a.addr(), "secret": SECRET, "admin": common::basic_auth("watcher", "watcher-password")});
    let r = anyone.post(b.u("/v1/_internal/invite")).json(&as_watcher).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 403, "a user of b who is no administrator");
    // A forged invitation (no secret) to a node with collections changes nothing there.
    let r = http
        .post(c.u("/v1/_internal/invite"))
        .json(&json!({"join": a.addr(), "secret": "forged-secret", "admin": admin}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    assert_eq!(get_json(&http, &c.u("/v1/collections")).await.1.as_array().map(Vec::len), Some(1));
    // Malformed invitations to the lone node: a clear 400, and it stays as it was.
    for body in ["", "{", "[]", r#"{"join": 7}"#, r#"{"secret": "s"}"#, "\u{0}\u{1}garbage", r#"{"join": "x:1", "secret": "s", "more": 1}"#]
    {
        let r = http.post(b.u("/v1/_internal/invite")).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "invite body {body:?}");
    }
    // Well-formed but forged invitations to the lone node: the cluster they name does not
    // answer to their secret (or is not there, or takes the call and never answers: the
    // check gives up after its timeout), so the node keeps serving alone.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
        }
    });
    for (join, secret) in [
        (a.addr(), "forged-secret".to_string()),
        ("127.0.0.1:1".to_string(), SECRET.to_string()),
        (String::new(), String::new()),
        (silent_addr, SECRET.to_string()),
    ] {
        let r = http.post(b.u("/v1/_internal/invite")).json(&json!({"join": join, "secret": secret, "admin": admin})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 409, "forged invitation to {join:?}");
        assert!(r.text().await.unwrap().contains("does not check out"), "forged invitation to {join:?}");
    }
    held.abort();
    assert!(!b.dir.join("join-request.json").exists(), "no invitation kept from a malformed or forged one");
    assert_eq!(get_json(&http, &b.u("/v1/cluster")).await.1["nodes"].as_array().map(Vec::len), Some(1), "b is still alone");

    let (ok, out, err) = a.cli(&["cluster", "add", &b.addr()]);
    assert!(ok, "cluster add: {out} {err}");
    assert!(out.contains("is added"), "{out}");
    let info = get_json(&http, &a.u("/v1/cluster")).await.1;
    let b_info = info["nodes"].as_array().unwrap().iter().find(|n| n["address"] == b.addr()).cloned().unwrap();
    assert_eq!((b_info["id"].as_u64(), b_info["state"].as_str()), (Some(b_id), Some("added")), "{info}");
    let (ok, _, err) = a.cli(&["cluster", "add", &b.addr()]);
    assert!(!ok && err.contains("already a member"), "adding twice: {err}");
    // The restarted node speaks for the cluster it joined, with its secret.
    wait_for(&http, &b.u("/v1/cluster"), "b in a's cluster", |v| v["cluster_id"] == info["cluster_id"]).await;
    assert_eq!(std::fs::read_to_string(b.dir.join("cluster-secret")).unwrap().trim(), SECRET);
    let request = b.dir.join("join-request.json");
    common::eventually(60, "the invitation is forgotten once joined", || {
        let gone = !request.exists();
        async move { gone }
    })
    .await;

    // Brought in by the command line's rebalance, which draws its progress and says how long
    // it took.
    let (ok, out, err) = a.cli(&["cluster", "rebalance"]);
    assert!(ok, "cluster rebalance: {out} {err}");
    let done = out.lines().find(|l| l.starts_with("rebalance done: ")).unwrap_or_default();
    let secs: Option<f64> = done.rsplit_once(" in ").and_then(|(_, t)| t.strip_suffix(" s")).and_then(|t| t.parse().ok());
    assert!(secs.is_some_and(|s| s > 0.0) && done.contains("copies built"), "{out}");
    let (_, map) = get_json(&http, &b.u("/v1/cluster/map")).await;
    assert!(map["partitions"].as_array().unwrap().iter().any(|p| p["active"].as_u64() == Some(b_id)), "b holds actives: {map}");
    for i in 0..KEYS {
        let (status, v) = get_json(&http, &b.u(&format!("/v1/collections/c/docs/k{i}"))).await;
        assert_eq!((status, v["v"].as_i64()), (200, Some(i)), "k{i} through the added node");
    }
}

/// Multi-dimensional scaling (issue 41, Couchbase's services): a node started with
/// `--services index,query` joins, says what it runs in `GET /v1/cluster`, and a rebalance
/// gives it no data partition — it still answers requests for keys, forwarding them; and a
/// first node without `data`, or a service no one knows, is refused at start with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_without_the_data_service_holds_no_partitions() {
    let args = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", PARTITIONS];
    let mut first = Node::start(&[&args[..], &["--services", "data,query"]].concat());
    first.pin_port();
    let join = first.addr();
    let second = joined(&[&args[..], &["--services", "index,query"]].concat(), &join);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &first.u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    rebalance(&http, &first, &[]).await;
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    let nodes = info["nodes"].as_array().expect("nodes");
    let of = |node: &Node| nodes.iter().find(|n| n["address"] == node.addr()).cloned().unwrap_or(Value::Null);
    assert_eq!(of(&first)["services"], json!(["data", "query"]), "{info}");
    assert_eq!(of(&second)["services"], json!(["index", "query"]), "{info}");
    assert_eq!(of(&second)["partitions"], json!({"active": 0, "replica": 0}), "{info}");
    assert_eq!(of(&first)["partitions"]["active"].as_u64(), PARTITIONS.parse::<u64>().ok(), "{info}");
    assert_eq!(http.put(second.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let (status, body) = put(&http, &second, "k1", 1, "persist").await;
    assert_eq!(status, 200, "{body}");
    let got: Value = http.get(second.u("/v1/collections/c/docs/k1")).send().await.unwrap().json().await.unwrap();
    assert_eq!(got["v"], 1, "{got}");
    // One index node (running index without data): an index is placed on it whole, with no
    // replica, since a replica must be on another index node.
    let create = |body: Value| http.post(first.u("/v1/collections/c/indexes")).json(&body).send();
    let r = create(json!({"name": "r1", "keys": ["v"], "replicas": 1})).await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["reason"].as_str().unwrap_or("").contains("fewer replicas than the cluster has index nodes (1)"), "{v}");
    assert_eq!(create(json!({"name": "r0", "keys": ["v"], "partitions": 4})).await.unwrap().status(), 201);
    let listed =
        wait_for(&http, &second.u("/v1/collections/c/indexes"), "r0 on the index node", |v| v.as_array().is_some_and(|l| !l.is_empty()))
            .await;
    assert_eq!(listed[0]["partitions_here"], json!([0, 1, 2, 3]), "{listed}");
    let (_, on_first) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    assert_eq!(on_first[0]["partitions_here"], json!([]), "the data node holds none of it: {on_first}");

    // Refused at start: an unknown service (by the command line), and a first node that
    // holds no data (by the cluster it would found).
    for (services, why) in [("data,search", "no service named \"search\""), ("index", "the first node of a cluster holds its data")] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(common::binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--services", services])
            .arg("--data-path")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "--services {services} started");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(why), "--services {services}: {stderr}");
    }
}

/// The index service's feed: a node running `index` and not `data` holds no partition; the
/// index placed on it follows every partition's active on the data nodes over the network, and a scan
/// asked of it is answered there alone — exactly, at `request_plus`, through updates that
/// move entries between the index's parts and through deletes.
#[tokio::test]
async fn an_index_node_follows_every_active_and_answers_scans_alone() {
    let base = ["--cluster-secret", SECRET, "--analytics-partitions", "0", "--partitions", PARTITIONS];
    // Data nodes without the index service: the index goes to the index node alone.
    let args = [&base[..], &["--services", "data,query"]].concat();
    let mut first = Node::start(&args);
    first.pin_port();
    let join = first.addr();
    let _second = joined(&args, &join);
    let http = common::client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    wait_for(&http, &first.u("/v1/cluster"), "two members", |v| member_states(v).len() == 2).await;
    rebalance(&http, &first, &[]).await;
    let index_node = joined(&[&base[..], &["--services", "index,query"]].concat(), &join);
    wait_for(&http, &first.u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    rebalance(&http, &first, &[]).await;
    assert_eq!(http.put(first.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    let create = json!({"name": "by_v", "keys": ["v"], "partitions": 4});
    assert_eq!(http.post(first.u("/v1/collections/c/indexes")).json(&create).send().await.unwrap().status(), 201);
    let mut model: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    for i in 0..120 {
        let key = format!("k{i:03}");
        let (status, body) = put(&http, &first, &key, i % 7, "none").await;
        assert_eq!(status, 200, "{body}");
        model.insert(key, i % 7);
    }
    let scan = |bounds: Value| {
        let (http, url) = (http.clone(), index_node.u("/v1/collections/c/indexes/by_v/scan"));
        async move {
            let mut body = bounds;
            body["consistency"] = json!("request_plus");
            body["timeout_ms"] = json!(60_000);
            let r = http.post(url).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            assert_eq!(status, 200, "{v}");
            v["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string()))
                .collect::<Vec<_>>()
        }
    };
    let want = |model: &std::collections::BTreeMap<String, i64>, only: Option<i64>| {
        let mut rows: Vec<(i64, String)> =
            model.iter().filter(|(_, v)| only.is_none_or(|o| **v == o)).map(|(k, v)| (*v, k.clone())).collect();
        rows.sort();
        rows
    };
    assert_eq!(scan(json!({"eq": [3]})).await, want(&model, Some(3)), "one part, from both data nodes' actives");
    assert_eq!(scan(json!({})).await, want(&model, None), "every part, merged");
    // Updates move entries between parts; deletes remove them.
    for i in (0..120).step_by(5) {
        let key = format!("k{i:03}");
        let (status, body) = put(&http, &first, &key, 100 + i, "none").await;
        assert_eq!(status, 200, "{body}");
        model.insert(key, 100 + i);
    }
    for i in (1..120).step_by(9) {
        let key = format!("k{i:03}");
        let status = http.delete(first.u(&format!("/v1/collections/c/docs/{key}"))).send().await.unwrap().status();
        assert_eq!(status, 200);
        model.remove(&key);
    }
    assert_eq!(scan(json!({"eq": [3]})).await, want(&model, Some(3)));
    assert_eq!(scan(json!({})).await, want(&model, None));
    // A third data node comes in and the partitions move while writes and request_plus
    // scans go on: every answer is the model's or a 503 to retry, and the index node's
    // entries are never rebuilt (moving a data partition moves no index entry).
    let _third = joined(&args, &join);
    wait_for(&http, &first.u("/v1/cluster"), "four members", |v| member_states(v).len() == 4).await;
    let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(started.status().as_u16(), 202);
    let (mut exact, mut refused, mut round) = (0, 0, 0i64);
    loop {
        let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
        let running = status["state"] == "running";
        round += 1;
        for i in (0..120).step_by(11) {
            let key = format!("k{i:03}");
            let (code, body) = put(&http, &first, &key, 1000 + round * 200 + i, "none").await;
            if code == 200 {
                model.insert(key, 1000 + round * 200 + i);
            } else {
                assert_eq!(code, 503, "{body}");
            }
        }
        let url = index_node.u("/v1/collections/c/indexes/by_v/scan");
        let r = http.post(url).json(&json!({"consistency": "request_plus", "timeout_ms": 60_000})).send().await.unwrap();
        match r.status().as_u16() {
            200 => {
                let v: Value = r.json().await.unwrap();
                let rows: Vec<(i64, String)> = v["rows"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string()))
                    .collect();
                assert_eq!(rows, want(&model, None), "scan {round} while partitions move");
                exact += 1;
            }
            503 => refused += 1,
            other => panic!("scan {round}: {other} {}", r.text().await.unwrap_or_default()),
        }
        if !running {
            assert_eq!(status["state"], "done", "{status}");
            break;
        }
    }
    eprintln!("scans while the partitions moved: {exact} exact, {refused} refused, {round} rounds");
    assert!(exact > 0, "{exact} exact answers, {refused} refused");
    assert_eq!(scan(json!({})).await, want(&model, None), "after the rebalance");
    // The index node holds no document: every entry came over the network, and it holds
    // all of them (a node indexing only what it holds would have none).
    let (_, list) = get_json(&http, &index_node.u("/v1/collections/c/indexes")).await;
    assert_eq!(list[0]["items"].as_u64(), Some(model.len() as u64), "{list}");
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    let me = info["nodes"].as_array().unwrap().iter().find(|n| n["address"] == index_node.addr()).cloned().unwrap();
    assert_eq!(me["partitions"], json!({"active": 0, "replica": 0}), "{info}");
}

/// Issue 41: with nodes running the index service alone, an index is placed on them — its
/// partitions and their replicas on distinct index nodes, none on the data nodes — and a
/// scan asked of any member reads one copy of each partition it needs where it is placed:
/// an `eq` one partition, anything else each partition once, merged in index order. Answers
/// are compared with a model from every member; a killed index node's parts are read from
/// their replicas, and a scan that needs a part with no live copy is refused, never short.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_placed_index_is_read_where_its_partitions_are_from_any_node() {
    let IndexCluster { first, second, mut a, b, http, .. } = index_cluster().await;
    // Bad input for the new fields: refused, and nothing is created.
    for bad in [
        json!({"name": "bad", "keys": ["v"], "replicas": 2}),
        json!({"name": "bad", "keys": ["v"], "partitions": 0}),
        json!({"name": "bad", "keys": ["v"], "partitions": 10_000}),
        json!({"name": "bad", "keys": ["v"], "replicas": "one"}),
    ] {
        let r = http.post(first.u("/v1/collections/c/indexes")).json(&bad).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "{bad}: {}", r.text().await.unwrap_or_default());
    }
    let by_v = json!({"name": "by_v", "keys": ["v"], "partitions": 8});
    let by_w = json!({"name": "by_w", "keys": ["w"], "partitions": 6, "replicas": 1});
    for def in [&by_v, &by_w] {
        let r = http.post(first.u("/v1/collections/c/indexes")).json(def).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap_or_default());
    }
    // Placement: by_v's 8 partitions split between the index nodes, by_w's 6 on both; the
    // data nodes hold none.
    let listing = |node: &Node| {
        let (http, url) = (http.clone(), node.u("/v1/collections/c/indexes"));
        async move {
            let (_, list) = get_json(&http, &url).await;
            list.as_array().unwrap().iter().map(|i| (i["name"].as_str().unwrap().to_string(), i.clone())).collect::<BTreeMap<_, _>>()
        }
    };
    for node in [&first, &second, &a, &b] {
        wait_for(&http, &node.u("/v1/collections/c/indexes"), "both indexes on every member", |v| {
            v.as_array().is_some_and(|l| l.len() == 2)
        })
        .await;
    }
    let here = |v: &Value| v["partitions_here"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap() as u16).collect::<Vec<u16>>();
    let (on_a, on_b, on_first) = (listing(&a).await, listing(&b).await, listing(&first).await);
    let placement = on_a["by_v"]["placement"].clone();
    assert_eq!(placement.as_array().unwrap().len(), 8, "{placement}");
    let mut all: Vec<u16> = here(&on_a["by_v"]).into_iter().chain(here(&on_b["by_v"])).collect();
    all.sort();
    assert_eq!(all, (0..8).collect::<Vec<u16>>(), "each partition of by_v on one index node");
    assert_eq!(here(&on_a["by_v"]).len(), 4, "balanced: {placement}");
    assert_eq!((here(&on_a["by_w"]).len(), here(&on_b["by_w"]).len()), (6, 6), "by_w's replicas on the other node");
    assert!(here(&on_first["by_v"]).is_empty() && here(&on_first["by_w"]).is_empty(), "{on_first:?}");
    // Documents, updates that move entries between parts, deletes.
    let mut model: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for i in 0..150i64 {
        let key = format!("k{i:03}");
        let r = http.put(first.u(&format!("/v1/collections/c/docs/{key}"))).json(&json!({"v": i % 7, "w": i % 5})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        model.insert(key, (i % 7, i % 5));
    }
    for i in (0..150i64).step_by(4) {
        let key = format!("k{i:03}");
        let r = http.put(first.u(&format!("/v1/collections/c/docs/{key}"))).json(&json!({"v": 10 + i % 3, "w": 7})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        model.insert(key, (10 + i % 3, 7));
    }
    for i in (1..150i64).step_by(9) {
        let key = format!("k{i:03}");
        assert_eq!(http.delete(first.u(&format!("/v1/collections/c/docs/{key}"))).send().await.unwrap().status(), 200);
        model.remove(&key);
    }
    let want = |field: usize, keep: &dyn Fn(i64) -> bool| {
        let mut rows: Vec<(i64, String)> =
            model.iter().map(|(k, (v, w))| (if field == 0 { *v } else { *w }, k.clone())).filter(|(x, _)| keep(*x)).collect();
        rows.sort();
        rows
    };
    let scan = |node: &Node, index: &str, mut body: Value| {
        let (http, url) = (http.clone(), node.u(&format!("/v1/collections/c/indexes/{index}/scan")));
        body["consistency"] = json!("request_plus");
        body["timeout_ms"] = json!(60_000);
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            (status, v)
        }
    };
    let rows_of = |v: &Value| -> Vec<(i64, String)> {
        v["rows"].as_array().unwrap().iter().map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string())).collect()
    };
    for node in [&first, &second, &a, &b] {
        for (index, field) in [("by_v", 0), ("by_w", 1)] {
            let (status, v) = scan(node, index, json!({"eq": [3]})).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(rows_of(&v), want(field, &|x| x == 3), "{index} eq from {}", node.addr());
            let (status, v) = scan(node, index, json!({})).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(rows_of(&v), want(field, &|_| true), "{index} whole from {}", node.addr());
            let (status, v) = scan(node, index, json!({"range": {"low": [2], "high": [10], "inclusive_high": false}})).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(rows_of(&v), want(field, &|x| (2..10).contains(&x)), "{index} range from {}", node.addr());
            let (status, v) = scan(node, index, json!({"descending": true, "limit": 10})).await;
            assert_eq!(status, 200, "{v}");
            let mut top = want(field, &|_| true);
            top.reverse();
            top.truncate(10);
            assert_eq!(rows_of(&v), top, "{index} descending, limited, from {}", node.addr());
        }
        // Documents come from their actives, wherever the rows came from.
        let (status, v) = scan(node, "by_v", json!({"eq": [11], "include_docs": true})).await;
        assert_eq!(status, 200, "{v}");
        let docs: Vec<(String, Value)> =
            v["rows"].as_array().unwrap().iter().map(|r| (r["id"].as_str().unwrap().to_string(), r["doc"].clone())).collect();
        let want_docs: Vec<(String, Value)> =
            model.iter().filter(|(_, (v, _))| *v == 11).map(|(k, (v, w))| (k.clone(), json!({"v": v, "w": w}))).collect();
        assert_eq!(docs, want_docs, "include_docs from {}", node.addr());
    }
    // A client cannot ask for some partitions only.
    let r = http.post(a.u("/v1/collections/c/indexes/by_v/scan")).json(&json!({"parts": [0]})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    // SQL reads the placed index where it is (EXPLAIN says so), then the documents by key
    // from their actives.
    for node in [&first, &a] {
        let ask = |sql: &str| {
            let (http, url) = (http.clone(), node.u("/v1/query"));
            let body = json!({"sql": sql, "consistency": "request_plus"});
            async move {
                let r = http.post(url).json(&body).send().await.unwrap();
                let status = r.status().as_u16();
                let v: Value = r.json().await.unwrap();
                assert_eq!(status, 200, "{v}");
                v
            }
        };
        let v = ask("SELECT meta_id, w FROM c WHERE v = 3 ORDER BY meta_id").await;
        let got: Vec<(String, i64)> =
            v["rows"].as_array().unwrap().iter().map(|r| (r[0].as_str().unwrap().to_string(), r[1].as_i64().unwrap())).collect();
        let want: Vec<(String, i64)> = model.iter().filter(|(_, (v, _))| *v == 3).map(|(k, (_, w))| (k.clone(), *w)).collect();
        assert_eq!(got, want, "SQL through the placed index from {}", node.addr());
        let plan = ask("EXPLAIN SELECT meta_id FROM c WHERE v = 3").await.to_string();
        assert!(plan.contains("index=by_v") && plan.contains("on index nodes"), "{plan}");
    }
    // Entries live on the index nodes only: by_v's split between them, none on data nodes.
    let (on_a, on_b, on_first) = (listing(&a).await, listing(&b).await, listing(&first).await);
    assert_eq!(on_a["by_v"]["items"].as_u64().unwrap() + on_b["by_v"]["items"].as_u64().unwrap(), model.len() as u64);
    assert_eq!(on_a["by_w"]["items"].as_u64(), Some(model.len() as u64));
    assert_eq!(on_first["by_v"]["items"].as_u64(), Some(0));
    // Index node a dies: by_w is read from its replicas on b; by_v answers for the values
    // whose partition b holds and refuses the others (503), never a short answer.
    let on_b_parts = here(&on_b["by_v"]);
    a.kill9();
    for node in [&first, &b] {
        let (status, v) = scan(node, "by_w", json!({})).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(rows_of(&v), want(1, &|_| true), "by_w from {} with a down", node.addr());
        let (status, v) = scan(node, "by_v", json!({})).await;
        assert_eq!(status, 503, "by_v needs a's partitions: {v}");
        for value in 0..7i64 {
            let part = shoal_index::partition::part_of_value(Some(&json!(value)), 8);
            let (status, v) = scan(node, "by_v", json!({"eq": [value]})).await;
            if on_b_parts.contains(&part) {
                assert_eq!(status, 200, "{v}");
                assert_eq!(rows_of(&v), want(0, &|x| x == value));
            } else {
                assert_eq!(status, 503, "value {value} lives in a partition only a held: {v}");
            }
        }
    }
    drop(second);
}

/// Issue 41 (seed 000): a rebalance moves index partitions as files. A third index node
/// joins while writes and `request_plus` scans run; the rebalance places some copies of
/// every index on it, each adopted as the files of a live copy (none rebuilt), and switches
/// the placement once they have caught up. Every scan answer, from any node, is the
/// model's or a 503; afterwards each node holds exactly the partitions placed on it. Then
/// the new node is killed: the index with replicas is read from the other copies, the one
/// without is placed again by the failover and rebuilt, and the next rebalance gives the
/// index with replicas its lost copies back as the files of the copies left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn index_partitions_move_as_files_when_an_index_node_joins() {
    let IndexCluster { first, second: _second, a, b, join, http } = index_cluster().await;
    for def in
        [json!({"name": "by_v", "keys": ["v"], "partitions": 8, "replicas": 1}), json!({"name": "by_x", "keys": ["x"], "partitions": 6})]
    {
        let r = http.post(first.u("/v1/collections/c/indexes")).json(&def).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 201, "{}", r.text().await.unwrap_or_default());
    }
    let mut model: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let write = |i: i64, round: i64| {
        let (http, url) = (http.clone(), first.u(&format!("/v1/collections/c/docs/k{i:03}")));
        let doc = (i % 7 + round * 10, i % 5 + round);
        async move {
            let r = http.put(url).json(&json!({"v": doc.0, "x": doc.1})).send().await.unwrap();
            (r.status().as_u16(), i, doc)
        }
    };
    for i in 0..200 {
        let (status, i, doc) = write(i, 0).await;
        assert_eq!(status, 200);
        model.insert(format!("k{i:03}"), doc);
    }
    let want = |model: &BTreeMap<String, (i64, i64)>, index: &str| {
        let mut rows: Vec<(i64, String)> = model.iter().map(|(k, (v, x))| (if index == "by_v" { *v } else { *x }, k.clone())).collect();
        rows.sort();
        rows
    };
    let scan = |node: &Node, index: &str| {
        let (http, url) = (http.clone(), node.u(&format!("/v1/collections/c/indexes/{index}/scan")));
        async move {
            let r = http.post(url).json(&json!({"consistency": "request_plus", "timeout_ms": 60_000})).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            let rows: Vec<(i64, String)> = v["rows"]
                .as_array()
                .map(|rows| rows.iter().map(|r| (r["key"][0].as_i64().unwrap(), r["id"].as_str().unwrap().to_string())).collect())
                .unwrap_or_default();
            (status, rows, v)
        }
    };
    for index in ["by_v", "by_x"] {
        let (status, rows, v) = scan(&a, index).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(rows, want(&model, index));
    }
    let c = joined(&index_node_args(), &join);
    wait_for(&http, &first.u("/v1/cluster"), "five members", |v| member_states(v).len() == 5).await;
    let started = http.post(first.u("/v1/cluster/rebalance")).json(&json!({})).send().await.unwrap();
    assert_eq!(started.status().as_u16(), 202);
    let (mut exact, mut refused, mut round) = (0, 0, 0i64);
    let status = loop {
        let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
        round += 1;
        for i in (0..200).step_by(13) {
            let (code, i, doc) = write(i, round).await;
            if code == 200 {
                model.insert(format!("k{i:03}"), doc);
            } else {
                assert_eq!(code, 503);
            }
        }
        for (node, index) in [(&first, "by_v"), (&a, "by_x"), (&b, "by_v")] {
            let (code, rows, v) = scan(node, index).await;
            match code {
                200 => {
                    assert_eq!(rows, want(&model, index), "{index} from {} in round {round}", node.addr());
                    exact += 1;
                }
                503 => refused += 1,
                other => panic!("{index}: {other} {v}"),
            }
        }
        if status["state"] != "running" {
            break status;
        }
    };
    eprintln!("scans while index partitions moved: {exact} exact, {refused} refused, {round} rounds");
    assert_eq!(status["state"], "done", "{status}");
    assert!(exact > 0);
    let index_moves: Vec<&Value> = status["moves"].as_array().unwrap().iter().filter(|m| m["kind"] == "index").collect();
    assert!(!index_moves.is_empty(), "the new node takes index copies: {status}");
    assert!(index_moves.iter().all(|m| m["method"] == "files"), "adopted as files, none rebuilt: {index_moves:?}");
    // Every node holds exactly what the placement names, once the old copies drained.
    let (_, info) = get_json(&http, &first.u("/v1/cluster")).await;
    for node in [&a, &b, &c, &first] {
        let id = node_id(&info, node).unwrap();
        let placed_here = |v: &Value, index: &str| -> (Vec<u64>, Vec<u64>) {
            let entry = v.as_array().unwrap().iter().find(|i| i["name"] == index).cloned().unwrap_or(Value::Null);
            let placement = entry["placement"].as_array().cloned().unwrap_or_default();
            let want: Vec<u64> =
                (0..placement.len() as u64).filter(|p| placement[*p as usize].as_array().unwrap().contains(&json!(id))).collect();
            let here: Vec<u64> =
                entry["partitions_here"].as_array().cloned().unwrap_or_default().iter().map(|p| p.as_u64().unwrap()).collect();
            (want, here)
        };
        wait_for(&http, &node.u("/v1/collections/c/indexes"), "the placed partitions and no others", |v| {
            ["by_v", "by_x"].iter().all(|index| {
                let (want, here) = placed_here(v, index);
                want == here
            })
        })
        .await;
    }
    let (_, on_c) = get_json(&http, &c.u("/v1/collections/c/indexes")).await;
    assert!(on_c.as_array().unwrap().iter().all(|i| !i["partitions_here"].as_array().unwrap().is_empty()), "{on_c}");
    for (node, index) in [(&c, "by_v"), (&c, "by_x"), (&first, "by_x"), (&b, "by_v")] {
        let (code, rows, v) = scan(node, index).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(rows, want(&model, index), "{index} from {} after the rebalance", node.addr());
    }
    // The new node dies: by_v's copies on the others answer; by_x has no replicas, and a
    // whole scan of it needs c's partitions: refused, never short.
    let mut c = c;
    c.kill9();
    for node in [&first, &a] {
        let (code, rows, v) = scan(node, "by_v").await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(rows, want(&model, "by_v"));
        let (code, _, v) = scan(node, "by_x").await;
        assert_eq!(code, 503, "{v}");
    }
    // The failover takes c out of the placement: by_v's parts c held are read from their
    // other copy, and by_x's (no replica) are placed again and rebuilt from the streams.
    let c_id = node_id(&info, &c).unwrap();
    wait_for(&http, &first.u("/v1/cluster"), "failover of c", |v| {
        v["nodes"].as_array().is_some_and(|a| a.iter().any(|n| n["id"].as_u64() == Some(c_id) && n["state"] == "failed"))
    })
    .await;
    for (node, index) in [(&first, "by_x"), (&a, "by_v"), (&b, "by_x")] {
        // A part rebuilt from the streams serves once it has caught up: until then, 503.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (code, rows, v) = scan(node, index).await;
            if code == 200 {
                assert_eq!(rows, want(&model, index), "{index} from {} after c's failover", node.addr());
                break;
            }
            assert_eq!(code, 503, "{index} after c's failover: {v}");
            assert!(Instant::now() < deadline, "{index} never answered after c's failover: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // The next rebalance gives by_v back its second copy of every part c held, as the files
    // of the copy that is left; none is rebuilt.
    common::cluster::rebalance_when_possible(&http, &first, &[c_id]).await;
    let (_, status) = get_json(&http, &first.u("/v1/cluster/rebalance")).await;
    let by_v_moves: Vec<&Value> =
        status["moves"].as_array().unwrap().iter().filter(|m| m["kind"] == "index" && m["index"] == "c.by_v").collect();
    assert!(!by_v_moves.is_empty(), "the lost replicas are copied again: {status}");
    assert!(by_v_moves.iter().all(|m| m["method"] == "files"), "from a live copy's files: {by_v_moves:?}");
    let (_, listed) = get_json(&http, &first.u("/v1/collections/c/indexes")).await;
    let by_v = listed.as_array().unwrap().iter().find(|i| i["name"] == "by_v").cloned().unwrap();
    let (a_id, b_id) = (node_id(&info, &a).unwrap(), node_id(&info, &b).unwrap());
    for copies in by_v["placement"].as_array().unwrap() {
        let mut copies: Vec<u64> = copies.as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
        copies.sort_unstable();
        let mut both = vec![a_id, b_id];
        both.sort_unstable();
        assert_eq!(copies, both, "two copies of every part on the index nodes left: {by_v}");
    }
    for (node, index) in [(&a, "by_v"), (&b, "by_v"), (&first, "by_x"), (&first, "by_v")] {
        let (code, rows, v) = scan(node, index).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(rows, want(&model, index), "{index} from {} after the repair's rebalance", node.addr());
    }
}
