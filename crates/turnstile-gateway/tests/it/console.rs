//! The console in a real browser: Debian's Chromium driven by playwright-core (from npm) runs
//! `tests/console/console.test.mjs` against a gateway (a tenant, a shadow proxy route and a
//! catch-all proxy route) and a simulator on loopback; the scenarios are listed in that file. The browser
//! parts are installed by `scripts/test`; when they are missing this test fails, never skips.

use crate::serve::{Gateway, sqlite};
use crate::sim::SimProcess;
use std::path::Path;
use std::process::Command;

#[test]
fn the_console_lists_searches_streams_once_keeps_views_apart_shows_exact_bytes_and_holds_its_layout() {
    let chromium = std::env::var("TURNSTILE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let playwright = std::env::var("TURNSTILE_PLAYWRIGHT_CORE")
        .expect("TURNSTILE_PLAYWRIGHT_CORE must name the playwright-core module (scripts/test installs it)");
    assert!(
        Path::new(&chromium).exists(),
        "{chromium} is missing (scripts/test installs Debian's chromium)"
    );
    let sim = SimProcess::start();
    let dir = tempfile::tempdir().unwrap();
    // The default lease (5 s), not the suite's 400 ms: the scenarios assume a dispatch keeps its
    // first attempt (the reload scenario's scripted reply is consumed by it), and on a loaded
    // CI host a renewal late by 400 ms lost the lease, so a second generation committed the
    // simulator's default reply instead (CI, 2026-12-04). Lease expiry has its own tests.
    let config = "lease_ms = 5000\n[[tenants]]\nname = \"ops\"\ntoken = \"tok-console\"\n\
        [[routes]]\napi = \"openai-chat\"\nmodel = \"shadow-*\"\nmode = \"shadow\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n\
        [[routes]]\napi = \"openai-chat\"\nmodel = \"*\"\nprovider = \"sim\"\nadapter = \"openai-chat@2\"\n";
    let gateway = Gateway::start(&dir, &sqlite(&dir), &sim, config);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console/console.test.mjs");
    let screenshots = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let output = Command::new("node")
        .arg(&script)
        .env("GATEWAY", &gateway.base)
        .env("SIM", &sim.base)
        .env("CHROMIUM", &chromium)
        .env("PLAYWRIGHT_CORE", &playwright)
        .env("TOKEN", "tok-console")
        .env("SCREENSHOT_DIR", &screenshots)
        .output()
        .expect("node runs");
    assert!(
        output.status.success(),
        "console test failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(screenshots.join("console-desktop.png").exists());
    assert!(screenshots.join("console-narrow.png").exists());
}
