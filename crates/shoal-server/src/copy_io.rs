//! A partition copy's bytes on the wire, moved off the threads that serve requests.
//!
//! A copy sends a partition's files (a gigabyte or more) over one connection. Served as an
//! HTTP body, its socket reads and writes ran on the runtime's worker threads, beside every
//! client request: the receiving node's request threads spent half their CPU on it during a
//! swap (bench/results/2026-11-24-issue14-copy-io.md; the foreground's p99 itself barely
//! moved — most of its rise is the copies' kernel time on shared cores).
//!
//! So the export switches its connection from HTTP to the copy stream's own bytes (an
//! HTTP/1.1 upgrade to [`COPY_PROTOCOL`], after the usual request and its checks), and both
//! ends move those bytes on [`CopyIo`]'s thread: a runtime of its own, one thread, at the
//! copies' idle priority (`shoal_storage::threads::idle_this_thread`). The request threads only see the
//! call start, and the chunks the copy hands to the ingest.

use std::time::Duration;

use axum::http::header;
use bytes::{Bytes, BytesMut};
use shoal_node::copy::COPY_IDLE_TIMEOUT;
use shoal_node::{ClusterError, PeerError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

/// The protocol an export's connection switches to (the `Upgrade` header's value): the
/// copy stream's frames, raw, until the source closes its side.
pub const COPY_PROTOCOL: &str = "shoal-copy";
/// The receiver hands the copy on in chunks of about this many bytes (fewer wake-ups of the
/// copy's task on the request threads than one per socket read).
pub const COPY_READ_BYTES: usize = 1024 * 1024;
/// Chunks read ahead of the copy's ingest.
const COPY_READ_AHEAD_CHUNKS: usize = 4;

/// The copies' network thread: a current-thread runtime at the idle priority. It stops
/// when this is dropped (copies under way break, and their receivers fall back).
pub struct CopyIo {
    handle: tokio::runtime::Handle,
    _stop: oneshot::Sender<()>,
}

impl CopyIo {
    pub fn start() -> std::io::Result<CopyIo> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new().name("shoal-copy-io".into()).spawn(move || {
            shoal_storage::threads::idle_this_thread();
            runtime.block_on(async {
                let _ = stopped.await;
            });
        })?;
        Ok(CopyIo { handle, _stop: stop })
    }

    /// The source's side: once `upgrade` completes (the `101` answer is out), writes the
    /// export's chunks to the connection and closes it. An export that fails, or a receiver
    /// that stops reading for [`COPY_IDLE_TIMEOUT`], ends the connection without the
    /// stream's end marker: the receiver keeps nothing.
    pub fn send(&self, upgrade: hyper::upgrade::OnUpgrade, mut chunks: mpsc::Receiver<Result<Bytes, ClusterError>>) {
        self.handle.spawn(async move {
            let io = match tokio::time::timeout(COPY_IDLE_TIMEOUT, upgrade).await {
                Ok(Ok(io)) => io,
                Ok(Err(e)) => return tracing::debug!(error = %e, "a copy's connection did not switch protocols"),
                Err(_) => return tracing::debug!("a copy's connection did not switch protocols in time"),
            };
            let mut io = hyper_util::rt::TokioIo::new(io);
            while let Some(chunk) = chunks.recv().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(e) => return tracing::info!(error = %e, "an export failed; its copy ends without its end marker"),
                };
                match tokio::time::timeout(COPY_IDLE_TIMEOUT, io.write_all(&chunk)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return tracing::debug!(error = %e, "a copy's receiver went away"),
                    Err(_) => return tracing::info!("a copy's receiver stopped reading; closing its connection"),
                }
            }
            let _ = tokio::time::timeout(COPY_IDLE_TIMEOUT, io.shutdown()).await;
        });
    }

    /// The receiver's side: sends `request` (an export asking to switch to
    /// [`COPY_PROTOCOL`]) from this thread, so that the connection and its reads live here,
    /// and answers the copy's bytes as chunks, or why the call failed. `timeout` bounds the
    /// wait for the answer to start; the caller bounds the gaps between chunks (and a read
    /// that waits [`COPY_IDLE_TIMEOUT`] ends the copy here too).
    pub async fn receive(
        &self,
        address: &str,
        request: reqwest::RequestBuilder,
        timeout: Duration,
    ) -> Result<mpsc::Receiver<Result<Bytes, PeerError>>, PeerError> {
        let request = request.header(header::CONNECTION, "upgrade").header(header::UPGRADE, COPY_PROTOCOL);
        let (started_tx, started) = oneshot::channel();
        let (tx, rx) = mpsc::channel(COPY_READ_AHEAD_CHUNKS);
        let address = address.to_string();
        let stopped = PeerError::Unreachable { address: address.clone(), why: "the copy's network thread stopped".into() };
        let unreachable = {
            let address = address.clone();
            move |why: String| PeerError::Unreachable { address: address.clone(), why }
        };
        self.handle.spawn(async move {
            let response = match tokio::time::timeout(timeout, request.send()).await {
                Err(_) => return drop(started_tx.send(Err(unreachable(format!("no answer in {timeout:?}"))))),
                Ok(Err(e)) => return drop(started_tx.send(Err(unreachable(e.to_string())))),
                Ok(Ok(response)) => response,
            };
            let status = response.status();
            if status != reqwest::StatusCode::SWITCHING_PROTOCOLS {
                let failed = match response.bytes().await {
                    Err(e) => unreachable(e.to_string()),
                    Ok(_) if status.is_success() => PeerError::Refused {
                        address,
                        code: "bad_request".into(),
                        message: format!("answered {status} to a copy, not `101`"),
                    },
                    Ok(bytes) => crate::cluster::refusal(address, status, &bytes),
                };
                return drop(started_tx.send(Err(failed)));
            }
            let mut io = match response.upgrade().await {
                Ok(io) => io,
                Err(e) => return drop(started_tx.send(Err(unreachable(e.to_string())))),
            };
            if started_tx.send(Ok(())).is_err() {
                return;
            }
            loop {
                let mut chunk = BytesMut::with_capacity(COPY_READ_BYTES);
                let mut ended = false;
                while chunk.len() < COPY_READ_BYTES && !ended {
                    let read = tokio::select! {
                        read = tokio::time::timeout(COPY_IDLE_TIMEOUT, io.read_buf(&mut chunk)) => read,
                        _ = tx.closed() => return, // the copy gave up
                    };
                    match read {
                        Ok(Ok(0)) => ended = true,
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return drop(tx.send(Err(unreachable(e.to_string()))).await),
                        Err(_) => return drop(tx.send(Err(unreachable(format!("sent nothing for {COPY_IDLE_TIMEOUT:?}")))).await),
                    }
                }
                if !chunk.is_empty() && tx.send(Ok(chunk.freeze())).await.is_err() {
                    return;
                }
                if ended {
                    return;
                }
            }
        });
        match started.await {
            Ok(outcome) => outcome.map(|()| rx),
            Err(_) => Err(stopped),
        }
    }
}
