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

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use bytes::Bytes;
use hyper_util::rt::TokioIo;
use shoal_node::copy::{Outgoing, COPY_IDLE_TIMEOUT};
use shoal_node::{ClusterError, PeerError};
use shoal_storage::files::read_chunk;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::conn::Socket;

/// The protocol an export's connection switches to (the `Upgrade` header's value): the
/// copy stream's frames, raw, until the source closes its side.
pub const COPY_PROTOCOL: &str = "shoal-copy";
/// The receiver hands the copy on in chunks of about this many bytes (fewer wake-ups of the
/// copy's task on the request threads than one per socket read).
pub const COPY_READ_BYTES: usize = 1024 * 1024;
/// Chunks read ahead of the copy's ingest.
const COPY_READ_AHEAD_CHUNKS: usize = 4;
/// Read buffers kept for reuse once their chunk is done with: enough for the chunks in
/// flight of 8 copies at once (`COPY_READ_AHEAD_CHUNKS` each); 32 MiB held at most.
const COPY_POOLED_CHUNKS: usize = 32;

/// The receiver's read buffers, reused. A fresh 1 MiB buffer per read was memory the kernel
/// had to zero on first touch (huge pages: `clear_page_erms` under the socket read): 9 % of
/// the receiving node's CPU in a swap, more than the read's own copy (perf,
/// bench/results/2026-11-29-issue14-receive-path.md). A chunk hands its buffer back here when
/// the last slice of it is dropped (`Bytes::from_owner`). Hand-written: a free list of
/// `Vec`s behind a mutex; the pool crates either allocate their own chunk type or zero
/// what they hand out.
#[derive(Default)]
struct ChunkPool {
    free: parking_lot::Mutex<Vec<Vec<u8>>>,
}

impl ChunkPool {
    fn take(&self) -> Vec<u8> {
        self.free.lock().pop().unwrap_or_else(|| Vec::with_capacity(COPY_READ_BYTES))
    }

    /// `buf` as a chunk that comes back to this pool when done with.
    fn chunk(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(PooledChunk { buf, pool: Arc::clone(self) })
    }
}

/// A read buffer lent out as a chunk's bytes.
struct PooledChunk {
    buf: Vec<u8>,
    pool: Arc<ChunkPool>,
}

impl AsRef<[u8]> for PooledChunk {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledChunk {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut free = self.pool.free.lock();
        if free.len() < COPY_POOLED_CHUNKS && buf.capacity() >= COPY_READ_BYTES {
            free.push(buf);
        }
    }
}

