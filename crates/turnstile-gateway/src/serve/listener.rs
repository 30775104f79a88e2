//! The gateway's listener: HTTP/1.1 connections with limits (issue 17).
//!
//! `axum::serve` keeps a connection as long as the client does: a client that trickles its
//! headers (slow loris) or keeps an idle connection open holds a file descriptor for ever, and
//! under a 256-descriptor limit 371 idle connections made `/healthz` unanswerable. Here:
//!
//! - every connection gets `header_read_timeout_ms` to deliver a request's headers, counted from
//!   the moment it is ready for a request: a new connection, and a kept-alive one after each
//!   response (hyper starts its header timer whenever the connection is idle), so one timeout
//!   ends both a slow-loris connection and an idle keep-alive one;
//! - at most `connections_max` connections are served; one more is still accepted, but answered
//!   by [`overloaded`]: 503 `overloaded` JSON for everything except `GET /healthz`, which is
//!   answered as usual so that a load balancer sees the process alive, and then closed (no
//!   keep-alive). Beyond that, [`OVERFLOW_CONNECTIONS_MAX`] more get the same; past those a new
//!   connection is closed at once;
//! - a request hyper refuses before the router (its head does not parse) is answered with a
//!   JSON error body like every other ([`super::parse_errors`]);
//! - a write to a client that makes no progress for `client_write_timeout_ms` closes the
//!   connection ([`super::write_timeout`]): a client that stopped reading frees what it holds;
//! - an accept error (descriptors exhausted) pauses accepting for [`ACCEPT_ERROR_PAUSE`] instead
//!   of spinning;
//! - while the process drains (`drain.rs`) every new request except `GET /healthz` and
//!   `GET /metrics` is answered 503 `shutting_down` with `Connection: close`, and every open
//!   connection is told to close once its response is written (an idle kept-alive one at once;
//!   a client stream when its dispatch ends). The listener keeps accepting until the drain is
//!   over, so a late client is refused in words rather than left in the accept queue.

//! - a request's body must arrive whole within `body_read_timeout_ms` of its headers
//!   ([`TimedBody`]): past it the read fails with [`BodyTimedOut`], the request is answered 408
//!   `body_timeout` and its connection closed (a body slow-loris held a connection for ever);
//! - the kernel queues `listen_backlog` connections before they are accepted ([`bind`]; 128 reset
//!   a burst of 500 connects on a busy host instead of answering them 503);
//! - the connection cap is lowered to what the process's descriptor limit can serve
//!   ([`Limits::within_descriptors`]): a cap above it meant EMFILE, where nothing, not even
//!   `/healthz`, is answered.

use super::api::{ApiError, ErrorCode};
use super::drain::{Drain, Phase};
use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connections answered with 503 beyond `connections_max` before new ones are closed unanswered.
pub const OVERFLOW_CONNECTIONS_MAX: usize = 64;
/// How long accepting pauses after an accept error (EMFILE, ENFILE, …).
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// How long the listener waits, once the drain is over (every dispatch ended or was handed
/// over), for open connections to write their last bytes (the last events of a stream).

/// Descriptors kept back from client connections when the cap is derived from the descriptor
/// limit: standard streams, the listeners (the gateway's and the built-in simulator's), the
/// store (a PostgreSQL pool of up to 16, or SQLite's file, WAL, shared memory and readers), log
/// and trace exporters.
pub const DESCRIPTORS_RESERVED: u64 = 64;
/// How long shutting down waits for open connections to finish.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// The listener's limits (config keys of the same names; defaults in `config.rs`).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Time a connection has to deliver a request's headers once it is ready for one.
    pub header_read_timeout_ms: u64,
    /// Connections served at once.
    pub connections_max: usize,
    /// Requests served on one connection before it is closed (`Connection: close` on the last).
    pub requests_per_connection_max: u64,
    /// Longest a write to a client may wait without progress before its connection is closed
    /// (`write_timeout.rs`).
    pub client_write_timeout_ms: u64,
    /// Longest a request's body may take to arrive once its headers are in.
    pub body_read_timeout_ms: u64,
}

