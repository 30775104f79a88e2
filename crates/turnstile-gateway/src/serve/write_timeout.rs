//! A client connection whose writes time out (`client_write_timeout_ms`, issue 49).
//!
//! A client that stops reading while its stream goes on fills its socket: hyper's writes then
//! wait for ever, and with them everything the connection holds — hyper's buffers, the SSE
//! task's queue and, through its receiver, the whole client backlog of its dispatch (8 MiB per
//! silent client of a 60,000-word answer in the fault probes, after the dispatch had
//! committed). Here a write, flush or shutdown that can make no progress for the timeout fails
//! with `TimedOut`: hyper ends the connection, the response body is dropped, the stream's task
//! ends with it and the backlog is given back. The dispatch itself never waits for a client
//! and goes on to its commit.
//!
//! Only waits on the socket count: a stream with nothing to send (a dispatch that is thinking)
//! never times out here, and any byte taken starts the clock again.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io` whose writes fail once they have waited `timeout` without progress.
pub struct WriteTimeout<S> {
    io: S,
    timeout: Duration,
    /// Since when the socket has taken nothing (armed at the first `Pending`, dropped at the
    /// first progress).
    stalled: Option<Pin<Box<Sleep>>>,
    /// The timeout fired (counted once per connection).
    fired: bool,
}

impl<S> WriteTimeout<S> {
    /// Wrap `io`.
    pub fn new(io: S, timeout: Duration) -> WriteTimeout<S> {
        WriteTimeout {
            io,
            timeout,
            stalled: None,
            fired: false,
        }
    }

    /// After the socket answered `outcome`: progress disarms the clock, a wait arms it (or
    /// fails once it ran out).
    fn judge<T>(&mut self, cx: &mut Context<'_>, outcome: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if outcome.is_ready() {
            self.stalled = None;
            return outcome;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                if !self.fired {
                    self.fired = true;
                    super::metrics::bump(super::metrics::CLIENT_WRITE_TIMEOUTS);
                    tracing::info!(
                        timeout_ms = timeout.as_millis() as u64,
                        "a client read nothing for client_write_timeout_ms; its connection is closed"
                    );
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing for client_write_timeout_ms",
                )))
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.io).poll_write(cx, buf);
        this.judge(cx, outcome)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.judge(cx, outcome)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.io).poll_flush(cx);
        this.judge(cx, outcome)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.io).poll_shutdown(cx);
        this.judge(cx, outcome)
    }
}
