//! Running cargo on the main workspace.
//!
//! On Linux every run gets the same flags so that all tasks share one build
//! cache: `--cfg kvcache_mlx` (turns on kvcache-mlx's mlx-rs dependency), an
//! rpath to the wheel's `libmlx.so`, and `--config patch.crates-io.mlx-sys.path`
//! pointing at the patched mlx-sys. On macOS runs are plain cargo.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::Result;
use crate::shell;

/// The cargo that runs xtask (`$CARGO`), so that nested runs use the same toolchain.
pub fn program() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// What the Linux MLX build needs on each cargo command.
struct MlxBuild {
    patched_mlx_sys: PathBuf,
    mlx_lib_dir: PathBuf,
}

pub struct Cargo {
    root: PathBuf,
    mlx: Option<MlxBuild>,
    envs: Vec<(String, OsString)>,
}

impl Cargo {
    /// Plain cargo (macOS, or tasks that never build mlx-sys).
    pub fn plain(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            mlx: None,
            envs: Vec::new(),
        }
    }

    /// Cargo with the Linux MLX build turned on.
    pub fn with_mlx(root: &Path, patched_mlx_sys: PathBuf, mlx_lib_dir: PathBuf) -> Self {
        Self {
            mlx: Some(MlxBuild {
                patched_mlx_sys,
                mlx_lib_dir,
            }),
            ..Self::plain(root)
        }
    }

    /// An environment variable for every command (e.g. the model's path).
    pub fn set_env(&mut self, key: &str, value: impl Into<OsString>) {
        self.envs.push((key.to_owned(), value.into()));
    }

    /// The value [`set_env`](Self::set_env) gave `key`, if any.
    pub fn env(&self, key: &str) -> Option<&OsString> {
        self.envs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// `cargo ARGS` with the build flags.
    pub fn run(&self, args: &[String]) -> Result<()> {
        self.run_with_rustdocflags(args, &[])
    }

    /// `cargo ARGS` with the build flags and extra rustdoc flags.
    pub fn run_with_rustdocflags(&self, args: &[String], rustdocflags: &[&str]) -> Result<()> {
        let mut cmd = Command::new(program());
        cmd.current_dir(&self.root);
        // `--config` goes after the subcommand: before it, cargo does not pass it
        // on to external subcommands such as clippy.
        let (subcommand, rest) = args
            .split_first()
            .map_or((None, args), |(first, rest)| (Some(first), rest));
        cmd.args(subcommand);
        let mut rustflags = Vec::new();
        if let Some(mlx) = &self.mlx {
            cmd.arg("--config").arg(format!(
                "patch.crates-io.mlx-sys.path={}",
                toml_string(&mlx.patched_mlx_sys.to_string_lossy())
            ));
            rustflags = vec![
                "--cfg".to_owned(),
                "kvcache_mlx".to_owned(),
                "-C".to_owned(),
                format!("link-arg=-Wl,-rpath,{}", mlx.mlx_lib_dir.display()),
            ];
        }
        let mut docflags = rustflags.clone();
        docflags.extend(rustdocflags.iter().map(|flag| flag.to_string()));
        append_flags(&mut cmd, "RUSTFLAGS", rustflags);
        append_flags(&mut cmd, "RUSTDOCFLAGS", docflags);
        for (key, value) in &self.envs {
            cmd.env(key, value);
        }
        cmd.args(rest);
        shell::run(&mut cmd)
    }

    /// `cargo ARGS` without any of the build flags (`cargo fmt`).
    pub fn run_plain(&self, args: &[&str]) -> Result<()> {
        shell::run(Command::new(program()).current_dir(&self.root).args(args))
    }
}

/// A patched run records mlx-sys in Cargo.lock as a path package. Lets plain
/// cargo put the crates.io entry back, so that Cargo.lock stays as committed.
pub fn restore_lockfile(root: &Path) {
    let lock = root.join("Cargo.lock");
    let Ok(text) = std::fs::read_to_string(&lock) else {
        return;
    };
    if !has_path_mlx_sys(&text) {
        return;
    }
    let mut cmd = Command::new(program());
    cmd.current_dir(root)
        .args(["metadata", "--format-version", "1", "--offline", "--quiet"]);
    println!("$ {} >/dev/null", shell::display(&cmd));
    if !shell::succeeds(cmd.stdout(Stdio::null())) {
        println!(
            "xtask: warning: could not restore mlx-sys in {}; any plain cargo command will",
            lock.display()
        );
    }
}

/// Appends `extra` to the flags the user already has in `$CARGO_ENCODED_<VAR>` or
/// `$<VAR>` (cargo's precedence). Uses the readable `<VAR>` form unless a flag
/// contains whitespace or the user had the encoded form.
fn append_flags(cmd: &mut Command, var: &str, extra: Vec<String>) {
    if extra.is_empty() {
        return;
    }
    let encoded_var = format!("CARGO_ENCODED_{var}");
    let (mut flags, encoded) = match std::env::var(&encoded_var) {
        Ok(value) => (
            value
                .split('\u{1f}')
                .filter(|flag| !flag.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>(),
            true,
        ),
        Err(_) => (
            std::env::var(var)
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            false,
        ),
    };
    flags.extend(extra);
    if encoded || flags.iter().any(|flag| flag.contains(char::is_whitespace)) {
        cmd.env_remove(var).env(&encoded_var, flags.join("\u{1f}"));
    } else {
        cmd.env_remove(&encoded_var).env(var, flags.join(" "));
    }
}

/// A TOML basic string.
fn toml_string(value: &str) -> String {
    let mut out = String::from("\"");
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Whether Cargo.lock's mlx-sys entry has no `source` (a `[patch]` path package).
fn has_path_mlx_sys(lock: &str) -> bool {
    lock.split("[[package]]")
        .any(|entry| entry.contains("\nname = \"mlx-sys\"\n") && !entry.contains("\nsource = "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_strings_are_escaped() {
        assert_eq!(toml_string(r#"/a "b"\c"#), r#""/a \"b\"\\c""#);
    }

    #[test]
    fn patched_lock_entries_are_recognised() {
        let registry = "[[package]]\nname = \"mlx-sys\"\nversion = \"0.7.0\"\nsource = \"registry+x\"\n";
        let patched = "[[package]]\nname = \"mlx-sys\"\nversion = \"0.7.0\"\ndependencies = []\n";
        assert!(!has_path_mlx_sys(registry));
        assert!(has_path_mlx_sys(patched));
    }
}
