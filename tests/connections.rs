//! Hostile and slow clients against the real binary: silent, slow-header, dribbling and idle
//! connections are closed by their timeouts; a trickled body gets `408 timeout` while a
//! fair one passes; crowds of slowloris and idle connections do not starve a normal
//! client; connections over the cap get a clear `503` and are closed; a flood of one
//! request class is shed instead of queued forever; a shutdown ends open feeds cleanly.
//!
//! The timeouts are set small through the `serve` flags so that the tests stay short.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{eventually, Node};
use serde_json::Value;

/// The tests that open thousands of sockets or flood the node run one at a time: the
/// machine may have two cores, and each of them starts its own node.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `limits::QUEUE_PER_SLOT`: requests of a class that may wait, per running slot.
const QUEUE_PER_SLOT: usize = 64;

const HEALTH_REQUEST: &[u8] = b"GET /v1/health HTTP/1.1\r\nHost: shoal\r\n\r\n";
/// A request whose headers never end.
const PARTIAL_HEADERS: &[u8] = b"GET /v1/health HTTP/1.1\r\nHost: shoal\r\nX-Slow: ";
/// The HTTP/2 connection preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

fn addr(node: &Node) -> SocketAddr {
    node.url.trim_start_matches("http://").parse().expect("node address")
}

/// One HTTP/1.1 answer, framed by its content-length.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("answer body is not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// The answer at the front of `buf` once it is complete, and the bytes it took.
fn parse_answer(buf: &[u8]) -> Option<(Answer, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let mut answer = Answer { status, head, body: Vec::new() };
    let len = answer.header("content-length").and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
    if buf.len() < end + len {
        return None;
    }
    answer.body = buf[end..end + len].to_vec();
    Some((answer, end + len))
}

fn closed_by_peer(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe)
}

/// Reads until the peer closes the connection (EOF or reset) or `limit` passes. Returns the
/// bytes read and whether the peer closed.
fn read_to_close(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (out, false);
        }
        s.set_read_timeout(Some(left)).expect("set_read_timeout");
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return (out, false),
            Err(e) if closed_by_peer(&e) => return (out, true),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Reads one complete answer (keeping the connection open), within `limit`.
fn read_answer(s: &mut TcpStream, limit: Duration) -> Answer {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        if let Some((answer, _)) = parse_answer(&got) {
            return answer;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no complete answer within {limit:?}; got {:?}", String::from_utf8_lossy(&got));
        s.set_read_timeout(Some(left)).expect("set_read_timeout");
        match s.read(&mut buf) {
            Ok(0) => panic!("connection closed before a complete answer; got {:?}", String::from_utf8_lossy(&got)),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("read: {e}; got {:?}", String::from_utf8_lossy(&got)),
        }
    }
}

/// One request on a fresh connection (`Connection: close`), answered within 10 s.
fn http(a: SocketAddr, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect(a).expect("connect");
    let head = format!("{method} {path} HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
    read_answer(&mut s, Duration::from_secs(10))
}

/// Raises this process's soft limit of open files to the hard limit.
fn raise_fd_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit read and write a struct we own.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0, "getrlimit");
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0, "setrlimit");
        }
        lim.rlim_cur as u64
    }
}

/// A client that keeps no idle connection (which the node would count as open).
fn one_shot_client() -> reqwest::Client {
    common::client_builder().timeout(Duration::from_secs(10)).pool_max_idle_per_host(0).build().expect("client")
}

/// The value of one series in the node's `/metrics` (over a connection of its own: the
/// node may be at its connection cap); 0 if absent.
async fn metric(node: &Node, series: &str) -> f64 {
    common::metric(&one_shot_client(), node, series).await.unwrap_or(0.0)
}

