//! Connections: the accept loop, the connection cap, and the timeouts that keep idle, slow
//! or silent clients from holding the node's resources.
//!
//! hyper serves each connection (HTTP/1.1 or h2c, told apart by the preface). On top of it:
//! - at most [`CONNECTIONS_MAX`] connections; one more is closed at once (and counted), so
//!   a flood of connections costs file descriptors up to the cap and no more;
//! - an HTTP/1 request's headers must arrive within [`HEADER_READ_TIMEOUT`] of its first
//!   byte (a slow-header client is closed);
//! - a connection with no request in flight and no bytes moving for [`IDLE_TIMEOUT`] is
//!   closed, whatever its protocol: this also covers a client that connects and never
//!   sends a preface, which hyper alone would wait for forever. It is longer than the
//!   usual clients' pool idle time (reqwest, Go: 90 s), so that a client never sends a
//!   request on a connection the server is closing at that moment. (hyper's own header
//!   timer also runs while a keep-alive connection waits idle, which is exactly that race,
//!   so it is not used.)
//! - request bodies have their own deadline (see [`crate::extract::body`]);
//! - a connection that ended normally closes lingering (see `linger`): a refused body's
//!   unread bytes would otherwise make the kernel reset it before the client read the answer.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::tls::{MemberCert, Tls, TLS_HANDSHAKE_RECORD, TLS_HANDSHAKE_TIMEOUT};
use crate::ConnectionLimits;

