//! The drop-in proxy driven by the official `openai`, `anthropic` and `google-genai` (on its
//! default API version, `v1`) Python SDKs (pinned, from
//! PyPI, in the venv `scripts/test` makes and names in `TURNSTILE_SDK_PYTHON`): Chat
//! Completions, Responses and Messages, streaming and not, parallel tool calls and their results
//! in a stateless follow-up, an illegal history refused with the SDK's own error type, a forced
//! tool and pydantic structured output reaching the provider, and Anthropic's tool runner
//! (whose `thread` is refused with the code it falls back on), and OpenAI's Conversations API
//! refused as the SDK's own `NotFoundError`. The
//! gateway runs on its embedded default (built-in simulator). Without the venv this test fails,
//! never skips.

use crate::serve::Gateway;
use std::path::Path;
use std::process::Command;

#[test]
fn the_official_openai_and_anthropic_sdks_work_unchanged_against_the_proxy() {
    let python = std::env::var("TURNSTILE_SDK_PYTHON")
        .expect("TURNSTILE_SDK_PYTHON must name the Python of the SDK venv (scripts/test makes it)");
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite:{}", dir.path().join("t.db").display());
    let gateway = Gateway::start_with(&dir, &store, None, "").unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/proxy_sdk.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg(&gateway.base)
        .output()
        .expect("the SDK venv's python runs");
    assert!(
        output.status.success(),
        "SDK test failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with("ok: openai"));
}