impl Limits {
    /// The limits a configuration asks for.
    pub fn of(config: &super::config::Config) -> Limits {
        Limits {
            header_read_timeout_ms: config.header_read_timeout_ms,
            connections_max: config.connections_max,
            requests_per_connection_max: config.requests_per_connection_max,
            client_write_timeout_ms: config.client_write_timeout_ms,
            body_read_timeout_ms: config.body_read_timeout_ms,
        }
    }

    /// These limits with `connections_max` lowered to what a soft descriptor limit of
    /// `descriptors` (`RLIMIT_NOFILE`; `None`: unlimited or unknown) can serve. Each served
    /// connection may hold a provider connection too (two descriptors), each overflow
    /// connection one, and [`DESCRIPTORS_RESERVED`] are kept back for everything else. Never
    /// below 1. At the common soft limit of 1,024 that is 448.
    pub fn within_descriptors(self, descriptors: Option<u64>) -> Limits {
        let Some(descriptors) = descriptors else {
            return self;
        };
        let servable = descriptors.saturating_sub(DESCRIPTORS_RESERVED + OVERFLOW_CONNECTIONS_MAX as u64) / 2;
        let servable = usize::try_from(servable).unwrap_or(usize::MAX).max(1);
        Limits {
            connections_max: self.connections_max.min(servable),
            ..self
        }
    }
}

/// This process's soft descriptor limit (`RLIMIT_NOFILE`) as `/proc/self/limits` tells it;
/// `None` where it is unlimited or there is no such file (not Linux).
pub fn descriptor_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|line| line.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A listener on `address` whose kernel queue holds `backlog` connections (capped by the
/// kernel: `net.core.somaxconn` on Linux). `SO_REUSEADDR` as `TcpListener::bind` sets it.
pub fn bind(address: std::net::SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(backlog.max(1))
}

/// A request body read past its deadline (`body_read_timeout_ms`): what [`TimedBody`] fails
/// with, and what `api::body_unread` answers 408 `body_timeout` for.
#[derive(Debug)]
pub struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive within body_read_timeout_ms")
    }
}

impl std::error::Error for BodyTimedOut {}

