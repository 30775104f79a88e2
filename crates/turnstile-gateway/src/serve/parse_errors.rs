//! JSON bodies for the refusals hyper writes itself (issue 49 item 5).
//!
//! A request whose head does not parse (a raw byte outside the grammar in the target, a NUL or a
//! bare CR in a header, HTTP/0.9, more headers than hyper takes) never reaches the router:
//! hyper answers 400, 414 or 431 on its own with an empty body and closes the connection, and
//! offers no hook to shape that answer. 14 of 42 odd requests of the fault probes got such an
//! empty refusal, against "every error is `{"error": {"code", "message"}}` JSON". Here the
//! connection's writes are watched for exactly that answer — a head alone, `connection: close`
//! then `content-length: 0` right after the status line, no `content-type`, status 400, 414 or
//! 431 — and it is written instead with a JSON body of the same status (`invalid_request`,
//! `uri_too_long`, `headers_too_large`). Every answer of ours carries a `content-type` (errors are
//! JSON: `api::json_errors`), so none of them matches.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Longest refusal hyper writes (a status line, three short headers).
const REFUSAL_BYTES_MAX: usize = 256;

/// `io` whose hyper-written parse refusals get a JSON body.
pub struct JsonParseErrors<S> {
    io: S,
    /// The rewritten refusal still to write, and how much of it is written.
    pending: Option<(Vec<u8>, usize)>,
    /// The length hyper asked to write when the refusal was replaced: what it is told once the
    /// replacement is out.
    replaced_len: usize,
}

impl<S> JsonParseErrors<S> {
    /// Wrap `io`.
    pub fn new(io: S) -> JsonParseErrors<S> {
        JsonParseErrors {
            io,
            pending: None,
            replaced_len: 0,
        }
    }
}

/// `head` rewritten with a JSON body if it is one of hyper's own parse refusals.
pub fn rewritten(head: &[u8]) -> Option<Vec<u8>> {
    // Cheap refusals first: this runs on every write of every connection.
    if head.len() > REFUSAL_BYTES_MAX || !head.starts_with(b"HTTP/1.1 4") {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?;
    let head_only = text.ends_with("\r\n\r\n") && text.find("\r\n\r\n")? + 4 == text.len();
    let (status_line, rest) = text.split_once("\r\n")?;
    if !head_only || !rest.starts_with("connection: close\r\ncontent-length: 0\r\n") {
        return None;
    }
    if rest.to_ascii_lowercase().contains("content-type:") {
        return None;
    }
    let status: u16 = status_line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let (code, message) = match status {
        400 => (
            super::api::ErrorCode::InvalidRequest,
            "the request could not be parsed as HTTP/1.1",
        ),
        414 => (
            super::api::ErrorCode::UriTooLong,
            "the request target is too long",
        ),
        431 => (
            super::api::ErrorCode::HeadersTooLarge,
            "the request's header fields are too many or too large",
        ),
        _ => return None,
    };
    let body = serde_json::json!({"error": {"code": code.as_str(), "message": message}}).to_string();
    // hyper's remaining headers (`date`) after the two matched, then ours.
    let others = &rest["connection: close\r\ncontent-length: 0\r\n".len()..];
    Some(
        format!(
            "{status_line}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{others}{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: AsyncWrite + Unpin> JsonParseErrors<S> {
    /// Write what is pending; `Ready(Ok(()))` once all of it is out.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            match Pin::new(&mut self.io).poll_write(cx, &bytes[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(count)) => *written += count,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonParseErrors<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonParseErrors<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.pending.is_none() {
            match rewritten(buf) {
                Some(replacement) => {
                    this.pending = Some((replacement, 0));
                    this.replaced_len = buf.len();
                }
                None => return Pin::new(&mut this.io).poll_write(cx, buf),
            }
        }
        // hyper asks again with the same bytes until it is told they were written.
        match this.drain(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(this.replaced_len)),
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // A refusal is a head alone: one slice. Anything else goes through as it is.
        let mut slices = bufs.iter().filter(|slice| !slice.is_empty());
        let first = slices.next();
        if self.pending.is_some()
            || (slices.next().is_none() && first.is_some_and(|first| rewritten(first).is_some()))
        {
            let first = first.map_or(&[][..], |first| &first[..]);
            return self.poll_write(cx, first);
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.io).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.io).poll_shutdown(cx),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::rewritten;

    #[test]
    fn only_hypers_own_empty_refusals_are_rewritten_with_their_status_and_a_json_body() {
        let canned = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 07 Dec 2026 23:02:08 GMT\r\n\r\n";
        let text = String::from_utf8(rewritten(canned).expect("a canned refusal")).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
        assert!(head.contains("\r\ncontent-type: application/json\r\n"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(head.contains("\r\ndate: "), "{head}");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "headers_too_large");
        // Our own answers and anything else pass untouched.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"[..],
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\nextra",
            b"HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
        ] {
            assert!(rewritten(other).is_none(), "{}", String::from_utf8_lossy(other));
        }
    }
}
