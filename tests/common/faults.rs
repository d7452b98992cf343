//! A node's data directory on a fault-injection filesystem (`shoal-faultfs`: FUSE, served by
//! a thread of the test process; needs root and /dev/fuse, as CI has).
//!
//! The filesystem's contract for a power cut: kill every process using it first
//! (`Node::kill9`), then `power_cut()`, then start them again (`Node::restart`).

use std::path::PathBuf;

use serde_json::Value;
use shoal_faultfs::{FaultFs, FaultFsOptions, MountedFaultFs};

use super::Node;

/// Flags for a node on a fault disk: few partitions, no analytics shadows (their files
/// would only add fsyncs that are not under test). The node reserves 256 MiB by default;
/// the fault disk reports a terabyte free.
pub const NODE_ARGS: &[&str] = &["--partitions", "16", "--analytics-partitions", "0"];

/// A mounted fault filesystem in a fresh temporary directory. Declare it before the node
/// that uses it, so that the node is killed before the filesystem is unmounted.
pub struct FaultDisk {
    pub fs: MountedFaultFs,
    _dir: tempfile::TempDir,
}

impl FaultDisk {
    pub fn mount() -> FaultDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = FaultFs::mount(dir.path(), FaultFsOptions::default()).expect("mount the fault filesystem (needs root and /dev/fuse)");
        FaultDisk { fs, _dir: dir }
    }

    /// Where the node keeps its data, inside the mount.
    pub fn data(&self) -> PathBuf {
        self.fs.mountpoint().join("data")
    }

    /// Starts a node on this disk with [`NODE_ARGS`].
    pub fn start_node(&self) -> Node {
        Node::start_in(self.data(), NODE_ARGS)
    }

    /// Starts a node on this disk with a fresh collection `name`, and a client for it.
    pub async fn start_node_with_collection(&self, name: &str) -> (Node, reqwest::Client) {
        let node = self.start_node();
        let c = node.client();
        let r = c.put(node.u(&format!("/v1/collections/{name}"))).send().await.expect("create the collection");
        assert_eq!(r.status(), 201, "create collection {name}");
        (node, c)
    }
}

/// `GET /v1/health`: status code and body.
pub async fn health(c: &reqwest::Client, node: &Node) -> (u16, Value) {
    let r = c.get(node.u("/v1/health")).send().await.expect("health");
    let status = r.status().as_u16();
    let text = r.text().await.expect("health body");
    super::assert_no_private_paths(&text);
    (status, serde_json::from_str(&text).expect("health is JSON"))
}

/// The value of an unlabelled metric in `GET /metrics`.
pub async fn metric(c: &reqwest::Client, node: &Node, name: &str) -> Option<f64> {
    let text = c.get(node.u("/metrics")).send().await.expect("metrics").text().await.expect("metrics body");
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}
