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
//! - a write to a client that makes no progress for `client_write_timeout_ms` closes the
//!   connection ([`super::write_timeout`]): a client that stopped reading frees what it holds;
//! - an accept error (descriptors exhausted) pauses accepting for [`ACCEPT_ERROR_PAUSE`] instead
//!   of spinning;
//! - while the process drains (`drain.rs`) every new request except `GET /healthz` and
//!   `GET /metrics` is answered 503 `shutting_down` with `Connection: close`, and every open
//!   connection is told to close once its response is written (an idle kept-alive one at once;
//!   a client stream when its dispatch ends). The listener keeps accepting until the drain is
//!   over, so a late client is refused in words rather than left in the accept queue.

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
}

impl Limits {
    /// The limits a configuration asks for.
    pub fn of(config: &super::config::Config) -> Limits {
        Limits {
            header_read_timeout_ms: config.header_read_timeout_ms,
            connections_max: config.connections_max,
            requests_per_connection_max: config.requests_per_connection_max,
            client_write_timeout_ms: config.client_write_timeout_ms,
        }
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
                stream,
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
async fn overloaded(app: Router, request: Request<hyper::body::Incoming>) -> Response {
    if request.method() == Method::GET && request.uri().path() == "/healthz" {
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
