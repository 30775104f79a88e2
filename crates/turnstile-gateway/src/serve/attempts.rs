//! What the pump saw of each provider response connection (an attempt's send or resume): the
//! attempt metrics (`turnstile_attempts_total`, head latency, attempt duration, time to first
//! preview) and the per-attempt evidence an operator reads in `GET /v1/dispatches/{id}`
//! (status, provider request id, `retry-after`, the error body, bytes, time to head and to the
//! first body byte, duration, usage, the retracted preview).
//!
//! Bounded: at most [`CONNECTIONS_MAX`] connections per dispatch are recorded (the driver's
//! attempt and resume budgets keep a dispatch far below it), each error body at
//! [`ERROR_BODY_BYTES_MAX`] and each retracted preview at [`RETRACTED_PREVIEW_BYTES_MAX`].
//! Never a credential: the provider's request headers are not kept at all, and of its response
//! only the status, `retry-after` and request id headers.
//!
//! Durable: the evidence of a connection that ended without a clean 2xx body is written once
//! its end was handled (its own write, on a path that already failed); the committed attempt's
//! rides in the commit transaction (`Carried::evidence`), so a dispatch that commits still
//! costs two writes (docs/decisions/0171-per-attempt-evidence.md).

use super::metrics;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Instant;
use turnstile_core::Generation;
use turnstile_drive::ConnectionId;

/// Provider error body bytes kept per connection (the rest counted, not kept).
pub const ERROR_BODY_BYTES_MAX: usize = 64 * 1024;
/// Retracted preview bytes kept per generation.
pub const RETRACTED_PREVIEW_BYTES_MAX: usize = 16 * 1024;
/// Connections recorded per dispatch; later ones are counted in metrics only.
pub const CONNECTIONS_MAX: usize = 64;

/// One response connection.
struct Connection {
    generation: u64,
    target: usize,
    labels: (String, String),
    request: &'static str,
    opened: Instant,
    status: Option<u16>,
    head_ms: Option<u64>,
    first_byte_ms: Option<u64>,
    retry_after_ms: Option<u64>,
    request_id: Option<String>,
    bytes: u64,
    error_body: Vec<u8>,
    end: Option<(&'static str, u64)>,
    written: bool,
}

/// One dispatch's connections, in the order they opened.
pub struct AttemptLog {
    accepted: Instant,
    first_preview: bool,
    connections: BTreeMap<ConnectionId, Connection>,
    /// Per generation: the preview text so far (bounded) and whether it was cut.
    previews: BTreeMap<u64, (String, bool)>,
    /// Per generation: the reason and text of its retracted preview.
    retracted: BTreeMap<u64, (String, String, bool)>,
    /// Per generation: the last usage the provider reported.
    usage: BTreeMap<u64, Value>,
}

impl AttemptLog {
    /// A dispatch its driver took at `accepted`.
    pub fn new(accepted: Instant) -> AttemptLog {
        AttemptLog {
            accepted,
            first_preview: false,
            connections: BTreeMap::new(),
            previews: BTreeMap::new(),
            retracted: BTreeMap::new(),
            usage: BTreeMap::new(),
        }
    }

    /// When the driver took the dispatch.
    pub fn accepted(&self) -> Instant {
        self.accepted
    }

    /// A response connection (`request`: `send` or `resume`) opened to `target`.
    pub fn opened(
        &mut self,
        connection: ConnectionId,
        generation: u64,
        target: usize,
        (provider, model): (&str, &str),
        request: &'static str,
    ) {
        if self.connections.len() >= CONNECTIONS_MAX {
            return;
        }
        self.connections.insert(
            connection,
            Connection {
                generation,
                target,
                labels: metrics::target_labels(provider, model),
                request,
                opened: Instant::now(),
                status: None,
                head_ms: None,
                first_byte_ms: None,
                retry_after_ms: None,
                request_id: None,
                bytes: 0,
                error_body: Vec::new(),
                end: None,
                written: false,
            },
        );
    }

    /// Its response head.
    pub fn head(
        &mut self,
        connection: ConnectionId,
        status: u16,
        retry_after_ms: Option<u64>,
        request_id: Option<&str>,
    ) {
        let Some(entry) = self.connections.get_mut(&connection) else {
            return;
        };
        let elapsed = entry.opened.elapsed();
        metrics::head_latency(&entry.labels, elapsed.as_secs_f64());
        entry.status = Some(status);
        entry.head_ms = Some(elapsed.as_millis() as u64);
        entry.retry_after_ms = retry_after_ms;
        entry.request_id = request_id.map(str::to_owned);
    }

