//! The console: a page served at `/` and its ES modules under `/console/` (plain JavaScript with
//! JSDoc types that `tsc --noEmit` checks in `scripts/test`; no build step, no external assets:
//! the machine may be offline). Every file is compiled into the binary. The page reads the
//! same HTTP API as any client, with the tenant token the user types in, so it can show
//! nothing the token could not read.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - the console opens one stream per dispatch: a double click sends one request. Enforced in
//!   `console/dispatch.js::Dispatches.start` (registered before the first await), the disabled
//!   button. Tests: `tests/console/console.test.mjs` step 3 via `tests/it/console.rs` (red with the
//!   guard and the disabled state removed).
//! - one conversation's preview never shows under another. Enforced in
//!   `console/app.js::renderSession` (the open conversation's session only). Tests:
//!   `console.test.mjs` step 5 (red when the newest running session is drawn).
//! - the console shows the request bytes exactly as stored and checks their SHA-256 against the
//!   manifest. Enforced in `console/inspect.js::dispatchView`, `sha256`. Tests: `console.test.mjs`
//!   step 6 (19-digit seed; red with the body re-formatted).
//! - the page holds from 360 px to wide: long content wraps or scrolls in its own box. Enforced in
//!   `console/console.css` (`minmax(0, …)` columns, `overflow-wrap: anywhere`, scroll boxes).
//!   Tests: `console.test.mjs` steps 3 and 10 (1440, 390, 360 px; red without `overflow-wrap` on
//!   the inspector).

use crate::serve::api::{ApiError, ErrorCode};
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("index.html");

/// The modules, by file name (one owner each; see `app.js` for the map).
const MODULES: &[(&str, &str)] = &[
    ("app.js", include_str!("app.js")),
    ("api.js", include_str!("api.js")),
    ("dom.js", include_str!("dom.js")),
    ("feed.js", include_str!("feed.js")),
    ("list.js", include_str!("list.js")),
    ("conversation.js", include_str!("conversation.js")),
    ("dispatch.js", include_str!("dispatch.js")),
    ("inspect.js", include_str!("inspect.js")),
    ("ops.js", include_str!("ops.js")),
    ("diff.js", include_str!("diff.js")),
    ("console.css", include_str!("console.css")),
];

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

/// `GET /console/{file}`: one of [`MODULES`], or 404.
pub async fn module(Path(file): Path<String>) -> Response {
    let Some((name, text)) = MODULES.iter().find(|(name, _)| *name == file) else {
        return ApiError::new(StatusCode::NOT_FOUND, ErrorCode::NotFound, "no such console file")
            .into_response();
    };
    let content_type = if name.ends_with(".css") {
        "text/css; charset=utf-8"
    } else {
        "text/javascript; charset=utf-8"
    };
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        *text,
    )
        .into_response()
}
