//! Golden snapshots: every adapter × every scenario in `tests/data/render/`, the exact body
//! (re-indented without reordering, plus the SHA-256 of the exact bytes), path, headers,
//! admission count and policy; or the pauses.

use crate::render_support::{SCENARIOS, load, reindent, render_for};
use turnstile_adapters::AdapterId;
use turnstile_adapters::render::RenderOutcome;
use turnstile_core::Digest;

fn snapshot_text(name: &str, adapter: AdapterId) -> String {
    let conversation = load(name);
    match render_for(&conversation, adapter) {
        RenderOutcome::Rendered(rendered) => format!(
            "adapter: {adapter}\noutcome: rendered\n{} {}\nheaders: {:?}\nprompt_tokens: {}\nrequest_digest: {}\npolicy: {}\nbody:\n{}\n",
            rendered.method,
            rendered.path,
            rendered.headers,
            rendered.prompt_tokens,
            Digest::of_bytes(&rendered.body),
            serde_json::to_string(&rendered.policy).unwrap(),
            reindent(&rendered.body),
        ),
        RenderOutcome::Paused(pauses) => format!(
            "adapter: {adapter}\noutcome: paused\n{}\n",
            serde_json::to_string_pretty(&pauses).unwrap()
        ),
        RenderOutcome::Refused(error) => panic!("{name} × {adapter}: refused without settings: {error}"),
        RenderOutcome::RefusedToolChoice(error) => {
            panic!("{name} × {adapter}: refused without a tool choice: {error}")
        }
        RenderOutcome::RefusedOutputFormat(error) => {
            panic!("{name} × {adapter}: refused without an output format: {error}")
        }
        RenderOutcome::RefusedPassthrough(error) => {
            panic!("{name} × {adapter}: refused without client-only fields: {error}")
        }
    }
}

#[test]
fn every_adapter_renders_every_scenario_as_its_golden_snapshot() {
    for name in SCENARIOS {
        for adapter in AdapterId::ALL {
            let slug = adapter.as_str().replace('@', "_v").replace('-', "_");
            insta::assert_snapshot!(format!("{name}__{slug}"), snapshot_text(name, adapter));
        }
    }
}

#[test]
fn the_reindented_snapshot_body_is_the_exact_body_once_whitespace_outside_strings_is_removed() {
    let conversation = load("context_role_text");
    for adapter in AdapterId::ALL {
        let RenderOutcome::Rendered(rendered) = render_for(&conversation, adapter) else {
            continue;
        };
        let pretty = reindent(&rendered.body);
        let reparsed: serde_json::Value = serde_json::from_str(&pretty).unwrap();
        let original: serde_json::Value = serde_json::from_slice(&rendered.body).unwrap();
        assert_eq!(reparsed, original, "{adapter}");
    }
}
