//! The console: one static page (HTML, CSS and script inline, no external assets: the machine
//! may be offline) served at `/`. It reads the same HTTP API as any client, with the tenant
//! token the user types in, so it can show nothing the token could not read.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("index.html");

/// `GET /`.
pub async fn index() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX,
    )
        .into_response()
}
