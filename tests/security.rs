//! Security (`API.md`, Security): who may call what, tried against the real binary as
//! users and strangers would — every route for every role, brute force, forged member
//! headers, malformed credentials, users across members, and no password on disk.

mod common;

use std::time::Duration;

use common::cluster::{member_states, rebalance, wait_for};
use common::{basic_auth, Node};
use reqwest::Method;
use serde_json::{json, Value};
use shoal_meta::{allows, Needs, Role};

/// `(method, route, rule)` of every route (`ops::ROUTES`, read from its source: a route
/// added there is tried here for every role).
fn routes() -> Vec<(String, String, String)> {
    common::route_table().into_iter().map(|(m, r, _, rule)| (m, r, rule)).collect()
}

/// A request for `route`, harmless to the fixture (drops target things that do not exist)
/// and with a body of the right shape where one is needed.
fn instance(method: &str, route: &str) -> (String, String) {
    let path = match (method, route) {
        ("DELETE", "/v1/collections/{c}") => "/v1/collections/nope".to_string(),
        ("PUT", "/v1/collections/{c}") => "/v1/collections/made".to_string(),
        ("DELETE", "/v1/users/{name}") => "/v1/users/nobody".to_string(),
        ("DELETE", "/v1/collections/{c}/indexes/{name}") => "/v1/collections/c/indexes/nope".to_string(),
        _ => route.replace("{c}", "c").replace("{key}", "k").replace("{name}", "by_v").replace("{op}", "identify"),
    };
    let body = match (method, route) {
        ("PUT", "/v1/users/{name}") => json!({"password": "made-by-matrix", "roles": ["metrics_reader"]}).to_string(),
        ("PUT", "/v1/collections/{c}/docs/{key}") => json!({"v": 1}).to_string(),
        ("POST", "/v1/query") | ("POST", "/v1/analytics") => json!({"sql": "SELECT 1"}).to_string(),
        ("POST", "/v1/collections/{c}/_get") => json!({"keys": ["k"]}).to_string(),
        ("POST", "/v1/collections/{c}/indexes/{name}/scan") => "{}".to_string(),
        ("POST", "/v1/cluster/failover") | ("POST", "/v1/cluster/recover") => json!({"node": 1}).to_string(),
        ("POST", "/v1/cluster/nodes") => json!({"address": "127.0.0.1:1"}).to_string(),
        ("PUT", "/v1/cluster/settings") => json!({"auto_failover_timeout_s": 120}).to_string(),
        _ => String::new(),
    };
    (path, body)
}

/// What a route's rule asks, as `shoal_meta::Needs` (`None`: no user needed or a member's secret).
fn needs(rule: &str) -> Option<Needs> {
    Some(match rule {
        "Open" | "Members" => return None,
        "User" => Needs::User,
        "Monitor" => Needs::Monitor,
        "ClusterAdmin" => Needs::ClusterAdmin,
        "Read" | "ReadOrLock" => Needs::Read("c".into()),
        "Write" => Needs::Write("c".into()),
        other => panic!("a rule this test does not know: {other}"),
    })
}

