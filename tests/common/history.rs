//! Client histories for Porcupine (`tests/porcupine`, github.com/anishathalye/porcupine):
//! clients record every operation with its call and return times on one monotonic clock,
//! and the checker decides whether some order of them is a legal key-value history.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// How long one request may take before the client counts it as unanswered.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// One history shared by all clients of a test.
pub struct History {
    start: Instant,
    records: Mutex<Vec<Value>>,
}

impl Default for History {
    fn default() -> Self {
        History { start: Instant::now(), records: Mutex::new(Vec::new()) }
    }
}

impl History {
    pub fn now(&self) -> i64 {
        i64::try_from(self.start.elapsed().as_nanos()).unwrap_or(i64::MAX)
    }

    pub fn push(&self, record: Value) {
        self.records.lock().unwrap().push(record);
    }

    pub fn len(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    /// The history as the checker reads it: one JSON object per line.
    pub fn lines(&self) -> String {
        self.records.lock().unwrap().iter().map(|r| format!("{r}\n")).collect()
    }

    /// Every successful read, for tests that tamper with one.
    pub fn records(&self) -> Vec<Value> {
        self.records.lock().unwrap().clone()
    }
}

/// Builds the checker once per test run.
pub fn checker() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| super::go_build("porcupine", "porcupine-check")).clone()
}

/// Runs Porcupine over `lines`: (linearizable, what it printed). A history it cannot
/// decide (bad input, its own timeout) fails the test.
pub fn check(lines: &str) -> (bool, String) {
    let mut child =
        Command::new(checker()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run checker");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(lines.as_bytes()).expect("write the history");
    drop(stdin);
    let out = child.wait_with_output().expect("checker output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    match out.status.code() {
        Some(0) => (true, text),
        Some(1) => (false, text),
        _ => panic!("the checker could not decide: {text}"),
    }
}

/// What a request's answer says about its effect.
enum Answer {
    /// The answer arrived: status and body.
    Got(u16, String, Option<String>),
    /// No answer: the operation may or may not have happened.
    Unknown,
    /// The connection was refused: the request never reached a server, so it did nothing.
    Refused,
}

/// How long a client waits after a refused connection (the node is down or restarting)
/// before it tries again.
const REFUSED_BACKOFF: Duration = Duration::from_millis(20);

async fn send(req: reqwest::RequestBuilder) -> Answer {
    match req.timeout(REQUEST_TIMEOUT).send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let etag = r.headers().get("etag").and_then(|v| v.to_str().ok()).map(str::to_string);
            match r.text().await {
                // The server says it cannot tell whether the write happened (a majority wait
                // that timed out, a forwarded request whose answer was lost).
                Ok(body) if body.contains("\"ambiguous\":true") => Answer::Unknown,
                Ok(body) => Answer::Got(status, body, etag),
                Err(_) => Answer::Unknown,
            }
        }
        Err(e) if e.is_connect() => {
            tokio::time::sleep(REFUSED_BACKOFF).await;
            Answer::Refused
        }
        Err(_) => Answer::Unknown,
    }
}

/// Where clients send requests: a node's URL, changed by the test when the node restarts
/// on another port.
pub type Target = std::sync::Arc<std::sync::RwLock<String>>;

/// What a client does.
pub struct Workload<'a> {
    pub collection: &'a str,
    pub keys: usize,
    /// Query string of every write, e.g. `?durability=persist` (empty for none).
    pub write_params: &'a str,
    /// Query string of every read, e.g. `?consistency=majority` (empty for none).
    pub read_params: &'a str,
    /// More nodes to send requests to, picked at random per request besides `target`.
    pub others: &'a [String],
    pub until: Instant,
}

