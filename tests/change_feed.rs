//! The change feed over HTTP: resumable tokens, longpoll, continuous, include_docs, and
//! the rollback line after an unclean restart.

mod common;

use std::time::Duration;

use common::{ndjson, Node};
use futures::StreamExt;
use serde_json::Value;

fn last_token(lines: &[Value]) -> String {
    lines.last().and_then(|l| l["last"].as_str()).expect("a feed ends with a last line").to_string()
}

#[tokio::test]
async fn tokens_resume_exactly_after_the_last_line() {
    let node = Node::start(&["--partitions", "8"]);
    let c = node.client();
    c.put(node.u("/v1/collections/f")).send().await.unwrap();
    for i in 0..30 {
        c.put(node.u(&format!("/v1/collections/f/docs/k{i}"))).body(format!("{i}")).send().await.unwrap();
    }
    c.delete(node.u("/v1/collections/f/docs/k3")).send().await.unwrap();
    let mut token = String::new();
    let mut keys = Vec::new();
    let mut seen = Vec::new();
    loop {
        let url = if token.is_empty() {
            node.u("/v1/collections/f/changes?limit=7")
        } else {
            node.u(&format!("/v1/collections/f/changes?limit=7&since={token}"))
        };
        let lines = ndjson(&c.get(url).send().await.unwrap().text().await.unwrap());
        let changes: Vec<_> = lines.iter().filter(|l| l.get("key").is_some()).collect();
        assert!(changes.len() <= 7);
        for ch in &changes {
            let at = (ch["partition"].as_u64().unwrap(), ch["seqno"].as_u64().unwrap());
            assert!(!seen.contains(&at), "change {at:?} delivered twice");
            seen.push(at);
            keys.push((ch["key"].as_str().unwrap().to_string(), ch["deleted"].as_bool().unwrap()));
        }
        token = last_token(&lines);
        if changes.is_empty() {
            break;
        }
    }
    // Replaying the feed gives the final state: 29 live documents and k3 deleted last.
    let mut state = std::collections::BTreeMap::new();
    for (key, deleted) in keys {
        state.insert(key, deleted);
    }
    assert_eq!(state.len(), 30);
    assert_eq!(state.values().filter(|d| **d).count(), 1);
    assert_eq!(state.get("k3"), Some(&true));
    // Nothing new: the same token gives nothing.
    let lines = ndjson(&c.get(node.u(&format!("/v1/collections/f/changes?since={token}"))).send().await.unwrap().text().await.unwrap());
    assert_eq!(lines.len(), 1);
}

#[tokio::test]
async fn longpoll_waits_for_a_change_and_continuous_streams() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/f")).send().await.unwrap();
    let head = ndjson(&c.get(node.u("/v1/collections/f/changes")).send().await.unwrap().text().await.unwrap());
    let token = last_token(&head);
    let poll = {
        let (c, url) = (c.clone(), node.u(&format!("/v1/collections/f/changes?feed=longpoll&include_docs=true&since={token}")));
        tokio::spawn(async move { c.get(url).send().await.unwrap().text().await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!poll.is_finished(), "longpoll returned before any change");
    c.put(node.u("/v1/collections/f/docs/new")).body("{\"hello\":1}").send().await.unwrap();
    let lines = ndjson(&tokio::time::timeout(Duration::from_secs(10), poll).await.unwrap().unwrap());
    assert_eq!(lines[0]["key"], "new");
    assert_eq!(lines[0]["doc"]["hello"], 1);

    // A longpoll with nothing to say ends at its timeout with the same position.
    let lines = ndjson(
        &c.get(node.u(&format!("/v1/collections/f/changes?feed=longpoll&timeout=200&since={}", last_token(&lines))))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    assert_eq!(lines.len(), 1);

    let resp = c.get(node.u("/v1/collections/f/changes?feed=continuous&timeout=5000")).send().await.unwrap();
    let mut stream = resp.bytes_stream();
    let writer = {
        let (c, url) = (c.clone(), node.url.clone());
        tokio::spawn(async move {
            for i in 0..5 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                c.put(format!("{url}/v1/collections/f/docs/live{i}")).body("1").send().await.unwrap();
            }
        })
    };
    let mut text = String::new();
    while !(0..5).all(|i| text.contains(&format!("\"live{i}\""))) {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.expect("continuous feed stalled").unwrap().unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    writer.await.unwrap();
}

#[tokio::test]
async fn rollback_line_after_unclean_restart() {
    let mut node = Node::start(&["--partitions", "4"]);
    let c = node.client();
    c.put(node.u("/v1/collections/f")).send().await.unwrap();
    for i in 0..20 {
        c.put(node.u(&format!("/v1/collections/f/docs/k{i}"))).body("1").send().await.unwrap();
    }
    let token = last_token(&ndjson(&c.get(node.u("/v1/collections/f/changes")).send().await.unwrap().text().await.unwrap()));
    node.kill9();
    node.restart();
    let c = node.client();
    let lines = ndjson(&c.get(node.u(&format!("/v1/collections/f/changes?since={token}"))).send().await.unwrap().text().await.unwrap());
    let rollbacks: Vec<_> = lines.iter().filter(|l| l.get("rollback").is_some()).collect();
    assert_eq!(rollbacks.len(), 4, "every partition has a new history: {lines:?}");
    // Writes were in the OS page cache, so nothing was lost and nothing is re-sent.
    assert!(lines.iter().all(|l| l.get("key").is_none()), "{lines:?}");
    // A clean restart keeps the history: no rollback.
    let token = last_token(&lines);
    assert!(node.stop());
    node.restart();
    let lines =
        ndjson(&node.client().get(node.u(&format!("/v1/collections/f/changes?since={token}"))).send().await.unwrap().text().await.unwrap());
    assert_eq!(lines.len(), 1, "{lines:?}");
}
