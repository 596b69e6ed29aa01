//! The benchmarks' knobs: settings read from environment variables, so that
//! `cargo xtask bench` runs them with nothing to parse.

/// `$name` as a number, or `default` when unset or not a number.
pub fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `$name` (else `default`) split at commas, each item trimmed, empty ones
/// dropped.
pub fn list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}