#[test]
fn silent_slow_and_idle_connections_are_closed() {
    let node = Node::start(&["--header-read-timeout-secs", "2", "--idle-timeout-secs", "2"]);
    let a = addr(&node);
    // Each case: what the client sends, and whether it keeps sending a byte every 300 ms
    // (so the connection is never idle) until the server closes it.
    let cases: Vec<(&str, &[u8], bool)> = vec![
        ("headers that never end", PARTIAL_HEADERS, false),
        ("headers dribbled a byte at a time", b"GET /v1/health HTTP/1.1\r\nHost: shoal\r\n", true),
        ("nothing at all (no preface)", b"", false),
        ("an h2c preface, then nothing", H2_PREFACE, false),
        ("a completed request, then nothing (keep-alive)", HEALTH_REQUEST, false),
    ];
    let threads: Vec<_> = cases
        .into_iter()
        .map(|(name, send, dribble)| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(a).expect("connect");
                let start = Instant::now();
                s.write_all(send).expect("write");
                let mut got = Vec::new();
                if send == HEALTH_REQUEST {
                    let answer = read_answer(&mut s, Duration::from_secs(10));
                    assert_eq!(answer.status, 200, "{name}: {answer:?}");
                }
                let stop = Arc::new(AtomicBool::new(false));
                let dribbler = dribble.then(|| {
                    let (mut w, stop) = (s.try_clone().expect("clone"), Arc::clone(&stop));
                    std::thread::spawn(move || {
                        for i in 0..100u32 {
                            if stop.load(Ordering::Relaxed) || w.write_all(format!("X-{i}: 1\r\n").as_bytes()).is_err() {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(300));
                        }
                    })
                });
                let (rest, closed) = read_to_close(&mut s, Duration::from_secs(20));
                stop.store(true, Ordering::Relaxed);
                if let Some(d) = dribbler {
                    d.join().expect("dribbler");
                }
                got.extend_from_slice(&rest);
                let elapsed = start.elapsed();
                println!("{name}: closed={closed} after {elapsed:?}, {} bytes after the last answer", got.len());
                assert!(closed, "{name}: the server did not close the connection within 20 s");
                // Closed by the timeout, not by an error straight away.
                assert!(elapsed >= Duration::from_secs(1), "{name}: closed after only {elapsed:?}");
                let text = String::from_utf8_lossy(&got);
                if send.starts_with(b"GET") {
                    // HTTP/1 closes silently or with a 408, never with an answer to the request.
                    assert!(got.is_empty() || text.starts_with("HTTP/1.1 408"), "{name}: unexpected bytes {text:?}");
                } else if send.is_empty() {
                    assert!(got.is_empty(), "{name}: unexpected bytes {text:?}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("case failed");
    }
    // The node is fine afterwards.
    assert_eq!(http(a, "GET", "/v1/health", b"").status, 200);
}

/// Starts `PUT /v1/collections/c/docs/{key}` announcing `len` body bytes, lets `send` write
/// (on its own thread, until it returns or a write fails), and reads what the server
/// answers until it closes (at most 20 s). Returns the answer, whether the server closed,
/// and when.
fn slow_body(
    a: SocketAddr,
    key: &str,
    len: usize,
    send: impl FnOnce(&mut TcpStream) -> std::io::Result<()> + Send + 'static,
) -> (Answer, bool, Duration) {
    let head = format!(
        "PUT /v1/collections/c/docs/{key} HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    );
    slow_request(a, key, &head, send)
}

/// [`slow_body`] of any request: `head` (with its `Content-Length`), then what `send` writes.
fn slow_request(
    a: SocketAddr,
    key: &str,
    head: &str,
    send: impl FnOnce(&mut TcpStream) -> std::io::Result<()> + Send + 'static,
) -> (Answer, bool, Duration) {
    let mut s = TcpStream::connect(a).expect("connect");
    s.write_all(head.as_bytes()).expect("write head");
    let start = Instant::now();
    let mut w = s.try_clone().expect("clone");
    // The sender is left running when the server closes: its next write fails and it ends.
    std::thread::spawn(move || send(&mut w));
    let (got, closed) = read_to_close(&mut s, Duration::from_secs(20));
    let elapsed = start.elapsed();
    let (answer, _) = parse_answer(&got).unwrap_or_else(|| panic!("{key}: no complete answer: {:?}", String::from_utf8_lossy(&got)));
    (answer, closed, elapsed)
}

/// The index service's calls between members (feeds, highs, copies of index partitions,
/// routed scans) read their bodies as client requests do: a member (or anyone with the
/// secret) trickling one is answered `408` and cut off, and the node goes on.
#[test]
fn trickled_internal_index_calls_time_out() {
    let node = Node::start(&["--body-read-timeout-secs", "2", "--cluster-secret", "trickle-secret"]);
    let a = addr(&node);
    let calls: Vec<_> = common::INTERNAL_BODY_CALLS
        .into_iter()
        .map(|op| {
            let head = format!(
                "POST /v1/_internal/{op} HTTP/1.1\r\nHost: shoal\r\nx-shoal-cluster-secret: trickle-secret\r\nContent-Length: 64\r\n\r\n"
            );
            std::thread::spawn(move || {
                let answer = slow_request(a, op, &head, |w| {
                    for b in br#"{"collection":"c","index":"i","part":0,"source":null,"pad":"xyz"}"#.iter() {
                        w.write_all(&[*b])?;
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    Ok(())
                });
                (op, answer)
            })
        })
        .collect();
    for t in calls {
        let (op, (answer, closed, _)) = t.join().expect("slow call");
        assert_eq!(answer.status, 408, "{op}: {answer:?}");
        assert_eq!(answer.json()["error"], "timeout", "{op}: {answer:?}");
        assert!(closed, "{op}: the connection stayed open after the 408");
    }
    assert_eq!(http(a, "GET", "/v1/health", b"").status, 200);
}

/// The user endpoint's body (`PUT /v1/users/{name}`): trickled, it is answered `408`;
/// over its limit (64 KiB, `USER_BODY_MAX_BYTES`), `413` before it is read; no user is made.
#[test]
fn a_trickled_or_oversized_user_body_is_refused_and_makes_no_user() {
    let node = Node::start(&["--body-read-timeout-secs", "2"]);
    let a = addr(&node);
    let body = br#"{"password":"a-good-password","roles":["data_reader[*]"],"pad":"abcdefghij"}"#;
    let head = format!(
        "PUT /v1/users/trickled HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let (answer, closed, _) = slow_request(a, "trickled", &head, |w| {
        for b in body.iter() {
            w.write_all(&[*b])?;
            std::thread::sleep(Duration::from_secs(1));
        }
        Ok(())
    });
    assert_eq!(answer.status, 408, "{answer:?}");
    assert!(closed, "the connection stayed open after the 408");
    let mut big = br#"{"password":"a-good-password","roles":[],"pad":""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', 100 * 1024));
    big.extend_from_slice(br#""}"#);
    let answer = http(a, "PUT", "/v1/users/oversized", &big);
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(answer.json()["error"], "too_large");
    let users = http(a, "GET", "/v1/users", b"");
    assert_eq!(users.status, 200);
    let listed = String::from_utf8_lossy(&users.body).to_string();
    assert!(!listed.contains("trickled") && !listed.contains("oversized"), "{listed}");
}

#[test]
fn a_trickled_body_times_out_and_a_fair_one_is_accepted() {
    let node = Node::start(&["--body-read-timeout-secs", "2"]);
    let a = addr(&node);
    assert_eq!(http(a, "PUT", "/v1/collections/c", b"").status, 201);

    // 1 byte per second: far below the minimum rate, so the deadline (2 s, plus a second
    // per 500 bytes received) passes. And 1 MiB at once, then silence: the bytes extend the
    // deadline by half an hour, but no pause may be longer than the first deadline.
    let trickled = std::thread::spawn(move || {
        slow_body(a, "trickle", 64, |w| {
            for b in br#"{"n":1,"pad":"abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstu"}"#.iter() {
                w.write_all(&[*b])?;
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok(())
        })
    });
    let stalled = std::thread::spawn(move || {
        slow_body(a, "stall", 2 * 1024 * 1024, |w| {
            w.write_all(&[b'"'; 1024 * 1024])?;
            std::thread::sleep(Duration::from_secs(25));
            Ok(())
        })
    });
    for (name, t) in [("trickled", trickled), ("stalled", stalled)] {
        let (answer, closed, elapsed) = t.join().expect("slow body");
        println!("{name} body: answered {} and closed={closed} after {elapsed:?}", answer.status);
        assert_eq!(answer.status, 408, "{name}: {answer:?}");
        assert_eq!(answer.header("content-type"), Some("application/json"));
        assert_eq!(answer.json()["error"], "timeout", "{name}: {answer:?}");
        assert!(closed, "{name}: the connection stayed open after the 408");
        let path = format!("/v1/collections/c/docs/{}", if name == "trickled" { "trickle" } else { "stall" });
        assert_eq!(http(a, "GET", &path, b"").status, 404, "{name}: part of a body was stored");
    }

    // 1 MiB of _bulk in 64 KiB chunks with pauses: 3+ s in all, longer than the first
    // deadline, but each chunk extends it.
    let docs = 1024;
    let mut bulk = Vec::new();
    for i in 0..docs {
        let line = format!(r#"{{"op":"upsert","key":"bulk-{i:05}","value":{{"i":{i},"pad":"{}"}}}}"#, "x".repeat(1000));
        bulk.extend_from_slice(line.as_bytes());
        bulk.push(b'\n');
    }
    assert!(bulk.len() >= 1024 * 1024, "{}", bulk.len());
    let mut s = TcpStream::connect(a).expect("connect");
    let head = format!("POST /v1/collections/c/_bulk HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\nContent-Length: {}\r\n\r\n", bulk.len());
    s.write_all(head.as_bytes()).expect("write head");
    let start = Instant::now();
    for chunk in bulk.chunks(64 * 1024) {
        s.write_all(chunk).expect("write chunk");
        std::thread::sleep(Duration::from_millis(200));
    }
    let answer = read_answer(&mut s, Duration::from_secs(30));
    println!("fair body: {} bytes answered {} after {:?}", bulk.len(), answer.status, start.elapsed());
    assert_eq!(answer.status, 200, "{answer:?}");
    let lines = common::ndjson(&String::from_utf8_lossy(&answer.body));
    assert_eq!(lines.len(), docs);
    assert!(lines.iter().all(|l| l.get("cas").is_some()), "a bulk line failed: {lines:?}");
    let last = http(a, "GET", &format!("/v1/collections/c/docs/bulk-{:05}", docs - 1), b"");
    assert_eq!(last.status, 200);
    assert_eq!(last.json()["i"], docs - 1);
}

#[tokio::test]
async fn slowloris_and_idle_crowds_do_not_starve_a_client() {
    let _heavy = HEAVY.lock().await;
    raise_fd_limit();
    let node = Node::start(&["--header-read-timeout-secs", "10", "--idle-timeout-secs", "10"]);
    let a = addr(&node);
    let opened = Instant::now();
    let mut slow = Vec::new();
    let mut silent = Vec::new();
    let mut kept_alive = Vec::new();
    for i in 0..2000 {
        // Batches no faster than the node accepts them: a burst beyond the listen backlog
        // would only measure SYN retries.
        if i % 50 == 0 {
            let want = 2.0 * i as f64;
            eventually(10, "the node accepts the crowd", || async { metric(&node, "shoal_connections").await >= want }).await;
        }
        let mut s = TcpStream::connect(a).expect("connect slowloris");
        s.write_all(PARTIAL_HEADERS).expect("write partial headers");
        slow.push(s);
        let mut s = TcpStream::connect(a).expect("connect idle");
        if i % 2 == 0 {
            silent.push(s);
        } else {
            s.write_all(HEALTH_REQUEST).expect("write");
            kept_alive.push(s);
        }
    }
    println!("opened 4000 connections in {:?}", opened.elapsed());
    for s in &mut kept_alive {
        assert_eq!(read_answer(s, Duration::from_secs(10)).status, 200);
    }
    println!("1000 of them answered a request by {:?}", opened.elapsed());
    eventually(10, "the node holds the 4000 connections", || async { metric(&node, "shoal_connections").await >= 4000.0 }).await;

    let client = common::client_builder().timeout(Duration::from_secs(10)).build().expect("client");
    let start = Instant::now();
    let r = client.put(node.u("/v1/collections/c")).send().await.expect("create collection");
    assert!(r.status().is_success(), "{}", r.status());
    let r = client.put(node.u("/v1/collections/c/docs/k")).body(r#"{"v":1}"#).send().await.expect("put");
    assert_eq!(r.status(), 200);
    let r = client.get(node.u("/v1/collections/c/docs/k")).send().await.expect("get");
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.expect("json")["v"], 1);
    println!("a normal client's create + put + get amid the crowd took {:?}", start.elapsed());
    let start = Instant::now();
    let r = client.get(node.u("/v1/health")).send().await.expect("health");
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.expect("json")["status"], "ok");
    println!("GET /v1/health amid the crowd took {:?}", start.elapsed());
    drop(client);

    // The timeouts reap the whole crowd.
    eventually(30, "the crowd is closed by the timeouts", || async { metric(&node, "shoal_connections").await <= 1.0 }).await;
    println!("crowd closed {:?} after it was opened", opened.elapsed());
    for s in slow.iter_mut().take(20).chain(silent.iter_mut().take(20)).chain(kept_alive.iter_mut().take(20)) {
        let (_, closed) = read_to_close(s, Duration::from_secs(5));
        assert!(closed, "a crowd connection is still open on the client's side");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_get_503_and_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TOTAL: usize = 10_000;
    const CAP: usize = 4096;
    let _heavy = HEAVY.lock().await;
    let fds = raise_fd_limit();
    assert!(fds >= TOTAL as u64 + 1000, "this test needs {} open files; the hard limit is {fds}", TOTAL + 1000);
    let node = Node::start(&["--max-connections", &CAP.to_string(), "--header-read-timeout-secs", "60", "--idle-timeout-secs", "60"]);
    let a = addr(&node);

    // Every client sends a request and reads its answer; the held ones stay open.
    let connecting = Arc::new(tokio::sync::Semaphore::new(256));
    let start = Instant::now();
    let tasks: Vec<_> = (0..TOTAL)
        .map(|_| {
            let connecting = Arc::clone(&connecting);
            tokio::spawn(async move {
                let _turn = connecting.acquire_owned().await.expect("semaphore");
                let mut s = tokio::net::TcpStream::connect(a).await.expect("connect");
                // A refused connection may be closed before the request is written.
                let _ = s.write_all(HEALTH_REQUEST).await;
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                let answer = loop {
                    if let Some((answer, _)) = parse_answer(&got) {
                        break answer;
                    }
                    match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                        Err(_) => panic!("no answer within 30 s; got {:?}", String::from_utf8_lossy(&got)),
                        Ok(Ok(0)) => panic!("closed without an answer; got {:?}", String::from_utf8_lossy(&got)),
                        Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                        Ok(Err(e)) => panic!("read failed before a complete answer ({e}); got {:?}", String::from_utf8_lossy(&got)),
                    }
                };
                if answer.status != 503 {
                    return (answer, Some(s));
                }
                // A refused connection is closed after its answer.
                let closed = match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                    Ok(Ok(0)) => true,
                    Ok(Err(e)) => closed_by_peer(&e),
                    _ => false,
                };
                assert!(closed, "a refused connection was left open");
                (answer, None)
            })
        })
        .collect();
    let mut held = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (answer, stream) = t.await.expect("client task");
        match answer.status {
            200 => held.push(stream.expect("held stream")),
            503 => {
                let body = answer.json();
                assert_eq!(body["error"], "unavailable", "{body}");
                assert!(body["reason"].as_str().is_some_and(|r| r.contains("connection limit")), "{body}");
                assert_eq!(answer.header("connection"), Some("close"));
                refused += 1;
            }
            other => panic!("unexpected status {other}: {answer:?}"),
        }
    }
    println!("{TOTAL} connections answered in {:?}: {} held, {refused} refused", start.elapsed(), held.len());
    assert_eq!(held.len(), CAP, "every connection under the cap is served");
    assert_eq!(refused, TOTAL - CAP, "every connection over the cap is refused");

    // Still at the cap: one more is refused, and the node is up.
    let more = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(a).expect("connect");
        let (got, closed) = read_to_close(&mut s, Duration::from_secs(10));
        (parse_answer(&got).map(|(a, _)| a.status), closed)
    })
    .await
    .expect("probe");
    assert_eq!(more, (Some(503), true));
    // SAFETY: signal 0 only checks that the process exists.
    assert_eq!(unsafe { libc::kill(node.pid() as i32, 0) }, 0, "the node died");

    // Once the held connections close, a normal client is served again.
    drop(held);
    let client = one_shot_client();
    eventually(30, "the node serves again after the crowd left", || async {
        client.get(node.u("/v1/health")).send().await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let r = client.put(node.u("/v1/collections/c")).send().await.expect("create");
    assert!(r.status().is_success());
    let r = client.put(node.u("/v1/collections/c/docs/k")).body("[1]").send().await.expect("put");
    assert_eq!(r.status(), 200);
    let refused_total = metric(&node, "shoal_connections_refused_total").await;
    println!("shoal_connections_refused_total = {refused_total}");
    assert!(refused_total >= (TOTAL - CAP + 1) as f64, "refused_total {refused_total}");
}

/// Confines the calling thread (and so the processes it starts) to its first allowed CPU;
/// returns the previous mask.
fn pin_to_one_cpu() -> libc::cpu_set_t {
    // SAFETY: the sched_*affinity calls read and write cpu_set_t values we own.
    unsafe {
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old), 0, "sched_getaffinity");
        let first = (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &old)).expect("an allowed CPU");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(first, &mut one);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one), 0, "sched_setaffinity");
        old
    }
}

