//! Listener limits (issue 17), against a real gateway on loopback over raw TCP: a slow-loris
//! connection and an idle keep-alive connection are closed after `header_read_timeout_ms`;
//! beyond `connections_max` a connection is answered 503 `overloaded`, except `GET /healthz`.

use crate::serve::{Gateway, sqlite};
use serde_json::Value;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The bound on every wait here: far above the timeouts configured, so a pass is not a race.
const BOUND: Duration = Duration::from_secs(20);

fn address(gateway: &Gateway) -> String {
    gateway.base.trim_start_matches("http://").to_owned()
}

fn connect(gateway: &Gateway) -> TcpStream {
    let stream = TcpStream::connect(address(gateway)).unwrap();
    stream.set_read_timeout(Some(BOUND)).unwrap();
    stream
}

/// Read until the server closes the connection: `true` if it did within [`BOUND`].
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) if matches!(error.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                return true;
            }
            Err(_) => return false, // the read timed out: still open
        }
    }
}

/// One request with `Connection: close`: (status, JSON body).
fn request(gateway: &Gateway, path: &str) -> (u16, Value) {
    let mut stream = connect(gateway);
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    (status, serde_json::from_str(body.trim()).unwrap_or(Value::Null))
}

#[test]
fn a_slow_loris_connection_is_closed_after_the_header_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "header_read_timeout_ms = 300").unwrap();
    let mut stream = connect(&gateway);
    // Headers trickled a line at a time and never finished.
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
        .unwrap();
    // One more line whenever the server has kept quiet for a while (a read that times out
    // is the pacing, not a sleep), until the server closes: trickling never extends the
    // header deadline.
    stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let started = std::time::Instant::now();
    let mut trickled = 0;
    let closed = loop {
        let mut buffer = [0u8; 256];
        match stream.read(&mut buffer) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(error) if matches!(error.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                break true;
            }
            Err(_) => {}
        }
        if started.elapsed() > BOUND {
            break false;
        }
        if stream
            .write_all(format!("X-Trickle-{trickled}: 1\r\n").as_bytes())
            .is_err()
        {
            break true;
        }
        trickled += 1;
    };
    assert!(closed, "the connection was still open after {BOUND:?}");
    assert!(
        trickled >= 2,
        "the client kept trickling until the close ({trickled} lines)"
    );
    // The gateway itself is fine.
    assert_eq!(request(&gateway, "/healthz").0, 200);
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_the_header_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "header_read_timeout_ms = 300").unwrap();
    let mut stream = connect(&gateway);
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .unwrap();
    // Read the whole response (its body is one JSON object), then say nothing more.
    let mut response = Vec::new();
    let mut buffer = [0u8; 1024];
    while !String::from_utf8_lossy(&response).contains("\"reachable\"}") {
        let read = stream.read(&mut buffer).unwrap();
        assert!(
            read > 0,
            "closed before the response: {}",
            String::from_utf8_lossy(&response)
        );
        response.extend_from_slice(&buffer[..read]);
    }
    assert!(String::from_utf8_lossy(&response).starts_with("HTTP/1.1 200"));
    assert!(
        closed_by_server(&mut stream),
        "the idle connection was still open after {BOUND:?}"
    );
}

#[test]
fn beyond_the_connection_cap_requests_get_503_and_healthz_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(
        &dir,
        &sqlite(&dir),
        None,
        "header_read_timeout_ms = 60000\nconnections_max = 3",
    )
    .unwrap();
    // Three connections that say nothing hold every served slot (accepted in arrival order).
    let mut held: Vec<TcpStream> = (0..3).map(|_| connect(&gateway)).collect();
    let (status, body) = request(&gateway, "/v1/quarantine");
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    let (status, body) = request(&gateway, "/healthz");
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")), "{body}");
    // A slot freed is served again (the server notices the close asynchronously: bounded poll).
    drop(held.pop());
    let served = (0..200).any(|_| {
        let (status, _) = request(&gateway, "/v1/quarantine");
        if status != 200 {
            std::thread::sleep(Duration::from_millis(25));
        }
        status == 200
    });
    assert!(served, "a freed slot was never served again");
}

#[test]
fn a_kept_alive_connection_is_closed_after_its_request_limit() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(
        &dir,
        &sqlite(&dir),
        None,
        "header_read_timeout_ms = 60000\nrequests_per_connection_max = 2",
    )
    .unwrap();
    let mut stream = connect(&gateway);
    // Two requests on one kept-alive connection: the second answer says `Connection: close`
    // and the server closes the connection (the header timeout is far away).
    stream
        .write_all(
            b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\nGET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n",
        )
        .unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");
    assert!(text.to_ascii_lowercase().contains("connection: close"), "{text}");
}

/// Read one whole answer (until the server closes, within [`BOUND`]): (status, JSON body,
/// whether the server closed the connection).
fn answer_and_close(stream: &mut TcpStream) -> (u16, Value, bool) {
    let mut response = Vec::new();
    let mut buffer = [0u8; 4096];
    let closed = loop {
        match stream.read(&mut buffer) {
            Ok(0) => break true,
            Ok(read) => response.extend_from_slice(&buffer[..read]),
            Err(error) if matches!(error.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                break true;
            }
            Err(_) => break false, // the read timed out: still open
        }
    };
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    (
        status,
        serde_json::from_str(body.trim()).unwrap_or(Value::Null),
        closed,
    )
}