/// Most client connections open at once.
pub const CONNECTIONS_MAX: usize = 8192;
/// Longest wait for an HTTP/1 request's headers, from their first byte.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// A connection with nothing in flight and no bytes moving for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// A request body's first deadline (extended as bytes arrive; see `extract::body`).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a connection checks its timeouts.
const TIMEOUT_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// The HTTP/2 connection preface's first bytes.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";
/// `partial_since_ms` when no request head is partly read.
const NO_PARTIAL: u64 = u64::MAX;
/// `preface_matched` once the first bytes differ from the HTTP/2 preface.
const PREFACE_MISMATCH: usize = usize::MAX;
/// HTTP/2 pings an idle peer this often and closes the connection if it does not answer.
const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Concurrent streams one HTTP/2 connection may open.
const H2_STREAMS_MAX: u32 = 256;
/// Longest a refusal over the connection cap may take to write.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// A connection that ended with its answer sent is closed only once the client has closed
/// its side, or after this long (a lingering close, as nginx's `lingering_timeout`)...
const LINGER_TIMEOUT: Duration = Duration::from_secs(2);
/// ...or after this many bytes were read and thrown away meanwhile.
const LINGER_MAX_BYTES: usize = 64 << 20;
/// Pause after an accept error (out of file descriptors) before accepting again.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// How long a shutdown waits for open requests (long feeds are told to end at once).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What moves on one connection: when bytes last moved, requests whose answer has not
/// been sent in full, and since when a request head has been arriving.
struct Activity {
    born: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// When the first byte of a request head not yet complete arrived (HTTP/1 only).
    partial_since_ms: AtomicU64,
    /// Whether the client spoke HTTP/2 (its frames are not request heads).
    h2: std::sync::atomic::AtomicBool,
    /// How many bytes of the HTTP/2 preface the first bytes matched, or [`PREFACE_MISMATCH`]
    /// (HTTP/1). A first read may hold as little as one byte, so a prefix proves nothing.
    preface_matched: AtomicUsize,
    /// Whether a write is waiting for room in the socket (the peer is not reading).
    write_blocked: std::sync::atomic::AtomicBool,
    /// Whether the connection was handed to an upgrade (a copy stream): its socket is no
    /// longer this connection's to read.
    upgraded: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            born: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            partial_since_ms: AtomicU64::new(NO_PARTIAL),
            h2: std::sync::atomic::AtomicBool::new(false),
            preface_matched: AtomicUsize::new(0),
            write_blocked: std::sync::atomic::AtomicBool::new(false),
            upgraded: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Bytes arrived: with nothing in flight on HTTP/1 they begin (or continue) a head.
    fn read(&self, bytes: &[u8]) {
        let matched = self.preface_matched.load(Ordering::Acquire);
        if matched < H2_PREFACE.len() {
            let n = bytes.len().min(H2_PREFACE.len() - matched);
            if bytes[..n] == H2_PREFACE[matched..matched + n] {
                self.preface_matched.store(matched + n, Ordering::Release);
                if matched + n == H2_PREFACE.len() {
                    self.h2.store(true, Ordering::Release);
                    // What arrived so far was the preface, not a head.
                    self.partial_since_ms.store(NO_PARTIAL, Ordering::Release);
                }
            } else {
                self.preface_matched.store(PREFACE_MISMATCH, Ordering::Release);
            }
        }
        self.touch();
        if !self.h2.load(Ordering::Acquire) && self.in_flight.load(Ordering::Acquire) == 0 {
            let now = self.now_ms();
            let _ = self.partial_since_ms.compare_exchange(NO_PARTIAL, now, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Notes a write's outcome: bytes written are activity; a full socket means the peer is
    /// not reading.
    fn wrote(&self, r: &Poll<std::io::Result<usize>>) {
        match r {
            Poll::Ready(Ok(n)) if *n > 0 => {
                self.write_blocked.store(false, Ordering::Relaxed);
                self.touch();
            }
            Poll::Pending => self.write_blocked.store(true, Ordering::Relaxed),
            _ => {}
        }
    }

    fn idle_for(&self) -> Duration {
        Duration::from_millis(self.now_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }

    /// How long a request head has been arriving, if one is.
    fn head_for(&self) -> Option<Duration> {
        match self.partial_since_ms.load(Ordering::Acquire) {
            NO_PARTIAL => None,
            since => Some(Duration::from_millis(self.now_ms().saturating_sub(since))),
        }
    }
}

/// The connection (a socket, or TLS over it), noting activity on every read and write.
struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, data);
        self.activity.wrote(&r);
        r
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.activity.wrote(&r);
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A second descriptor of a request's socket, in the request's extensions: an export
/// switched to the copy protocol writes its files to it with `sendfile` (`copy_io`), which
/// the upgraded connection hyper hands over cannot do.
#[derive(Clone, Debug)]
pub(crate) struct Socket(pub(crate) Arc<std::net::TcpStream>);

/// The address a request's connection came from (each request carries it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub(crate) std::net::IpAddr);

/// Counts a request in flight until its answer's body is done (or dropped).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> InFlight {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        // The head is complete: hyper handed the request over.
        activity.partial_since_ms.store(NO_PARTIAL, Ordering::Release);
        InFlight(Arc::clone(activity))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

/// An answer body that holds its request's [`InFlight`] until it ends.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Accepts connections until `shutdown` turns true, then lets open requests finish for
/// [`SHUTDOWN_GRACE`].
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    tls: Option<Arc<Tls>>,
    mut shutdown: watch::Receiver<bool>,
) {
    raise_fd_limit();
    let permits = Arc::new(Semaphore::new(limits.max));
    let (closing_tx, closing) = watch::channel(false);
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let (tcp, peer): (TcpStream, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors, say: the pending connections wait in the backlog.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            _ = shutdown.wait_for(|s| *s) => break,
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            metrics::counter!("shoal_connections_refused_total").increment(1);
            tokio::spawn(refuse(tcp));
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (router, mut closing, open, tls) = (router.clone(), closing.clone(), Arc::clone(&open), tls.clone());
        tokio::spawn(async move {
            open.fetch_add(1, Ordering::Relaxed);
            metrics::gauge!("shoal_connections").increment(1.0);
            serve_one(tcp, peer, router, limits, tls, &mut closing).await;
            metrics::gauge!("shoal_connections").decrement(1.0);
            open.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    while open.load(Ordering::Relaxed) > 0 {
        if Instant::now() >= deadline {
            tracing::warn!("requests still open after the grace period; closing anyway");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A connection over the cap gets a plain `503` and is closed, without its request being
/// read: a clear answer for the client, and nothing held.
async fn refuse(mut tcp: TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"error":"unavailable","reason":"the node is at its connection limit; try again shortly"}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, tcp.write_all(answer.as_bytes())).await;
}

async fn serve_one(
    tcp: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    tls: Option<Arc<Tls>>,
    closing: &mut watch::Receiver<bool>,
) {
    // A second descriptor of the socket: when hyper is done with the connection and drops
    // its own, the socket stays open for `linger`.
    // Also handed to each request that asks to switch protocols (`Socket`): an upgraded
    // copy writes to the socket itself (not over TLS: its bytes must be encrypted).
    let lingering = {
        use std::os::fd::AsFd;
        tcp.as_fd().try_clone_to_owned().ok().map(|fd| Socket(Arc::new(std::net::TcpStream::from(fd))))
    };
    let activity = Activity::new();
    let ended = match tls {
        None => drive(tcp, peer, router, limits, closing, &activity, lingering.clone(), false).await,
        Some(tls) => match handshake(tcp, &tls).await {
            Handshake::Done(stream) => {
                // A client certificate is there only if the CA's verification passed.
                let member = stream.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
                drive(stream, peer, router, limits, closing, &activity, None, member).await
            }
            Handshake::NotTls => true,
            Handshake::Failed => false,
        },
    };
    if ended && !activity.upgraded.load(Ordering::Acquire) {
        if let Some(tcp) = lingering.and_then(|s| Arc::try_unwrap(s.0).or_else(|s| s.try_clone()).ok()) {
            linger(tcp).await;
        }
    }
}

enum Handshake {
    Done(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// The client spoke something else (plain HTTP); it was told so.
    NotTls,
    Failed,
}

/// Reads a client's TLS handshake, all of it within [`TLS_HANDSHAKE_TIMEOUT`] of the
/// connection. A client that speaks plain HTTP to the TLS port gets a plain `400` saying
/// so, rather than bytes it cannot read. Every outcome but `Done` is counted.
async fn handshake(tcp: TcpStream, tls: &Tls) -> Handshake {
    let deadline = tokio::time::Instant::now() + TLS_HANDSHAKE_TIMEOUT;
    let mut first = [0u8; 1];
    let outcome = match tokio::time::timeout_at(deadline, tcp.peek(&mut first)).await {
        Ok(Ok(1)) if first[0] != TLS_HANDSHAKE_RECORD => {
            refuse_plain(tcp).await;
            Handshake::NotTls
        }
        Ok(Ok(1)) => match tokio::time::timeout_at(deadline, tokio_rustls::TlsAcceptor::from(tls.server_config()).accept(tcp)).await {
            Ok(Ok(stream)) => return Handshake::Done(Box::new(stream)),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                Handshake::Failed
            }
            Err(_) => Handshake::Failed,
        },
        _ => Handshake::Failed,
    };
    metrics::counter!("shoal_tls_handshake_failures_total").increment(1);
    outcome
}

/// The answer to plain HTTP on the TLS port.
async fn refuse_plain(mut tcp: TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"error":"bad_request","reason":"this port speaks TLS only; call it with https://"}"#;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, tcp.write_all(answer.as_bytes())).await;
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, tcp.shutdown()).await;
}

/// After the last answer of a connection that ended normally: its side is shut (the answer
/// is all sent), and whatever the client still sends is read and thrown away until it
/// closes its side, for at most [`LINGER_TIMEOUT`] and [`LINGER_MAX_BYTES`]. Closing a
/// socket with unread bytes in it makes the kernel reset the connection, and a reset can
/// destroy an answer the client has not read yet. That is the case of a request refused
/// before its body was read (`413` for a body over its limit): the client is still
/// sending. A test saw the client get "error sending request" instead of the `413`.
async fn linger(tcp: std::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut tcp) = TcpStream::from_std(tcp) else { return };
    let _ = tcp.shutdown().await;
    let drain = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut read = 0usize;
        while read < LINGER_MAX_BYTES {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => read += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIMEOUT, drain).await;
}

/// Serves one connection until it ends; answers whether it ended by itself (the client or
/// the protocol closed it), not by one of the timeouts here (then it is simply dropped).
#[allow(clippy::too_many_arguments)]
async fn drive<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    closing: &mut watch::Receiver<bool>,
    activity: &Arc<Activity>,
    socket: Option<Socket>,
    member: bool,
) -> bool {
    let io = TokioIo::new(Watched { io, activity: Arc::clone(activity) });
    let tracker = Arc::clone(activity);
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(Peer(peer.ip()));
        if member {
            req.extensions_mut().insert(MemberCert);
        }
        if let Some(socket) = socket.as_ref().filter(|_| req.headers().contains_key(axum::http::header::UPGRADE)) {
            req.extensions_mut().insert(socket.clone());
        }
        let in_flight = InFlight::start(&tracker);
        let router = router.clone();
        let tracker = Arc::clone(&tracker);
        async move {
            use tower::ServiceExt;
            let response = router.oneshot(req.map(Body::new)).await.unwrap_or_else(|never| match never {});
            if response.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS {
                tracker.upgraded.store(true, Ordering::Release);
            }
            Ok::<_, std::convert::Infallible>(response.map(|inner| Body::new(TrackedBody { inner, _in_flight: in_flight })))
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(None).keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(H2_STREAMS_MAX);
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let mut ticker = tokio::time::interval(TIMEOUT_CHECK_INTERVAL.min(limits.idle_timeout / 2).min(limits.header_read_timeout / 2));
    let mut graceful = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return true;
            }
            _ = ticker.tick() => {
                // Dropping the connection closes it.
                if activity.in_flight.load(Ordering::Acquire) == 0 {
                    if activity.head_for().is_some_and(|d| d >= limits.header_read_timeout) {
                        tracing::debug!("closing a connection whose request headers did not arrive in time");
                        return false;
                    }
                    if activity.idle_for() >= limits.idle_timeout {
                        tracing::debug!("closing an idle connection");
                        return false;
                    }
                } else if activity.write_blocked.load(Ordering::Relaxed) && activity.idle_for() >= limits.idle_timeout {
                    // An answer the peer stopped reading would hold the connection, the
                    // answer and whatever produces it (a feed) forever.
                    tracing::debug!("closing a connection whose peer stopped reading");
                    return false;
                }
            }
            _ = closing.wait_for(|c| *c), if !graceful => {
                graceful = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Raises the soft limit of open files to the hard limit, so that the connection cap, not
/// the default 1024 descriptors, bounds the connections.
fn raise_fd_limit() {
    #[cfg(unix)]
    {
        // SAFETY: getrlimit/setrlimit write to / read from the struct we own.
        unsafe {
            let mut lim: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    tracing::debug!(error = %std::io::Error::last_os_error(), "could not raise the open-file limit");
                }
            }
        }
    }
}