fn unpin(old: &libc::cpu_set_t) {
    // SAFETY: as in `pin_to_one_cpu`.
    unsafe {
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), old), 0, "sched_setaffinity");
    }
}

#[tokio::test]
async fn a_query_flood_is_shed_while_gets_go_on() {
    let _heavy = HEAVY.lock().await;
    // The node sees one core (it inherits this thread's CPU mask), so the query class has
    // one slot and QUEUE_PER_SLOT places in its queue, whatever the machine.
    let old = pin_to_one_cpu();
    let node = Node::start(&[]);
    unpin(&old);
    let (slots, queue) = (1, QUEUE_PER_SLOT);
    let flood = slots + queue + 35;

    let client = common::client_builder().timeout(Duration::from_secs(10)).build().expect("client");
    assert!(client.put(node.u("/v1/collections/c")).send().await.expect("create").status().is_success());
    let r = client.put(node.u("/v1/collections/c/docs/k")).body(r#"{"v":7}"#).send().await.expect("put");
    assert_eq!(r.status(), 200);

    // Each statement runs until its own 30 s timeout; the node is killed long before.
    let heavy = serde_json::json!({"sql": "SELECT count(*) FROM generate_series(1, 100000000000)", "timeout_ms": 30_000});
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let flood_client = common::client_builder().timeout(Duration::from_secs(60)).build().expect("client");
    let start = Instant::now();
    let tasks: Vec<_> = (0..flood)
        .map(|_| {
            let (c, tx, url, body) = (flood_client.clone(), tx.clone(), node.u("/v1/query"), heavy.clone());
            tokio::spawn(async move {
                let r = c.post(url).json(&body).send().await;
                let answer = match r {
                    Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                    Err(e) => (0, e.to_string()),
                };
                let _ = tx.send((answer, start.elapsed()));
            })
        })
        .collect();
    drop(tx);

    // The requests beyond the slots and the queue are refused at once...
    let mut shed = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while shed < flood - slots - queue {
        let Ok(Some(((status, body), at))) = tokio::time::timeout_at(deadline, rx.recv()).await else {
            panic!("only {shed} of the {flood} queries were shed within 30 s");
        };
        assert_eq!(status, 503, "a flooded query got {status} after {at:?}: {body}");
        let body: Value = serde_json::from_str(&body).expect("JSON refusal");
        assert_eq!(body["error"], "unavailable", "{body}");
        shed += 1;
    }
    println!("{shed} of {flood} queries shed within {:?}", start.elapsed());
    // ...and no more: the rest run or wait.
    assert!(rx.try_recv().is_err(), "more queries were answered than the class sheds");

    // Meanwhile key/value reads are answered.
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        let r = client.get(node.u("/v1/collections/c/docs/k")).send().await.expect("get during the flood");
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.expect("json")["v"], 7);
        slowest = slowest.max(t.elapsed());
    }
    println!("20 gets during the flood; the slowest took {slowest:?}");
    let shed_total = metric(&node, "shoal_requests_shed_total{class=\"query\"}").await;
    assert_eq!(shed_total, shed as f64);
    for t in tasks {
        t.abort();
    }
}

