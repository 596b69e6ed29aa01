//! Progress bars on stderr, drawn only when stderr is a terminal (so output
//! piped to a file or read by a test holds only what stdout prints).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use kvcache_models::LoadProgress;

/// A bar of `len` steps named `label`, or a hidden one off a terminal.
pub fn bar(len: u64, label: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
        .expect("a valid template")
        .progress_chars("=> ");
    let bar = ProgressBar::new(len)
        .with_style(style)
        .with_prefix(label.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A spinner named `label` counting steps of unknown number, or a hidden one
/// off a terminal.
pub fn spinner(label: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{spinner} {prefix}: {pos} steps ({elapsed})")
        .expect("a valid template");
    let spinner = ProgressBar::new_spinner()
        .with_style(style)
        .with_prefix(label.to_owned());
    spinner.enable_steady_tick(Duration::from_millis(200));
    spinner
}

/// A bar over a model's tensors as they load, and the callback that moves it
/// (`ModelFile::load`'s progress). Finish the bar once loading returns.
pub fn loading(label: &str) -> (ProgressBar, impl FnMut(LoadProgress)) {
    let bar = bar(0, label);
    let moved = bar.clone();
    (bar, move |p: LoadProgress| {
        moved.set_length(p.total as u64);
        moved.set_position(p.done as u64);
    })
}

/// Runs `print` (lines on stdout) without tearing `bar`.
pub fn above<R>(bar: &ProgressBar, print: impl FnOnce() -> R) -> R {
    bar.suspend(print)
}