    /// Body bytes; an error status's body is kept up to [`ERROR_BODY_BYTES_MAX`].
    pub fn chunk(&mut self, connection: ConnectionId, bytes: &[u8]) {
        let Some(entry) = self.connections.get_mut(&connection) else {
            return;
        };
        if entry.first_byte_ms.is_none() {
            entry.first_byte_ms = Some(entry.opened.elapsed().as_millis() as u64);
        }
        entry.bytes += bytes.len() as u64;
        if entry.status.is_some_and(|status| !(200..300).contains(&status)) {
            let room = ERROR_BODY_BYTES_MAX.saturating_sub(entry.error_body.len());
            entry
                .error_body
                .extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
    }

    /// It ended (`end`: one of [`metrics::ATTEMPT_ENDS`]); counted once.
    pub fn ended(&mut self, connection: ConnectionId, end: &'static str) {
        let Some(entry) = self.connections.get_mut(&connection) else {
            return;
        };
        if entry.end.is_some() {
            return;
        }
        let elapsed = entry.opened.elapsed();
        entry.end = Some((end, elapsed.as_millis() as u64));
        metrics::attempt_ended(&entry.labels, end, entry.status, elapsed.as_secs_f64());
    }

    /// The commit of `generation` won: its connections not ended yet end `committed` (their
    /// duration runs to the commit; the driver closes them without waiting for the body's end).
    pub fn committed(&mut self, generation: u64) {
        let open: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter(|(_, entry)| entry.end.is_none() && entry.generation == generation)
            .map(|(connection, _)| *connection)
            .collect();
        for connection in open {
            self.ended(connection, "committed");
        }
    }

    /// Every connection not ended yet ends `closed` (the dispatch is over here).
    pub fn close_all(&mut self) {
        let open: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter(|(_, entry)| entry.end.is_none())
            .map(|(connection, _)| *connection)
            .collect();
        for connection in open {
            self.ended(connection, "closed");
        }
    }

    /// A client event of the dispatch: previews are timed and kept (bounded) until their
    /// generation commits or is retracted; usage reports are kept per generation.
    pub fn event(&mut self, event: &turnstile_drive::DriveEvent, labels: &(String, String)) {
        use turnstile_drive::DriveEvent;
        match event {
            DriveEvent::Preview {
                generation, delta, ..
            } => {
                if !self.first_preview {
                    self.first_preview = true;
                    metrics::first_preview(labels, self.accepted.elapsed().as_secs_f64());
                }
                let (text, cut) = self.previews.entry(generation.0).or_default();
                push_bounded(text, cut, delta, RETRACTED_PREVIEW_BYTES_MAX);
            }
            DriveEvent::Retract { generation, reason } => {
                let (text, cut) = self.previews.remove(&generation.0).unwrap_or_default();
                self.retracted.insert(generation.0, (reason.clone(), text, cut));
            }
            DriveEvent::Usage {
                generation, usage, ..
            } => {
                self.usage
                    .insert(generation.0, serde_json::to_value(usage).unwrap_or(Value::Null));
            }
            _ => {}
        }
    }

    /// `generation:target/model:status:end` of every connection, oldest first (the dispatch's
    /// log line).
    pub fn summary(&self) -> String {
        let mut out = Vec::with_capacity(self.connections.len());
        for entry in self.connections.values() {
            let status = entry
                .status
                .map_or_else(|| "-".to_owned(), |status| status.to_string());
            let end = entry.end.map_or("open", |(end, _)| end);
            out.push(format!(
                "{}:{}/{}:{status}:{end}",
                entry.generation, entry.labels.0, entry.labels.1
            ));
        }
        out.join(" ")
    }

    /// The targets (`provider/model`) connections went to, in the order first tried.
    pub fn targets_tried(&self, targets: &[super::driver::TargetContext]) -> String {
        let mut tried: Vec<usize> = Vec::new();
        for entry in self.connections.values() {
            if !tried.contains(&entry.target) {
                tried.push(entry.target);
            }
        }
        tried
            .iter()
            .filter_map(|index| targets.get(*index))
            .map(|target| target.label())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The evidence of every connection not written yet that ended without a clean 2xx body
    /// (marked written).
    pub fn take_failed(&mut self) -> Vec<(Generation, Value)> {
        let failed: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter(|(_, entry)| {
                !entry.written
                    && entry.end.is_some_and(|(end, _)| {
                        end != "clean" || !entry.status.is_some_and(|status| (200..300).contains(&status))
                    })
            })
            .map(|(connection, _)| *connection)
            .collect();
        self.take(&failed)
    }

    /// The evidence of every connection not written yet (marked written): the commit's, or
    /// what is left when the dispatch is over here.
    pub fn take_all(&mut self) -> Vec<(Generation, Value)> {
        let left: Vec<ConnectionId> = self
            .connections
            .iter()
            .filter(|(_, entry)| !entry.written)
            .map(|(connection, _)| *connection)
            .collect();
        self.take(&left)
    }

    /// [`AttemptLog::take_all`] for the commit of `generation`: its connections still open
    /// read `end: committed` (the rows are written only if the commit wins; see
    /// [`not_committed`]).
    pub fn take_for_commit(&mut self, generation: u64) -> Vec<(Generation, Value)> {
        let mut rows = self.take_all();
        for (of, row) in &mut rows {
            if of.0 == generation && row["end"].is_null() {
                row["end"] = json!("committed");
            }
        }
        rows
    }

    fn take(&mut self, connections: &[ConnectionId]) -> Vec<(Generation, Value)> {
        let mut out = Vec::with_capacity(connections.len());
        for connection in connections {
            if let Some(row) = self.row(*connection) {
                out.push(row);
            }
            if let Some(entry) = self.connections.get_mut(connection) {
                entry.written = true;
            }
        }
        out
    }

    /// One connection's evidence as it stands, without marking it written.
    pub fn row(&self, connection: ConnectionId) -> Option<(Generation, Value)> {
        {
            let entry = self.connections.get(&connection)?;
            let (end, duration_ms) = match entry.end {
                Some((end, ms)) => (Value::from(end), Value::from(ms)),
                None => (
                    Value::Null,
                    Value::from(entry.opened.elapsed().as_millis() as u64),
                ),
            };
            let error_body = (!entry.error_body.is_empty())
                .then(|| String::from_utf8_lossy(&entry.error_body).into_owned());
            let retracted = self.retracted.get(&entry.generation);
            Some((
                Generation(entry.generation),
                json!({
                    "generation": entry.generation,
                    "target": entry.target,
                    "provider": entry.labels.0,
                    "model": entry.labels.1,
                    "request": entry.request,
                    "status": entry.status,
                    "provider_request_id": entry.request_id,
                    "retry_after_ms": entry.retry_after_ms,
                    "head_ms": entry.head_ms,
                    "first_byte_ms": entry.first_byte_ms,
                    "duration_ms": duration_ms,
                    "end": end,
                    "bytes_received": entry.bytes,
                    "error_body": error_body,
                    "error_body_truncated": entry.bytes > entry.error_body.len() as u64 && !entry.error_body.is_empty(),
                    "usage": self.usage.get(&entry.generation),
                    "retracted_preview": retracted.map(|(reason, text, cut)| json!({"reason": reason, "text": text, "truncated": cut})),
                }),
            ))
        }
    }
}

/// Rows of [`AttemptLog::take_for_commit`] whose commit did not win: no end after all.
pub fn not_committed(mut rows: Vec<(Generation, Value)>) -> Vec<(Generation, Value)> {
    for (_, row) in &mut rows {
        if row["end"] == "committed" {
            row["end"] = Value::Null;
        }
    }
    rows
}

/// Append `more` to `text` up to `max` bytes (at a character boundary); `cut` once it did not fit.
fn push_bounded(text: &mut String, cut: &mut bool, more: &str, max: usize) {
    if *cut {
        return;
    }
    let room = max.saturating_sub(text.len());
    if more.len() <= room {
        text.push_str(more);
        return;
    }
    let mut end = room;
    while !more.is_char_boundary(end) {
        end -= 1;
    }
    text.push_str(&more[..end]);
    *cut = true;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_body_is_kept_up_to_its_bound_and_only_for_an_error_status() {
        let mut log = AttemptLog::new(Instant::now());
        log.opened(ConnectionId(1), 1, 0, ("p", "m"), "send");
        log.head(ConnectionId(1), 500, Some(2000), Some("req_1"));
        log.chunk(ConnectionId(1), &vec![b'x'; ERROR_BODY_BYTES_MAX + 10]);
        log.ended(ConnectionId(1), "clean");
        log.opened(ConnectionId(2), 2, 0, ("p", "m"), "send");
        log.head(ConnectionId(2), 200, None, None);
        log.chunk(ConnectionId(2), b"data: {}\n\n");
        log.ended(ConnectionId(2), "clean");
        let failed = log.take_failed();
        assert_eq!(failed.len(), 1, "only the 500 failed");
        let evidence = &failed[0].1;
        assert_eq!(evidence["status"], 500);
        assert_eq!(evidence["retry_after_ms"], 2000);
        assert_eq!(evidence["provider_request_id"], "req_1");
        assert_eq!(
            evidence["error_body"].as_str().unwrap().len(),
            ERROR_BODY_BYTES_MAX
        );
        assert_eq!(evidence["error_body_truncated"], true);
        let rest = log.take_all();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].1["error_body"], Value::Null, "a 2xx body is not evidence");
        assert!(log.take_all().is_empty(), "each connection is written once");
    }

    #[test]
    fn a_preview_is_cut_at_a_character_boundary() {
        let (mut text, mut cut) = (String::new(), false);
        push_bounded(&mut text, &mut cut, "aé", 2);
        assert_eq!((text.as_str(), cut), ("a", true));
    }
}