#[tokio::test]
async fn a_shutdown_ends_open_feeds_cleanly() {
    let mut node = Node::start(&[]);
    let a = addr(&node);
    let client = node.client();
    assert!(client.put(node.u("/v1/collections/c")).send().await.expect("create").status().is_success());
    let r = client.put(node.u("/v1/collections/c/docs/k")).body("{}").send().await.expect("put");
    assert_eq!(r.status(), 200);
    let lines = common::ndjson(&client.get(node.u("/v1/collections/c/changes")).send().await.expect("feed").text().await.expect("text"));
    let since = lines.last().and_then(|l| l["last"].as_str()).expect("last token").to_string();

    // A longpoll feed over HTTP/1.1 and one over h2c, both waiting for news.
    let h2 = common::client_builder().http2_prior_knowledge().timeout(Duration::from_secs(60)).build().expect("h2 client");
    let url = node.u(&format!("/v1/collections/c/changes?feed=longpoll&timeout=60000&since={since}"));
    let mut feeds = Vec::new();
    for c in [&client, &h2] {
        let r = c.get(&url).send().await.expect("open longpoll");
        assert_eq!(r.status(), 200);
        feeds.push(tokio::spawn(r.text()));
    }
    // And connections that sit idle: silent, and kept alive after a request.
    let mut silent = TcpStream::connect(a).expect("connect");
    let mut kept = TcpStream::connect(a).expect("connect");
    kept.write_all(HEALTH_REQUEST).expect("write");
    assert_eq!(read_answer(&mut kept, Duration::from_secs(10)).status, 200);

    let start = Instant::now();
    let pid = node.pid();
    let stopped = tokio::task::spawn_blocking(move || node.stop());
    for feed in feeds {
        let text =
            tokio::time::timeout(Duration::from_secs(30), feed).await.expect("feed ended").expect("task").expect("feed body read in full");
        let lines = common::ndjson(&text);
        assert_eq!(lines.len(), 1, "{text}");
        assert!(lines[0]["last"].is_string(), "a feed ended without its last token: {text}");
    }
    println!("open feeds ended {:?} after SIGTERM", start.elapsed());
    let clean = tokio::time::timeout(Duration::from_secs(60), stopped).await.expect("the node exited").expect("stop");
    println!("node {pid} exited {:?} after SIGTERM", start.elapsed());
    assert!(clean, "the node did not exit cleanly");
    for s in [&mut silent, &mut kept] {
        let (_, closed) = read_to_close(s, Duration::from_secs(5));
        assert!(closed, "a connection outlived the node");
    }
    assert!(TcpStream::connect(a).is_err(), "the node still accepts connections");
}