/// The copies' network thread: a current-thread runtime at the idle priority. It stops
/// when this is dropped (copies under way break, and their receivers fall back).
pub struct CopyIo {
    handle: tokio::runtime::Handle,
    pool: Arc<ChunkPool>,
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
        Ok(CopyIo { handle, pool: Arc::default(), _stop: stop })
    }

    /// The source's side: once `upgrade` completes (the `101` answer is out), writes the
    /// export's pieces to the connection and closes it: bytes as they are, files' chunks
    /// straight from the page cache (`sendfile`) where the connection is a plain socket. An
    /// export that fails, or a receiver that stops reading for [`COPY_IDLE_TIMEOUT`], ends
    /// the connection without the stream's end marker: the receiver keeps nothing.
    pub(crate) fn send(
        &self,
        upgrade: hyper::upgrade::OnUpgrade,
        socket: Option<Socket>,
        mut pieces: mpsc::Receiver<Result<Outgoing, ClusterError>>,
    ) {
        self.handle.spawn(async move {
            let upgraded = match tokio::time::timeout(COPY_IDLE_TIMEOUT, upgrade).await {
                Ok(Ok(io)) => io,
                Ok(Err(e)) => return tracing::debug!(error = %e, "a copy's connection did not switch protocols"),
                Err(_) => return tracing::debug!("a copy's connection did not switch protocols in time"),
            };
            // The socket itself where the connection has one (hyper's side of it stays
            // open, unused, until the copy ends).
            let tcp = socket.and_then(|s| s.0.try_clone().ok()).and_then(|s| TcpStream::from_std(s).ok());
            let mut out = match tcp {
                Some(tcp) => Out::Socket { tcp, _upgraded: upgraded },
                None => Out::Other(TokioIo::new(upgraded)),
            };
            while let Some(piece) = pieces.recv().await {
                let piece = match piece {
                    Ok(piece) => piece,
                    Err(e) => return tracing::info!(error = %e, "an export failed; its copy ends without its end marker"),
                };
                match tokio::time::timeout(COPY_IDLE_TIMEOUT, out.write(piece)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return tracing::debug!(error = %e, "a copy's receiver went away, or its file could not be read"),
                    Err(_) => return tracing::info!("a copy's receiver stopped reading; closing its connection"),
                }
            }
            let _ = tokio::time::timeout(COPY_IDLE_TIMEOUT, out.shutdown()).await;
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
        let pool = Arc::clone(&self.pool);
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
                    Ok(bytes) => crate::transport::refusal(address, status, &bytes),
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
                let mut chunk = pool.take();
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
                if !chunk.is_empty() && tx.send(Ok(pool.chunk(chunk))).await.is_err() {
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

/// The connection an export writes to.
enum Out {
    /// The socket itself (every connection `conn` serves), and hyper's upgraded side of it,
    /// held (unused) until the copy ends.
    Socket { tcp: TcpStream, _upgraded: hyper::upgrade::Upgraded },
    /// Anything else an upgrade may carry: files' chunks are read, then written.
    Other(TokioIo<hyper::upgrade::Upgraded>),
}

impl Out {
    async fn write(&mut self, piece: Outgoing) -> std::io::Result<()> {
        match (self, piece) {
            (Out::Socket { tcp, .. }, Outgoing::Bytes(b)) => tcp.write_all(&b).await,
            (Out::Socket { tcp, .. }, Outgoing::File { file, offset, len }) => send_file(tcp, &file, offset, len).await,
            (Out::Other(io), piece) => write_read(io, piece).await,
        }
    }

    async fn shutdown(&mut self) -> std::io::Result<()> {
        match self {
            Out::Socket { tcp, .. } => tcp.shutdown().await,
            Out::Other(io) => io.shutdown().await,
        }
    }
}

/// Writes `piece` to a connection that is not a plain socket: a file's chunk is read, then
/// written.
async fn write_read<W: tokio::io::AsyncWrite + Unpin>(io: &mut W, piece: Outgoing) -> std::io::Result<()> {
    match piece {
        Outgoing::Bytes(b) => io.write_all(&b).await,
        Outgoing::File { file, offset, len } => io.write_all(&read_chunk(&file, offset, len)?).await,
    }
}

/// Sends `len` bytes of `file` from `offset` to the socket with `sendfile(2)`: the kernel
/// hands the page cache's pages to the socket, with no copy through user space. The export
/// used to read each 1 MiB chunk into a fresh buffer and write it: a memset, a read's copy
/// and a send's copy per byte, and the fresh pages' clearing, on the source's cores
/// (bench/results/2026-11-25-issue14-sendfile.md). Hand-written: tokio has no `sendfile`,
/// and the crates that wrap it are thin unmaintained shims over the same call.
async fn send_file(tcp: &TcpStream, file: &std::fs::File, mut offset: u64, mut len: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    while len > 0 {
        let sent = tcp
            .async_io(tokio::io::Interest::WRITABLE, || {
                let mut off = libc::off_t::try_from(offset).map_err(|_| std::io::Error::other("a file offset past off_t"))?;
                // SAFETY: both descriptors stay open for the call (borrowed above), and
                // `off` is a valid `off_t` the call may update.
                let n = unsafe { libc::sendfile(tcp.as_raw_fd(), file.as_raw_fd(), &mut off, len) };
                usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
            })
            .await?;
        if sent == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "a file ended before its chunk did"));
        }
        offset += sent as u64;
        len -= sent;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// A file (already unlinked) of `len` bytes that differ from one offset to the next.
    fn file_of(len: usize) -> std::fs::File {
        let path = std::env::temp_dir().join(format!("shoal-send-file-{}-{len}", std::process::id()));
        let mut f = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f
    }

    async fn pair() -> (TcpStream, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let reader = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            got
        });
        (TcpStream::connect(address).await.unwrap(), reader)
    }

    #[tokio::test]
    async fn send_file_sends_exactly_the_range_through_a_full_socket() {
        // Larger than the socket's buffers: the call meets a full socket and waits.
        let len = 12 * 1024 * 1024 + 7;
        let file = file_of(len + 5_000);
        let (mut tcp, reader) = pair().await;
        send_file(&tcp, &file, 4_321, len).await.unwrap();
        tcp.shutdown().await.unwrap();
        drop(tcp);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), len);
        assert!(got.iter().enumerate().all(|(i, b)| *b == ((i + 4_321) % 251) as u8), "the bytes are the file's from the offset");
    }

    #[tokio::test]
    async fn a_connection_that_is_not_a_socket_gets_files_chunks_read_and_written() {
        let file = std::sync::Arc::new(file_of(3 * 1024 * 1024));
        let (mut ours, mut theirs) = tokio::io::duplex(64 * 1024);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.unwrap();
            got
        });
        write_read(&mut ours, Outgoing::Bytes(Bytes::from_static(b"head"))).await.unwrap();
        write_read(&mut ours, Outgoing::File { file: std::sync::Arc::clone(&file), offset: 1_000, len: 2 * 1024 * 1024 }).await.unwrap();
        let past = write_read(&mut ours, Outgoing::File { file, offset: 3 * 1024 * 1024 - 10, len: 20 }).await.unwrap_err();
        assert_eq!(past.kind(), std::io::ErrorKind::UnexpectedEof, "{past}");
        ours.shutdown().await.unwrap();
        drop(ours);
        let got = reader.await.unwrap();
        assert_eq!(&got[..4], b"head");
        assert_eq!(got.len(), 4 + 2 * 1024 * 1024, "the failed chunk sent nothing");
        assert!(got[4..].iter().enumerate().all(|(i, b)| *b == ((i + 1_000) % 251) as u8), "the file's bytes from the offset");
    }

    /// A chunk's buffer comes back when its last slice goes, and is lent again, emptied;
    /// the pool keeps at most its bound.
    #[test]
    fn read_buffers_come_back_when_their_chunk_is_done_with() {
        let pool = Arc::new(ChunkPool::default());
        let mut buf = pool.take();
        buf.extend_from_slice(b"abcdef");
        let at = buf.as_ptr();
        let chunk = pool.chunk(buf);
        let slice = chunk.slice(2..4);
        drop(chunk);
        assert!(pool.free.lock().is_empty(), "a slice still holds the buffer");
        assert_eq!(&slice[..], b"cd");
        drop(slice);
        let again = pool.take();
        assert_eq!((again.as_ptr(), again.len()), (at, 0), "the same buffer, emptied");
        let chunks: Vec<Bytes> = (0..COPY_POOLED_CHUNKS + 3).map(|_| pool.chunk(pool.take())).collect();
        drop(chunks);
        assert_eq!(pool.free.lock().len(), COPY_POOLED_CHUNKS);
    }

    #[tokio::test]
    async fn send_file_refuses_a_range_past_the_files_end() {
        let file = file_of(10_000);
        let (tcp, _reader) = pair().await;
        let e = send_file(&tcp, &file, 6_000, 8_000).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    }
}
