//! Malformed, oversized and hostile input: every case gets its API.md error code, never a
//! 500 or a crash, and leaves every stored document intact.

mod common;

use common::Node;
use reqwest::{Method, StatusCode};
use serde_json::Value;

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(name: &'static str, method: Method, path: &str, body: impl Into<Vec<u8>>, status: u16, code: &'static str) -> Case {
    Case { name, method, path: path.to_string(), headers: Vec::new(), body: body.into(), status, code }
}

fn with(mut c: Case, header: &'static str, value: &str) -> Case {
    c.headers.push((header, value.to_string()));
    c
}

#[tokio::test]
async fn every_bad_request_gets_its_code_and_loses_nothing() {
    let node = Node::start(&[]);
    let c = node.client();
    c.put(node.u("/v1/collections/c")).send().await.unwrap();
    let mut stored = Vec::new();
    for i in 0..20 {
        let body = format!("{{\"n\":{i}}}");
        c.put(node.u(&format!("/v1/collections/c/docs/k{i}?durability=persist"))).body(body.clone()).send().await.unwrap();
        stored.push((format!("k{i}"), body));
    }
    let lock = c.get(node.u("/v1/collections/c/docs/k0?lock=30")).send().await.unwrap();
    assert_eq!(lock.status(), StatusCode::OK);

    let doc = "/v1/collections/c/docs/k1";
    let cluster: Value = c.get(node.u("/v1/cluster")).send().await.unwrap().json().await.unwrap();
    let map_version = cluster["map_version"].as_u64().expect("a map version").to_string();
    let long_key = "x".repeat(251);
    let over_20_mib = {
        let mut v = b"\"".to_vec();
        v.resize(20 * 1024 * 1024 + 10, b'a');
        v.push(b'"');
        v
    };
    let cases = vec![
        case("not JSON", Method::PUT, doc, "hello", 400, "invalid_json"),
        case("truncated JSON", Method::PUT, doc, "{\"a\": [1, 2", 400, "invalid_json"),
        case("empty body", Method::PUT, doc, "", 400, "invalid_json"),
        case("two values", Method::PUT, doc, "{}{}", 400, "invalid_json"),
        case("invalid UTF-8 body", Method::PUT, doc, vec![b'"', 0xff, 0xfe, b'"'], 400, "invalid_json"),
        case("deep nesting", Method::PUT, doc, format!("{}{}", "[".repeat(5000), "]".repeat(5000)), 400, "invalid_json"),
        case("body over 20 MiB", Method::PUT, doc, over_20_mib, 413, "too_large"),
        case("empty key", Method::PUT, "/v1/collections/c/docs/", "{}", 400, "invalid_key"),
        case("251-byte key", Method::PUT, &format!("/v1/collections/c/docs/{long_key}"), "{}", 400, "invalid_key"),
        case("251-byte key get", Method::GET, &format!("/v1/collections/c/docs/{long_key}"), "", 400, "invalid_key"),
        case("invalid UTF-8 key", Method::PUT, "/v1/collections/c/docs/%FF%FE", "{}", 400, "invalid_key"),
        case("unknown collection", Method::GET, "/v1/collections/nope/docs/k1", "", 404, "collection_not_found"),
        case("unknown collection put", Method::PUT, "/v1/collections/nope/docs/k1", "{}", 404, "collection_not_found"),
        with(case("wrong CAS", Method::PUT, doc, "{}", 409, "cas_mismatch"), "if-match", "\"42\""),
        with(case("malformed If-Match", Method::PUT, doc, "{}", 400, "bad_request"), "if-match", "\"abc\""),
        with(case("negative CAS", Method::PUT, doc, "{}", 400, "bad_request"), "if-match", "\"-5\""),
        with(case("If-None-Match tag", Method::PUT, doc, "{}", 400, "bad_request"), "if-none-match", "\"5\""),
        with(case("both preconditions", Method::PUT, doc, "{}", 400, "bad_request"), "if-match", "*"),
        with(case("malformed If-Match remove", Method::DELETE, doc, "", 400, "bad_request"), "if-match", "nonsense"),
        case("negative expiry", Method::PUT, &format!("{doc}?expiry=-1"), "{}", 400, "bad_request"),
        case("absurd expiry", Method::PUT, &format!("{doc}?expiry=99999999999999"), "{}", 400, "bad_request"),
        case("non-numeric expiry", Method::PUT, &format!("{doc}?expiry=soon"), "{}", 400, "bad_request"),
        case("bad durability", Method::PUT, &format!("{doc}?durability=maybe"), "{}", 400, "bad_request"),
        case("unknown parameter put", Method::PUT, &format!("{doc}?colour=blue"), "{}", 400, "bad_request"),
        case("unknown parameter get", Method::GET, &format!("{doc}?colour=blue"), "", 400, "bad_request"),
        case("unknown parameter changes", Method::GET, "/v1/collections/c/changes?colour=blue", "", 400, "bad_request"),
        case("lock too long", Method::GET, &format!("{doc}?lock=31"), "", 400, "bad_request"),
        case("lock zero", Method::GET, &format!("{doc}?lock=0"), "", 400, "bad_request"),
        case("lock and touch", Method::GET, &format!("{doc}?lock=5&touch=5"), "", 400, "bad_request"),
        case("locking a locked document", Method::GET, "/v1/collections/c/docs/k0?lock=5", "", 423, "locked"),
        case("writing a locked document", Method::PUT, "/v1/collections/c/docs/k0", "{}", 423, "locked"),
        with(
            case("unlocking with a wrong CAS", Method::POST, "/v1/collections/c/docs/k0/unlock", "", 409, "cas_mismatch"),
            "if-match",
            "\"1\"",
        ),
        case("unlock without CAS", Method::POST, "/v1/collections/c/docs/k0/unlock", "", 400, "bad_request"),
        with(case("unlocking an unlocked document", Method::POST, doc, "", 405, "bad_request"), "if-match", "\"1\""),
        with(case("unlock unlocked", Method::POST, "/v1/collections/c/docs/k1/unlock", "", 400, "bad_request"), "if-match", "\"1\""),
        case("touch without expiry", Method::POST, "/v1/collections/c/docs/k1/touch", "", 400, "bad_request"),
        case("touch missing doc", Method::POST, "/v1/collections/c/docs/none/touch?expiry=5", "", 404, "doc_not_found"),
        case("remove missing doc", Method::DELETE, "/v1/collections/c/docs/none", "", 404, "doc_not_found"),
        case("_get not JSON", Method::POST, "/v1/collections/c/_get", "keys", 400, "invalid_json"),
        case("_get wrong shape", Method::POST, "/v1/collections/c/_get", "{\"keys\": 5}", 400, "bad_request"),
        case("_get extra field", Method::POST, "/v1/collections/c/_get", "{\"keys\": [], \"x\": 1}", 400, "bad_request"),
        case("collection bad name", Method::PUT, "/v1/collections/_hidden", "", 400, "bad_request"),
        case("collection bad chars", Method::PUT, "/v1/collections/a.b", "", 400, "bad_request"),
        case("collection long name", Method::PUT, &format!("/v1/collections/{}", "n".repeat(252)), "", 400, "bad_request"),
        case("collection bad body", Method::PUT, "/v1/collections/newc", "{\"max_ttl\": -1}", 400, "bad_request"),
        case("collection not JSON", Method::PUT, "/v1/collections/newc", "ttl", 400, "invalid_json"),
        case("collection exists", Method::PUT, "/v1/collections/c", "", 409, "collection_exists"),
        case("drop unknown", Method::DELETE, "/v1/collections/nope", "", 404, "collection_not_found"),
        case("changes bad token", Method::GET, "/v1/collections/c/changes?since=garbage!!", "", 400, "bad_request"),
        case("changes bad feed", Method::GET, "/v1/collections/c/changes?feed=sometimes", "", 400, "bad_request"),
        case("changes zero limit", Method::GET, "/v1/collections/c/changes?limit=0", "", 400, "bad_request"),
        case("changes long timeout", Method::GET, "/v1/collections/c/changes?feed=longpoll&timeout=999999999", "", 400, "bad_request"),
        case("unknown endpoint", Method::GET, "/v1/nothing", "", 404, "bad_request"),
        case(
            "_get body over 4 MiB",
            Method::POST,
            "/v1/collections/c/_get",
            format!("{{\"keys\":[\"{}\"]}}", "k".repeat(5 << 20)),
            413,
            "too_large",
        ),
        case(
            "_get too many keys",
            Method::POST,
            "/v1/collections/c/_get",
            format!("{{\"keys\":[{}\"k\"]}}", "\"k\",".repeat(10_000)),
            413,
            "too_large",
        ),
        case(
            "collection body over 64 KiB",
            Method::PUT,
            "/v1/collections/big",
            format!("{{\"max_ttl\":{}1}}", " ".repeat(70_000)),
            413,
            "too_large",
        ),
        case("_bulk unknown collection", Method::POST, "/v1/collections/nope/_bulk", "", 404, "collection_not_found"),
        case("changes unknown collection", Method::GET, "/v1/collections/nope/changes", "", 404, "collection_not_found"),
        // `partitions` is the node asked telling a member which partitions its feed serves.
        case("changes partitions from a client", Method::GET, "/v1/collections/c/changes?partitions=0", "", 400, "bad_request"),
        with(
            case("changes partitions not a number", Method::GET, "/v1/collections/c/changes?partitions=0,x", "", 400, "bad_request"),
            "x-shoal-forwarded",
            &map_version,
        ),
        with(
            case("changes partitions past u16", Method::GET, "/v1/collections/c/changes?partitions=70000", "", 400, "bad_request"),
            "x-shoal-forwarded",
            &map_version,
        ),
        with(
            case("changes partitions past the count", Method::GET, "/v1/collections/c/changes?partitions=65535", "", 400, "bad_request"),
            "x-shoal-forwarded",
            &map_version,
        ),
        with(
            case("changes partitions negative", Method::GET, "/v1/collections/c/changes?partitions=-1", "", 400, "bad_request"),
            "x-shoal-forwarded",
            &map_version,
        ),
        // The mark of a call between members, from a client, counts for nothing: `partitions`
        // stays a members' parameter.
        with(
            case("a client's forwarded mark", Method::GET, "/v1/collections/c/changes?partitions=0", "", 400, "bad_request"),
            "x-shoal-forwarded",
            &(map_version.parse::<u64>().unwrap() + 1000).to_string(),
        ),
    ];
    let mut failures = Vec::new();
    for case in cases {
        // A fresh connection per case: after refusing an oversized body unread, the server
        // closes the connection, and a pooled one could be reused before that is noticed.
        let mut req = c.request(case.method.clone(), node.u(&case.path)).header("connection", "close").body(case.body.clone());
        for (h, v) in &case.headers {
            req = req.header(*h, v);
        }
        if case.name == "both preconditions" {
            req = req.header("if-none-match", "*");
        }
        let r = req.send().await.unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        if status != case.status || body["error"] != case.code || !body["reason"].is_string() {
            failures.push(format!("{}: got {status} {body}, want {} {}", case.name, case.status, case.code));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Bulk with broken lines: each bad line fails alone.
    let body = "{\"op\":\"upsert\",\"key\":\"fresh\",\"value\":1}\n{\"op\":\"upsert\",\"key\":\"k2\"\n{\"op\":\"upsert\",\"key\":\"k3\",\"value\":{}}x\n[]\n{\"op\":\"upsert\",\"key\":\"k4\",\"value\":1,\"bogus\":1}\n{\"op\":\"upsert\",\"key\":\"k5\",\"value\":1e999}\n";
    let r = c.post(node.u("/v1/collections/c/_bulk")).body(body).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let lines = common::ndjson(&r.text().await.unwrap());
    assert_eq!(lines.len(), 6);
    assert!(lines[0]["cas"].is_string());
    assert!(lines[1..].iter().all(|l| l["error"] == "invalid_json"), "{lines:?}");
    let r = c.post(node.u("/v1/collections/c/_bulk?flavour=x")).body("").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // Nothing stored was touched, and the server is still up.
    for (key, body) in &stored {
        let r = c.get(node.u(&format!("/v1/collections/c/docs/{key}"))).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{key}");
        assert_eq!(&r.text().await.unwrap(), body, "{key}");
    }
    let h: Value = c.get(node.u("/v1/health")).send().await.unwrap().json().await.unwrap();
    assert_eq!(h["status"], "ok");
}