/// A request head whose first TCP segment is a lone "P" (a prefix of the HTTP/2 preface)
/// is still an HTTP/1 head under the header timeout.
#[test]
fn a_head_that_starts_with_a_lone_p_is_still_timed() {
    let node = Node::start(&["--header-read-timeout-secs", "2", "--idle-timeout-secs", "2"]);
    let a: std::net::SocketAddr = node.url.trim_start_matches("http://").parse().unwrap();
    let mut s = std::net::TcpStream::connect(a).unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(b"P").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    s.write_all(b"UT /v1/collections/c/docs/k HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\n")
        .unwrap();
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        for i in 0..100 {
            if w.write_all(format!("X-{i}: 1\r\n").as_bytes()).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut buf = [0u8; 1024];
    let r = s.read(&mut buf);
    println!("read after {:?}: {r:?}", start.elapsed());
    assert!(matches!(r, Ok(0)) || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset), "still open after 15 s: {r:?}");
}

/// A client that stops reading a streamed answer does not hold the connection, the feed
/// and its buffered answer forever: the idle timeout closes it once writes are blocked.
#[tokio::test]
async fn a_reader_that_stops_reading_a_streamed_answer_is_closed() {
    let node = Node::start(&["--idle-timeout-secs", "2", "--header-read-timeout-secs", "2"]);
    let c = node.client();
    assert!(c.put(node.u("/v1/collections/c")).send().await.unwrap().status().is_success());
    let mut bulk = String::new();
    for i in 0..200 {
        bulk.push_str(&format!("{{\"op\":\"upsert\",\"key\":\"d{i:04}\",\"value\":{{\"pad\":\"{}\"}}}}\n", "y".repeat(100_000)));
    }
    assert_eq!(c.post(node.u("/v1/collections/c/_bulk")).body(bulk).send().await.unwrap().status(), 200);
    drop(c);
    let a: std::net::SocketAddr = node.url.trim_start_matches("http://").parse().unwrap();
    let mut s = std::net::TcpStream::connect(a).unwrap();
    let small: libc::c_int = 4096;
    // SAFETY: setsockopt reads an int from the pointer we pass, which lives on the stack.
    unsafe { libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, &small as *const _ as *const libc::c_void, 4) };
    s.write_all(b"GET /v1/collections/c/changes?include_docs=true HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\n\r\n").unwrap();
    let start = Instant::now();
    let gauge = || async {
        let text = common::client_builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
            .get(node.u("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines().find_map(|l| l.strip_prefix("shoal_connections ")?.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let open = gauge().await;
    assert!(open >= 2.0, "the stalled reader's connection is open at first ({open})");
    common::eventually(20, "the stalled reader is closed", || async { gauge().await <= 1.0 }).await;
    println!("closed after {:?}", start.elapsed());
    drop(s);
}

/// A body over its limit is refused before it is read, and the client, still sending it,
/// gets the `413`: the server closes the connection only after the client has closed its
/// side (or a short linger). Closing with the body unread made the kernel reset the
/// connection, and a client could lose the answer ("error sending request").
#[test]
fn a_refused_oversized_body_still_gets_its_answer() {
    let node = Node::start(&[]);
    let a = addr(&node);
    assert_eq!(http(a, "PUT", "/v1/collections/c", b"").status, 201);
    // `_get` takes at most 4 MiB; 16 MiB is more than the socket buffers hold.
    let body = format!("{{\"keys\":[\"{}\"]}}", "k".repeat(16 << 20));
    for _ in 0..3 {
        let answer = http(a, "POST", "/v1/collections/c/_get", body.as_bytes());
        assert_eq!(answer.status, 413, "{answer:?}");
        assert_eq!(answer.json()["error"], "too_large");
    }
    assert_eq!(http(a, "GET", "/v1/health", b"").status, 200, "the node serves on");
}

/// After a refused body the server drains what the client still sends only for a while
/// (`LINGER_TIMEOUT`, 2 s in all) and only so much (`LINGER_MAX_BYTES`, 64 MiB): a client
/// that trickles on, or one that never stops sending, is cut off (its writes then fail).
#[test]
fn a_lingering_connection_is_cut_off_in_time_and_in_bytes() {
    let node = Node::start(&[]);
    let a = addr(&node);
    assert_eq!(http(a, "PUT", "/v1/collections/c", b"").status, 201);
    let refused = || {
        let mut s = TcpStream::connect(a).expect("connect");
        let head = format!("POST /v1/collections/c/_get HTTP/1.1\r\nHost: shoal\r\nAuthorization: Basic YWRtaW46dGVzdC1hZG1pbi1wYXNzd29yZA==\r\nContent-Length: {}\r\n\r\n", 1u64 << 40);
        s.write_all(head.as_bytes()).expect("write head");
        assert_eq!(read_answer(&mut s, Duration::from_secs(10)).status, 413);
        s
    };
    // Sends `chunk` bytes at a time, `pause` apart, until a write fails (answers true) or
    // `most` bytes went out (false).
    let send_until_cut = |s: &mut TcpStream, chunk: usize, pause: Duration, most: usize| {
        let bytes = vec![b' '; chunk];
        let mut sent = 0;
        while sent < most {
            match s.write_all(&bytes) {
                Ok(()) => sent += chunk,
                Err(e) if closed_by_peer(&e) => return true,
                Err(e) => panic!("write: {e}"),
            }
            std::thread::sleep(pause);
        }
        false
    };
    // A byte every 50 ms, for up to 60 s: the 2 s bound cuts it off.
    let mut trickle = refused();
    assert!(send_until_cut(&mut trickle, 1, Duration::from_millis(50), 1_200), "a trickling client was drained for a minute");
    // 1 MiB at a time, up to 1 GiB: the 64 MiB bound (or the 2 s one) cuts it off.
    let mut flood = refused();
    assert!(send_until_cut(&mut flood, 1 << 20, Duration::ZERO, 1 << 30), "a flooding client was drained of 1 GiB");
    assert_eq!(http(a, "GET", "/v1/health", b"").status, 200, "the node serves on");
}