/// Issue 49 item 5: headers and 10 of 100 body bytes, then silence, on the native API and on
/// the drop-in proxy: answered 408 and closed once `body_read_timeout_ms` ran out (the
/// connection was open at 40 s with the header timeout at 2 s before).
#[test]
fn a_stalled_request_body_is_answered_408_and_its_connection_closed() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(
        &dir,
        &sqlite(&dir),
        None,
        "header_read_timeout_ms = 60000\nbody_read_timeout_ms = 300",
    )
    .unwrap();
    for path in ["/v1/conversations", "/v1/chat/completions"] {
        let mut stream = connect(&gateway);
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n\
             content-length: 100\r\n\r\n{{\"convers"
        )
        .unwrap();
        let (status, body, closed) = answer_and_close(&mut stream);
        assert_eq!(status, 408, "{path}: {body}");
        assert!(closed, "{path}: the connection is closed after the 408");
        if path == "/v1/conversations" {
            assert_eq!(body["error"]["code"], "body_timeout", "{body}");
        }
    }
    assert_eq!(gateway.metric("turnstile_body_read_timeouts_total"), 2.0);
}

/// Issue 49 item 5: the listen backlog is `listen_backlog` (the kernel's queue of connections
/// not yet accepted; it was 128, and a burst of 500 connects was partly reset by the kernel), as
/// `ss` reads it (Send-Q of a listening socket), capped by `net.core.somaxconn`.
#[test]
fn the_listen_backlog_is_the_configured_one() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "listen_backlog = 700").unwrap();
    let port = address(&gateway).rsplit(':').next().unwrap().to_owned();
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let listing = std::process::Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2) lists listening sockets");
    let text = String::from_utf8_lossy(&listing.stdout);
    // State Recv-Q Send-Q Local:Port Peer:Port; for a listener Send-Q is the backlog.
    let backlog: u32 = text
        .split_whitespace()
        .nth(2)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("no listener on port {port}: {text:?}"));
    assert_eq!(backlog, 700.min(somaxconn));
}

/// Issue 49 item 5: under a descriptor limit of 256 the connection cap is what the limit can
/// serve ((256 − 64 reserved − 64 overflow) / 2 = 64), not `connections_max` (768): the 65th
/// connection is answered 503 `overloaded` and `/healthz` still answers, instead of the accept
/// loop running out of descriptors where nothing is answered.
#[test]
fn under_a_low_descriptor_limit_the_connection_cap_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let gateway =
        Gateway::start_with_descriptors(&dir, &sqlite(&dir), "header_read_timeout_ms = 60000", 256).unwrap();
    // 64 connections that say nothing hold every served slot (accepted in arrival order).
    let _held: Vec<TcpStream> = (0..64).map(|_| connect(&gateway)).collect();
    let (status, body) = request(&gateway, "/v1/quarantine");
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    let (status, body) = request(&gateway, "/healthz");
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")), "{body}");
}

/// Issue 49 item 5: requests whose head hyper refuses before the router (a raw 0xFF in the
/// target, a NUL in a header, HTTP/0.9, 500 headers) and a malformed chunked body are answered
/// with their status and `{"error": {"code", "message"}}` JSON, not an empty body (and the bad
/// chunk size is 400, not 413 `body_too_large`).
#[test]
fn refusals_before_the_router_carry_json_errors() {
    let dir = tempfile::tempdir().unwrap();
    let gateway = Gateway::start_with(&dir, &sqlite(&dir), None, "").unwrap();
    let many_headers: String = (0..500).map(|index| format!("X-{index}: a\r\n")).collect();
    let cases: [(&str, Vec<u8>, u16, &str); 5] = [
        (
            "raw 0xFF in the target",
            b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            400,
            "invalid_request",
        ),
        (
            "NUL in a header",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n".to_vec(),
            400,
            "invalid_request",
        ),
        ("HTTP/0.9", b"GET /\r\n\r\n".to_vec(), 400, "invalid_request"),
        (
            "500 headers",
            format!("GET /healthz HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").into_bytes(),
            431,
            "headers_too_large",
        ),
        (
            "bad chunk size",
            b"POST /v1/conversations HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
                .to_vec(),
            400,
            "invalid_request",
        ),
    ];
    for (name, bytes, status, code) in cases {
        let mut stream = connect(&gateway);
        stream.write_all(&bytes).unwrap();
        let (seen, body, _) = answer_and_close(&mut stream);
        assert_eq!(
            (seen, body["error"]["code"].as_str()),
            (status, Some(code)),
            "{name}: {body}"
        );
        assert!(body["error"]["message"].is_string(), "{name}: {body}");
    }
    let (status, _) = request(&gateway, "/healthz");
    assert_eq!(status, 200);
}