/// One client: random gets, upserts, deletes and compare-and-swaps (a read, then a replace
/// with its CAS) on `keys` of `collection` until `until`. Every value written is unique
/// (client and counter), so comparing values is comparing versions.
pub async fn run_client(target: Target, w: &Workload<'_>, client: usize, seed: u64, history: &History) {
    let http = super::client();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    let (collection, params) = (w.collection, w.write_params);
    while Instant::now() < w.until {
        let key = format!("k{}", rng.random_range(0..w.keys));
        let url = match rng.random_range(0..=w.others.len()) {
            0 => target.read().unwrap().clone(),
            i => w.others[i - 1].clone(),
        };
        let base_url = format!("{url}/v1/collections/{collection}/docs/{key}");
        let doc_url = format!("{base_url}{}", w.read_params);
        let write_url = format!("{base_url}{params}");
        n += 1;
        // Unique across calls too (a test may run a client in several slices, each with its
        // own seed): the checker's model tells versions apart by their values.
        let value = format!("c{client}-s{seed}-{n}");
        let call = history.now();
        match rng.random_range(0..10) {
            0..=3 => {
                let answer = send(http.get(&doc_url)).await;
                let ret = history.now();
                if let Some(r) = read_record(client, &key, call, ret, answer) {
                    history.push(r);
                }
            }
            4..=6 => {
                let answer = send(http.put(&write_url).body(json!({ "v": value }).to_string())).await;
                let ret = history.now();
                let outcome = match answer {
                    Answer::Got(200 | 201, ..) => "ok",
                    Answer::Got(..) | Answer::Refused => "fail",
                    Answer::Unknown => "unknown",
                };
                history.push(
                    json!({"client": client, "kind": "put", "key": key, "value": value, "call": call, "return": ret, "outcome": outcome}),
                );
            }
            7 => {
                let answer = send(http.delete(&write_url)).await;
                let ret = history.now();
                let (outcome, applied) = match answer {
                    Answer::Got(200, ..) => ("ok", true),
                    Answer::Got(404, ..) => ("ok", false),
                    Answer::Got(..) | Answer::Refused => ("fail", false),
                    Answer::Unknown => ("unknown", false),
                };
                history.push(json!({"client": client, "kind": "delete", "key": key, "call": call, "return": ret, "outcome": outcome, "applied": applied}));
            }
            _ => {
                // Read, then replace only if it is still that version.
                let answer = send(http.get(&doc_url)).await;
                let ret = history.now();
                let etag = match &answer {
                    Answer::Got(200, _, etag) => etag.clone(),
                    _ => None,
                };
                let Some(r) = read_record(client, &key, call, ret, answer) else { continue };
                let from = r["value"].as_str().map(str::to_string);
                history.push(r);
                let (Some(etag), Some(from)) = (etag, from) else { continue };
                let call = history.now();
                let answer = send(http.put(&write_url).header("if-match", etag).body(json!({ "v": value }).to_string())).await;
                let ret = history.now();
                let (outcome, applied) = match answer {
                    Answer::Got(200, ..) => ("ok", true),
                    Answer::Got(409 | 404, ..) => ("ok", false),
                    Answer::Got(..) | Answer::Refused => ("fail", false),
                    Answer::Unknown => ("unknown", false),
                };
                history.push(json!({"client": client, "kind": "cas", "key": key, "from": from, "value": value, "call": call, "return": ret, "outcome": outcome, "applied": applied}));
            }
        }
    }
}

fn read_record(client: usize, key: &str, call: i64, ret: i64, answer: Answer) -> Option<Value> {
    match answer {
        Answer::Got(200, body, _) => {
            let v: Value = serde_json::from_str(&body).ok()?;
            Some(
                json!({"client": client, "kind": "get", "key": key, "value": v["v"], "found": true, "call": call, "return": ret, "outcome": "ok"}),
            )
        }
        Answer::Got(404, ..) => {
            Some(json!({"client": client, "kind": "get", "key": key, "found": false, "call": call, "return": ret, "outcome": "ok"}))
        }
        // A refused or unanswered read says nothing.
        _ => None,
    }
}