async fn put_user(http: &reqwest::Client, node: &Node, name: &str, password: &str, roles: &[&str]) -> (u16, Value) {
    let r = http.put(node.u(&format!("/v1/users/{name}"))).json(&json!({"password": password, "roles": roles})).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Every route, tried by no one, by a wrong password, and by a user of each role: `401`
/// with `WWW-Authenticate` for the first two, `403 forbidden` for a role that does not
/// grant the route, and anything but `401`/`403` for one that does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_answers_each_role_as_its_rule_says() {
    let node = Node::start(&[]);
    let admin = node.client();
    assert_eq!(admin.put(node.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    assert_eq!(admin.put(node.u("/v1/collections/other")).send().await.unwrap().status(), 201);
    let r = admin.post(node.u("/v1/collections/c/indexes")).json(&json!({"name": "by_v", "keys": ["v"]})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let roles: &[(&str, &[&str])] = &[
        ("reader", &["data_reader[c]"]),
        ("writer", &["data_writer[c]"]),
        ("other_reader", &["data_reader[other]"]),
        ("all_writer", &["data_writer[*]"]),
        ("monitor", &["metrics_reader"]),
        ("operator", &["cluster_admin"]),
        ("root", &["admin"]),
        ("nobody_much", &[]),
    ];
    for (name, list) in roles {
        assert_eq!(put_user(&admin, &node, name, "password-of-a-user", list).await.0, 200, "{name}");
    }
    // Users whose wrong password the matrix tries, one per route (failures pause a user's
    // name as they pause an address).
    let table = routes();
    for n in 0..table.len() {
        assert_eq!(put_user(&admin, &node, &format!("decoy{n}"), "password-of-the-decoy", &["admin"]).await.0, 200);
    }
    let plain = common::plain_client_builder().timeout(Duration::from_secs(60)).build().unwrap();
    let mut tried = 0;
    for (n, (method, route, rule)) in table.into_iter().enumerate() {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let (path, body) = instance(method.as_str(), &route);
        // Failed logins pause their source address: each route's come from an address of
        // its own, so that they stay below the pause.
        let failing = common::plain_client_builder()
            .local_address(std::net::IpAddr::from([127, 0, 1, u8::try_from(n + 1).unwrap()]))
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let send = |auth: Option<String>, fails: bool| {
            let client = if fails { &failing } else { &plain };
            let mut r = client.request(method.clone(), node.u(&path)).body(body.clone());
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            async move {
                let r = r.send().await.unwrap();
                let status = r.status().as_u16();
                let challenge = r.headers().contains_key("www-authenticate");
                (status, challenge, r.text().await.unwrap_or_default())
            }
        };
        let Some(needs) = needs(&rule) else {
            let (status, _, text) = send(None, true).await;
            match rule.as_str() {
                "Open" => assert_eq!(status, 200, "{method} {route}: {text}"),
                _ => assert_eq!(status, 401, "{method} {route} without the cluster secret: {text}"),
            }
            continue;
        };
        for auth in [None, Some(basic_auth(&format!("decoy{n}"), "wrong-password")), Some(basic_auth("stranger", "password-of-a-user"))] {
            let (status, challenge, text) = send(auth.clone(), true).await;
            assert_eq!((status, challenge), (401, true), "{method} {route} with {auth:?}: {text}");
        }
        for (name, list) in roles {
            let granted: Vec<Role> = list.iter().map(|r| r.parse().unwrap()).collect();
            let (status, _, text) = send(Some(basic_auth(name, "password-of-a-user")), false).await;
            if allows(&granted, &needs) {
                assert!(status != 401 && status != 403, "{method} {route} as {name} {list:?}: {status} {text}");
            } else {
                assert_eq!(status, 403, "{method} {route} as {name} {list:?}: {text}");
                assert!(text.contains("\"forbidden\""), "{text}");
            }
            tried += 1;
        }
    }
    assert!(tried > 200, "{tried} role checks");
    // A document read that locks writes: a reader may read but not lock.
    assert_eq!(admin.put(node.u("/v1/collections/c/docs/k")).json(&json!({"v": 1})).send().await.unwrap().status(), 200);
    let reader = |path: &str| plain.get(node.u(path)).header("authorization", basic_auth("reader", "password-of-a-user")).send();
    assert_eq!(reader("/v1/collections/c/docs/k").await.unwrap().status(), 200);
    assert_eq!(reader("/v1/collections/c/docs/k?lock=5").await.unwrap().status(), 403);
    // A HEAD asks what its GET asks.
    let head =
        |user: &str| plain.head(node.u("/v1/collections/c/docs/k")).header("authorization", basic_auth(user, "password-of-a-user")).send();
    assert_eq!(head("reader").await.unwrap().status(), 200);
    assert_eq!(head("other_reader").await.unwrap().status(), 403);
    assert_eq!(head("monitor").await.unwrap().status(), 403);
    // SQL reads only what the caller may read: every collection of a join or a subquery,
    // and the catalog only with every collection.
    let sql = |user: &str, sql: &str| {
        plain.post(node.u("/v1/query")).header("authorization", basic_auth(user, "password-of-a-user")).json(&json!({"sql": sql})).send()
    };
    assert_eq!(sql("reader", "SELECT count(*) FROM c").await.unwrap().status(), 200);
    for statement in [
        "SELECT count(*) FROM other",
        "SELECT count(*) FROM c JOIN other ON c.v = other.v",
        "SELECT count(*) FROM c WHERE v IN (SELECT v FROM other)",
        "WITH o AS (SELECT * FROM other) SELECT count(*) FROM o",
        "SELECT * FROM information_schema.tables",
        "EXPLAIN SELECT * FROM other",
    ] {
        let r = sql("reader", statement).await.unwrap();
        assert_eq!(r.status(), 403, "{statement}: {}", r.text().await.unwrap_or_default());
    }
    assert_eq!(sql("all_writer", "SELECT * FROM information_schema.tables").await.unwrap().status(), 200);
    let r = sql("monitor", "SELECT * FROM information_schema.tables").await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("the catalog"), "the refusal names what was needed");
    // The collections listed are those the caller may read.
    let listed = |user: &str| {
        let r = plain.get(node.u("/v1/collections")).header("authorization", basic_auth(user, "password-of-a-user")).send();
        async move {
            let v: Value = r.await.unwrap().json().await.unwrap();
            let mut names: Vec<String> =
                v.as_array().unwrap_or_else(|| panic!("{v}")).iter().map(|c| c["name"].as_str().unwrap().to_string()).collect();
            names.sort();
            names
        }
    };
    assert_eq!(listed("reader").await, ["c"]);
    assert_eq!(listed("other_reader").await, ["other"]);
    assert_eq!(listed("nobody_much").await, Vec::<String>::new());
    assert_eq!(listed("monitor").await, ["c", "made", "other"]);
    assert_eq!(sql("reader", "WITH other AS (SELECT * FROM c) SELECT count(*) FROM other").await.unwrap().status(), 200);
    // The audit trail has a line for each failed login, each refusal and each change made.
    let trail = audit_trail(&node);
    let has = |event: &str, user: &str, path: &str| trail.iter().any(|l| l["event"] == event && l["user"] == user && l["path"] == path);
    assert!(has("login_failed", "decoy1", "/v1/node"), "a failed login");
    assert!(has("login_failed", "stranger", "/v1/node"), "an unknown user");
    assert!(has("forbidden", "reader", "/v1/collections/made"), "a refusal");
    assert!(trail
        .iter()
        .any(|l| l["event"] == "change" && l["user"] == "root" && l["path"] == "/v1/collections/made" && l["method"] == "PUT"));
    assert!(trail.iter().any(|l| l["event"] == "change" && l["user"] == "admin" && l["path"] == "/v1/users/reader" && l["status"] == 200));
    assert!(!trail.iter().any(|l| l["event"] == "change" && l["method"] == "GET"), "reads are not changes");
    assert!(!trail.iter().any(|l| l.to_string().contains("password-of-a-user")), "no password in the trail");
}

/// The lines of a node's audit trail.
fn audit_trail(node: &Node) -> Vec<Value> {
    let text = std::fs::read_to_string(node.dir.join("audit.log")).expect("the audit trail");
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect()
}

/// Users: a cluster admin manages users but not admins; the last admin stays; a password
/// change or a deletion ends the old credentials at once, and a role change applies to the
/// next call; names, passwords and roles past their limits are refused clearly.
#[tokio::test]
async fn users_are_managed_with_their_limits_and_changes_apply_at_once() {
    let node = Node::start(&[]);
    let admin = node.client();
    assert_eq!(admin.put(node.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    assert_eq!(put_user(&admin, &node, "ops", "ops-password", &["cluster_admin"]).await.0, 200);
    let as_user = |user: &str, password: &str| {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("authorization", basic_auth(user, password).parse().unwrap());
        common::plain_client_builder().default_headers(h).build().unwrap()
    };
    let ops = as_user("ops", "ops-password");
    let (_, me) = (200, ops.get(node.u("/v1/whoami")).send().await.unwrap().json::<Value>().await.unwrap());
    assert_eq!(me, json!({"name": "ops", "roles": ["cluster_admin"]}));
    // A cluster admin makes users, but neither an admin nor changes one.
    assert_eq!(put_user(&ops, &node, "app", "app-password", &["data_writer[c]"]).await.0, 200);
    assert_eq!(put_user(&ops, &node, "boss", "boss-password", &["admin"]).await.0, 403);
    assert_eq!(put_user(&ops, &node, "admin", "new-password", &["admin"]).await.0, 403);
    assert_eq!(ops.delete(node.u("/v1/users/admin")).send().await.unwrap().status(), 403);
    // The last admin stays.
    let r = admin.delete(node.u("/v1/users/admin")).send().await.unwrap();
    assert_eq!(r.status(), 400, "{}", r.text().await.unwrap_or_default());
    let r = admin.delete(node.u("/v1/users/ghost")).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.json::<Value>().await.unwrap()["error"].clone()), (404, json!("user_not_found")));
    // Changes apply to the next call, though the old credentials were verified (cached).
    let app = as_user("app", "app-password");
    assert_eq!(app.put(node.u("/v1/collections/c/docs/k")).json(&json!({"v": 1})).send().await.unwrap().status(), 200);
    assert_eq!(put_user(&admin, &node, "app", "app-password", &["data_reader[c]"]).await.0, 200);
    assert_eq!(app.put(node.u("/v1/collections/c/docs/k")).json(&json!({"v": 2})).send().await.unwrap().status(), 403);
    assert_eq!(app.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap().status(), 200);
    assert_eq!(put_user(&admin, &node, "app", "app-password-2", &["data_reader[c]"]).await.0, 200);
    assert_eq!(app.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap().status(), 401, "the old password ends at once");
    let app2 = as_user("app", "app-password-2");
    assert_eq!(app2.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap().status(), 200);
    assert_eq!(admin.delete(node.u("/v1/users/app")).send().await.unwrap().status(), 200);
    assert_eq!(app2.get(node.u("/v1/collections/c/docs/k")).send().await.unwrap().status(), 401, "a deleted user ends at once");
    // Limits and bad input.
    let name_max = "n".repeat(64);
    assert_eq!(put_user(&admin, &node, &name_max, "12345678", &[]).await.0, 200, "64-byte name, 8-byte password");
    for (name, password, roles, why) in [
        ("n".repeat(65), "12345678".to_string(), vec![], "65-byte name"),
        ("a:b".to_string(), "12345678".to_string(), vec![], "a colon in the name"),
        ("short".to_string(), "1234567".to_string(), vec![], "7-byte password"),
        ("long".to_string(), "p".repeat(257), vec![], "257-byte password"),
        ("r".to_string(), "12345678".to_string(), vec!["data_reader[missing]"], "a role naming no collection"),
        ("r".to_string(), "12345678".to_string(), vec!["root"], "no such role"),
        ("r".to_string(), "12345678".to_string(), vec!["data_reader[]"], "an empty scope"),
    ] {
        let (status, v) = put_user(&admin, &node, &name, &password, &roles).await;
        assert_eq!((status, v["error"].as_str()), (400, Some("bad_request")), "{why}: {v}");
    }
    assert_eq!(put_user(&admin, &node, "p", &"p".repeat(256), &[]).await.0, 200, "256-byte password");
    for bad in ["{", "[]", r#"{"roles": []}"#, r#"{"password": "12345678", "extra": 1}"#, r#"{"password": 5}"#] {
        let r = admin.put(node.u("/v1/users/x")).body(bad).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}: {}", r.text().await.unwrap_or_default());
    }
    let listed: Value = admin.get(node.u("/v1/users")).send().await.unwrap().json().await.unwrap();
    assert!(!listed.to_string().contains("argon2"), "no hash is ever answered: {listed}");
}

/// Malformed `Authorization` headers are `401`s (or `431` for one past the header limit),
/// never a crash; forged member headers are refused; a client's `x-shoal-forwarded` grants
/// nothing.
#[tokio::test]
async fn malformed_and_forged_credentials_are_refused() {
    let node = Node::start(&[]);
    let admin = node.client();
    assert_eq!(admin.put(node.u("/v1/collections/c")).send().await.unwrap().status(), 201);
    assert_eq!(put_user(&admin, &node, "reader", "reader-password", &["data_reader[c]"]).await.0, 200);
    let plain = common::plain_client_builder().build().unwrap();
    let huge = format!("Basic {}", "A".repeat(100 * 1024));
    for value in ["Basic", "Basic YWRtaW4=", "Basic !!!", "Bearer abc", "basic", "Basic YWRtaW46", &huge] {
        let r = plain.get(node.u("/v1/whoami")).header("authorization", value).send().await.unwrap();
        let status = r.status().as_u16();
        assert!(status == 401 || status == 431, "{}: {status}", &value[..value.len().min(20)]);
    }
    // A member's signed user, forged: refused, whatever the Basic credentials.
    for forged in ["admin 99999999999 00", "admin", "admin x y", "admin 1 abcd"] {
        let r = plain
            .put(node.u("/v1/collections/c/docs/k"))
            .header("authorization", basic_auth("reader", "reader-password"))
            .header("x-shoal-user", forged)
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{forged}");
    }
    // The forwarded mark from a client counts for nothing: no credentials, no answer.
    let r = plain.get(node.u("/v1/collections/c/docs/k")).header("x-shoal-forwarded", "1").send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = plain
        .put(node.u("/v1/collections/c/docs/k"))
        .header("x-shoal-forwarded", "1")
        .header("authorization", basic_auth("reader", "reader-password"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(plain.get(node.u("/v1/health")).send().await.unwrap().status(), 200);
}

/// Failed logins from one address and for one user slow down, then answer `429` with
/// `Retry-After`; other addresses and other users are not slowed.
#[tokio::test]
async fn brute_force_is_slowed_without_slowing_others() {
    let node = Node::start(&[]);
    let admin = node.client();
    assert_eq!(put_user(&admin, &node, "victim", "victim-password", &["metrics_reader"]).await.0, 200);
    assert_eq!(put_user(&admin, &node, "bystander", "bystander-password", &["metrics_reader"]).await.0, 200);
    let from = |ip: [u8; 4]| common::plain_client_builder().local_address(std::net::IpAddr::from(ip)).build().unwrap();
    let attacker = from([127, 0, 0, 3]);
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for i in 0..8 {
        let r =
            attacker.get(node.u("/v1/whoami")).header("authorization", basic_auth("victim", &format!("guess-{i}"))).send().await.unwrap();
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            retry_after = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
            assert_eq!(r.json::<Value>().await.unwrap()["error"], "too_many_requests");
        }
    }
    assert_eq!(&statuses[..5], &[401; 5], "{statuses:?}");
    assert!(statuses[5..].contains(&429), "{statuses:?}");
    assert!(retry_after.is_some_and(|s| (1..=60).contains(&s)), "{retry_after:?}");
    // Another address and another user go on as before.
    let bystander = from([127, 0, 0, 2]);
    let r =
        bystander.get(node.u("/v1/whoami")).header("authorization", basic_auth("bystander", "bystander-password")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(admin.get(node.u("/v1/whoami")).send().await.unwrap().status(), 200);
    // The right password from the attacker's address waits too while the pause lasts.
    let r = attacker.get(node.u("/v1/whoami")).header("authorization", basic_auth("victim", "victim-password")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let trail = audit_trail(&node);
    let from_attacker =
        |event: &str| trail.iter().filter(|l| l["event"] == event && l["source"] == "127.0.0.3" && l["user"] == "victim").count();
    assert_eq!(from_attacker("login_failed"), statuses.iter().filter(|s| **s == 401).count());
    assert!(from_attacker("login_paused") >= 2);
}

/// The first start with no password given makes `admin` with a generated one: told once
/// on stderr, kept in `<data>/admin-password` (mode 0600), and working; no password is
/// stored anywhere in the data directory in clear.
#[tokio::test]
async fn the_first_admin_and_no_password_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let mut child = std::process::Command::new(common::binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--cache-mb", "32", "--data-path"])
        .arg(&dir)
        .env("SHOAL_LOG", "warn")
        .env_remove("SHOAL_ADMIN_PASSWORD")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let url = stdout.next().unwrap().unwrap().strip_prefix("shoal listening on ").unwrap().to_string();
    let stderr = child.stderr.take().unwrap();
    let told = std::thread::spawn(move || {
        std::io::BufReader::new(stderr).lines().map_while(Result::ok).find(|l| l.contains("created the user `admin`")).unwrap_or_default()
    });
    let file = dir.join("admin-password");
    let http = common::plain_client_builder().build().unwrap();
    common::eventually(30, "the admin password file", || {
        let file = file.clone();
        async move { file.exists() }
    })
    .await;
    let password = std::fs::read_to_string(&file).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    let line = told.join().unwrap();
    assert!(line.contains(password.trim()), "the password is told once on stderr: {line:?}");
    let r = http.get(format!("{url}/v1/whoami")).header("authorization", basic_auth("admin", password.trim())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let admin = {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("authorization", basic_auth("admin", password.trim()).parse().unwrap());
        common::plain_client_builder().default_headers(h).build().unwrap()
    };
    assert_eq!(admin.put(format!("{url}/v1/collections/c")).send().await.unwrap().status(), 201);
    let secret_password = "a-user-password-to-look-for";
    let r = admin
        .put(format!("{url}/v1/users/u"))
        .json(&json!({"password": secret_password, "roles": ["data_reader[c]"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
    // Nothing under the data directory holds a password in clear (but the admin's file).
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let bytes = std::fs::read(&path).unwrap_or_default();
            let holds = |needle: &str| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
            assert!(!holds(secret_password), "{} holds a user's password", path.display());
            if path != file {
                assert!(!holds(password.trim()), "{} holds the admin's password", path.display());
            }
        }
    }
}

/// Users live in the metadata log: one made on one member works on the others, for key
/// requests forwarded between members too (the member passes the user on, signed), and
/// its rights hold there; after the metadata leader is killed, the users are still there
/// on the others, and users can still be made and deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn users_live_on_every_member_and_outlive_the_metadata_leader() {
    let mut nodes = common::cluster::start_cluster(3, &[]);
    let admin = nodes[0].client();
    wait_for(&admin, &nodes[0].u("/v1/cluster"), "three members", |v| member_states(v).len() == 3).await;
    rebalance(&admin, &nodes[0], &[]).await;
    let r = admin.put(nodes[0].u("/v1/cluster/settings")).json(&json!({"replicas": 1})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    rebalance(&admin, &nodes[0], &[]).await;
    assert_eq!(admin.put(nodes[0].u("/v1/collections/c")).send().await.unwrap().status(), 201);
    for i in 0..20 {
        let r = admin.put(nodes[0].u(&format!("/v1/collections/c/docs/k{i}"))).json(&json!({"v": i})).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(put_user(&admin, &nodes[1], "reader", "reader-password", &["data_reader[c]"]).await.0, 200);
    let plain = common::plain_client_builder().build().unwrap();
    let check = |node: &Node| {
        let (plain, node_u) = (plain.clone(), node.u(""));
        async move {
            for i in 0..20 {
                // Keys live on the other members too: those requests are forwarded.
                let r = plain
                    .get(format!("{node_u}/v1/collections/c/docs/k{i}"))
                    .header("authorization", basic_auth("reader", "reader-password"))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "k{i} through {node_u}");
                let r = plain
                    .put(format!("{node_u}/v1/collections/c/docs/k{i}"))
                    .header("authorization", basic_auth("reader", "reader-password"))
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 403, "a reader's write of k{i} through {node_u}");
            }
            let r = plain
                .post(format!("{node_u}/v1/collections/c/_get"))
                .header("authorization", basic_auth("reader", "reader-password"))
                .json(&json!({"keys": (0..20).map(|i| format!("k{i}")).collect::<Vec<_>>()}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let text = r.text().await.unwrap();
            assert_eq!(text.matches("\"value\"").count(), 20, "every key read across the members: {text}");
            let r = plain
                .post(format!("{node_u}/v1/query"))
                .header("authorization", basic_auth("reader", "reader-password"))
                .json(&json!({"sql": "SELECT count(*) AS n FROM c"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.json::<Value>().await.unwrap()["rows"], json!([[20]]));
        }
    };
    for node in &nodes {
        check(node).await;
    }
    // kill -9 the metadata leader: the survivors elect another, fail the dead one over, and
    // keep every user.
    let (_, info) = common::cluster::get_json(&admin, &nodes[0].u("/v1/cluster")).await;
    let leader = info["leader"].as_u64().unwrap();
    let victim = (0..3).find(|&i| common::cluster::node_id(&info, &nodes[i]) == Some(leader)).unwrap();
    nodes[victim].kill9();
    let alive: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let survivor = &nodes[alive[0]];
    wait_for(&admin, &survivor.u("/v1/cluster"), "the dead leader failed over", |v| {
        v["nodes"].as_array().is_some_and(|ns| ns.iter().any(|n| n["state"] == "failed"))
            && v["leader"].as_u64().is_some_and(|l| l != leader)
    })
    .await;
    for &i in &alive {
        // A survivor that lost contact with the dead leader answers 503 until it hears from
        // the new one (a clear error, not a wrong answer): the checks start once it serves.
        wait_for(&admin, &nodes[i].u("/v1/collections/c/docs/k0"), "the survivor serving again", |v| v["v"] == json!(0)).await;
    }
    for &i in &alive {
        check(&nodes[i]).await;
    }
    assert_eq!(put_user(&admin, survivor, "later", "later-password", &["metrics_reader"]).await.0, 200);
    let r = plain.get(nodes[alive[1]].u("/v1/whoami")).header("authorization", basic_auth("later", "later-password")).send().await.unwrap();
    assert_eq!(r.status(), 200, "a user made after the failover works on the other survivor");
    assert_eq!(admin.delete(nodes[alive[1]].u("/v1/users/reader")).send().await.unwrap().status(), 200);
    let r = plain.get(survivor.u("/v1/whoami")).header("authorization", basic_auth("reader", "reader-password")).send().await.unwrap();
    assert_eq!(r.status(), 401, "a user deleted on one survivor is gone on the other");
}
