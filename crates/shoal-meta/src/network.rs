//! The Raft network as a byte boundary. openraft's `RaftNetworkFactory` is implemented once,
//! here, over `MetaTransport`: a request is JSON bytes sent to a member's address, the answer
//! is JSON bytes back. The server carries those bytes over its one HTTP port with the cluster
//! secret; tests use `InProcessRouter`, a router of channels.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Raft};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

use crate::pre_vote::{Heard, PreVoteRequest};
use crate::TypeConfig;

type NodeId = u64;

/// Requests a router task holds for one member before senders wait.
const ROUTER_QUEUE_MAX: usize = 256;

/// Which Raft call a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RpcKind {
    AppendEntries,
    Vote,
    InstallSnapshot,
    /// Would the voter vote for the sender? (`crate::pre_vote`.)
    PreVote,
}

/// Why a message did not reach its member or its answer did not come back.
#[derive(Debug, Clone, Error)]
pub enum TransportError {
    /// The member cannot be reached now (down, partitioned, refusing): Raft backs off.
    #[error("member at {address} is unreachable: {why}")]
    Unreachable { address: String, why: String },
    /// The message went out but failed (bad answer, timeout, refused by the receiver).
    #[error("message to {address} failed: {why}")]
    Failed { address: String, why: String },
}

/// Carries Raft messages between members. `send` delivers `body` to the member at `address`
/// (whose id is `target`), which hands it to its `MetaNode::handle_rpc`, and returns that
/// call's answer bytes. Implementations add the cluster secret and any framing; they must not
/// interpret the bytes.
pub trait MetaTransport: Send + Sync + 'static {
    fn send(
        &self,
        target: NodeId,
        address: &str,
        kind: RpcKind,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send;
}

impl<T: MetaTransport> MetaTransport for Arc<T> {
    fn send(
        &self,
        target: NodeId,
        address: &str,
        kind: RpcKind,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send {
        T::send(self, target, address, kind, body)
    }
}

/// Why a received message could not be handled.
#[derive(Debug, Error)]
pub enum RpcHandleError {
    #[error("malformed {kind:?} request: {why}")]
    BadRequest { kind: RpcKind, why: String },
    #[error("cannot encode the answer: {0}")]
    Encode(String),
}

/// Decodes a received message's body.
pub(crate) fn decode<T: DeserializeOwned>(kind: RpcKind, body: &[u8]) -> Result<T, RpcHandleError> {
    serde_json::from_slice(body).map_err(|e| RpcHandleError::BadRequest { kind, why: e.to_string() })
}

/// Answers one received message with the local Raft: decodes the request, calls Raft, and
/// encodes its `Result` (a remote Raft error travels back as data, not as a transport error).
/// Messages that move this member's election timer (an append-entries or snapshot from a
/// leader it accepts) touch `heard`.
pub(crate) async fn handle_rpc(raft: &Raft<TypeConfig>, heard: &Heard, kind: RpcKind, body: &[u8]) -> Result<Vec<u8>, RpcHandleError> {
    let encoded = match kind {
        RpcKind::AppendEntries => {
            let answer = raft.append_entries(decode(kind, body)?).await;
            if answer.as_ref().is_ok_and(|a| !matches!(a, AppendEntriesResponse::HigherVote(_))) {
                heard.touch();
            }
            serde_json::to_vec(&answer)
        }
        RpcKind::Vote => serde_json::to_vec(&raft.vote(decode(kind, body)?).await),
        RpcKind::InstallSnapshot => {
            let answer = raft.install_snapshot(decode(kind, body)?).await;
            if answer.is_ok() {
                heard.touch();
            }
            serde_json::to_vec(&answer)
        }
        RpcKind::PreVote => {
            let req: PreVoteRequest = decode(kind, body)?;
            serde_json::to_vec(&crate::pre_vote::answer(raft, heard, &req))
        }
    };
    encoded.map_err(|e| RpcHandleError::Encode(e.to_string()))
}

/// openraft's network factory over a `MetaTransport`.
pub struct MetaNetwork<T> {
    transport: Arc<T>,
}

impl<T> MetaNetwork<T> {
    pub fn new(transport: Arc<T>) -> Self {
        MetaNetwork { transport }
    }
}

/// A connection to one member.
pub struct MetaConnection<T> {
    transport: Arc<T>,
    target: NodeId,
    node: BasicNode,
}

impl<T: MetaTransport> RaftNetworkFactory<TypeConfig> for MetaNetwork<T> {
    type Network = MetaConnection<T>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        MetaConnection { transport: Arc::clone(&self.transport), target, node: node.clone() }
    }
}

