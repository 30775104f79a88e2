//! Integration tests of turnstile-adapters.