/// A request body that must arrive whole before its deadline. The deadline runs from when the
/// request reached the service (its headers were in) and only matters while the body is read:
/// a handler that reads nothing is never failed by it.
pub struct TimedBody {
    inner: hyper::body::Incoming,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl TimedBody {
    /// `inner`, to be read within `timeout` from now.
    pub fn new(inner: hyper::body::Incoming, timeout: Duration) -> TimedBody {
        TimedBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl hyper::body::Body for TimedBody {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        use std::future::Future as _;
        use std::task::Poll;
        match std::pin::Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|frame| frame.map_err(Into::into))),
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    super::metrics::bump(super::metrics::BODY_READ_TIMEOUTS);
                    Poll::Ready(Some(Err(Box::new(BodyTimedOut))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serve `app` on `listener` within `limits` until `drained` completes; from the moment
/// `drain` is draining, refuse new requests and close connections as their responses end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    drain: Arc<Drain>,
    drained: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let served = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    let overflow = Arc::new(Semaphore::new(OVERFLOW_CONNECTIONS_MAX));
    let header_read_timeout = Duration::from_millis(limits.header_read_timeout_ms.max(1));
    let client_write_timeout = Duration::from_millis(limits.client_write_timeout_ms.max(1));
    let body_read_timeout = Duration::from_millis(limits.body_read_timeout_ms.max(1));
    tokio::pin!(drained);
    loop {
        let accepted = tokio::select! {
            () = &mut drained => break,
            accepted = listener.accept() => accepted,
        };
        let mut stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        crate::sim::set_nodelay(&mut stream);
        let (permit, at_cap) = match Arc::clone(&served).try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => match Arc::clone(&overflow).try_acquire_owned() {
                Ok(permit) => (permit, true),
                // Over the overflow allowance too: close at once.
                Err(_) => continue,
            },
        };
        let app = app.clone();
        let requests_max = limits.requests_per_connection_max.max(1);
        let drain = drain.clone();
        // Accepted during the drain: one request (refused unless it is a health or metrics
        // read), then closed.
        let draining = drain.is_draining();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                // A client that wrote its whole request and closed its side (it left, or
                // shut down writing while it waits) still has the request served: an EOF
                // does not cut a request whose bytes all arrived (a dispatch then runs to
                // its end and is readable by operation id).
                .half_close(true)
                .keep_alive(!at_cap && !draining);
            let io = TokioIo::new(super::write_timeout::WriteTimeout::new(
                super::parse_errors::JsonParseErrors::new(stream),
                client_write_timeout,
            ));
            let result = if at_cap {
                let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    async move { Ok::<_, std::convert::Infallible>(overloaded(app, request).await) }
                });
                let connection = builder.serve_connection(io, service).with_upgrades();
                until_drained(connection, &drain, draining).await
            } else {
                let refusing = drain.clone();
                let served_requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    let served_requests = Arc::clone(&served_requests);
                    let refusing = refusing.clone();
                    async move {
                        use hyper::service::Service as _;
                        if refusing.is_draining() && !answered_while_draining(&request) {
                            return Ok::<_, std::convert::Infallible>(shutting_down());
                        }
                        // Until its handler answers, a request may still start a dispatch
                        // driver: the drain waits for it (`drain.rs`).
                        let _handling = refusing.task();
                        let number = served_requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                        let request = request.map(|body| Body::new(TimedBody::new(body, body_read_timeout)));
                        let mut response = match TowerToHyperService::new(app).call(request).await {
                            Ok(response) => response.map(Body::new),
                            Err(never) => match never {},
                        };
                        if number >= requests_max {
                            // The connection's last request: hyper closes it after this answer.
                            response.headers_mut().insert(
                                axum::http::header::CONNECTION,
                                axum::http::HeaderValue::from_static("close"),
                            );
                        }
                        Ok::<_, std::convert::Infallible>(response)
                    }
                });
                let connection = builder.serve_connection(io, service).with_upgrades();
                until_drained(connection, &drain, draining).await
            };
            if let Err(error) = result {
                tracing::debug!(%error, "connection ended");
            }
            drop(permit);
        });
    }
    // Let open connections finish (bounded), as `axum::serve`'s graceful shutdown did.
    let all = u32::try_from(limits.connections_max.max(1)).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(SHUTDOWN_WAIT, served.acquire_many(all)).await;
    Ok(())
}

/// Serve `connection` to its end; once the process drains, tell it to close after the
/// response in progress (at once when idle). One accepted during the drain (`draining`) has
/// keep-alive off already and is left to answer its one request.
async fn until_drained<C>(connection: C, drain: &Drain, draining: bool) -> hyper::Result<()>
where
    C: Future<Output = hyper::Result<()>> + GracefulConnection,
{
    tokio::pin!(connection);
    if draining {
        return connection.await;
    }
    tokio::select! {
        result = connection.as_mut() => return result,
        () = drain.reached(Phase::Draining) => connection.as_mut().graceful_shutdown(),
    }
    connection.await
}

/// A hyper connection that can be told to close once its response in progress is written.
trait GracefulConnection {
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S> GracefulConnection for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        hyper::server::conn::http1::UpgradeableConnection::graceful_shutdown(self)
    }
}

/// What a draining process still answers: its health and its metrics.
fn answered_while_draining<B>(request: &Request<B>) -> bool {
    request.method() == Method::GET && matches!(request.uri().path(), "/healthz" | "/metrics")
}

/// A request that came after the shutdown signal.
fn shutting_down() -> Response {
    let mut response = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::ShuttingDown,
        "this gateway is shutting down and takes no new requests; retry on another replica (or after its restart)",
    )
    .into_response();
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// A request on a connection beyond the cap: `GET /healthz` as usual, anything else 503.

/// A request on a connection beyond the cap: `GET /healthz`, `/livez` and `/readyz` as usual,
/// anything else 503.
async fn overloaded(app: Router, request: Request<hyper::body::Incoming>) -> Response {
    if request.method() == Method::GET && matches!(request.uri().path(), "/healthz" | "/livez" | "/readyz") {
        use hyper::service::Service as _;
        return match TowerToHyperService::new(app).call(request).await {
            Ok(response) => response.map(Body::new),
            Err(never) => match never {},
        };
    }
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Overloaded,
        "the gateway is at its connection limit; retry",
    )
    .into_response()
}