impl<T: MetaTransport> MetaConnection<T> {
    async fn call<Req, Resp, E>(
        &self,
        kind: RpcKind,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let body = serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let sent = self.transport.send(self.target, &self.node.addr, kind, body);
        // The transport may have no deadline of its own; Raft's hard TTL bounds every call.
        let answer = match tokio::time::timeout(option.hard_ttl(), sent).await {
            Err(_) => {
                let e = TransportError::Failed { address: self.node.addr.clone(), why: format!("no answer in {:?}", option.hard_ttl()) };
                return Err(RPCError::Network(NetworkError::new(&e)));
            }
            Ok(Err(e @ TransportError::Unreachable { .. })) => return Err(RPCError::Unreachable(Unreachable::new(&e))),
            Ok(Err(e)) => return Err(RPCError::Network(NetworkError::new(&e))),
            Ok(Ok(bytes)) => bytes,
        };
        let result: Result<Resp, RaftError<NodeId, E>> =
            serde_json::from_slice(&answer).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
    }
}

impl<T: MetaTransport> RaftNetwork<TypeConfig> for MetaConnection<T> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(RpcKind::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>> {
        self.call(RpcKind::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(RpcKind::Vote, &rpc, &option).await
    }
}

/// One message on its way to a member in the process.
struct Envelope {
    kind: RpcKind,
    body: Vec<u8>,
    reply: oneshot::Sender<Result<Vec<u8>, String>>,
}

/// An in-process transport for tests: members register their address with `serve` and the
/// router delivers messages over channels. `unplug` takes a member off (as if it died) and
/// `isolate` makes one address unreachable (the router does not know senders, so the cut is
/// one way: what the isolated member sends still arrives).
#[derive(Default)]
pub struct InProcessRouter {
    routes: Mutex<HashMap<String, mpsc::Sender<Envelope>>>,
    isolated: Mutex<HashSet<String>>,
}

impl InProcessRouter {
    pub fn new() -> Arc<InProcessRouter> {
        Arc::new(InProcessRouter::default())
    }

    /// Delivers messages for `address` to `node` until `unplug` (or the router is dropped).
    pub fn serve(&self, address: &str, node: &crate::MetaNode) {
        let (tx, mut rx) = mpsc::channel::<Envelope>(ROUTER_QUEUE_MAX);
        let responder = node.responder();
        tokio::spawn(async move {
            while let Some(env) = rx.recv().await {
                let responder = responder.clone();
                // One task per message: a slow call (a snapshot) must not hold up heartbeats.
                tokio::spawn(async move {
                    let answer = responder.handle(env.kind, &env.body).await.map_err(|e| e.to_string());
                    let _ = env.reply.send(answer);
                });
            }
        });
        self.routes.lock().insert(address.to_string(), tx);
    }

    /// Takes `address` off the router: messages to it are unreachable.
    pub fn unplug(&self, address: &str) {
        self.routes.lock().remove(address);
    }

    /// Makes `address` unreachable (true) or reachable again (false).
    pub fn isolate(&self, address: &str, cut: bool) {
        let mut isolated = self.isolated.lock();
        if cut {
            isolated.insert(address.to_string());
        } else {
            isolated.remove(address);
        }
    }
}

impl MetaTransport for InProcessRouter {
    async fn send(&self, _target: NodeId, address: &str, kind: RpcKind, body: Vec<u8>) -> Result<Vec<u8>, TransportError> {
        let unreachable = |why: &str| TransportError::Unreachable { address: address.to_string(), why: why.to_string() };
        if self.isolated.lock().contains(address) {
            return Err(unreachable("isolated"));
        }
        let route = self.routes.lock().get(address).cloned().ok_or_else(|| unreachable("no member serves this address"))?;
        let (reply, answer) = oneshot::channel();
        route.send(Envelope { kind, body, reply }).await.map_err(|_| unreachable("the member stopped"))?;
        match answer.await {
            Err(_) => Err(unreachable("the member stopped")),
            Ok(Err(why)) => Err(TransportError::Failed { address: address.to_string(), why }),
            Ok(Ok(bytes)) => Ok(bytes),
        }
    }
}
