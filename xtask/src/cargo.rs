//! Running cargo on the main workspace.
//!
//! On Linux every run gets the same flags so that all tasks share one build
//! cache: `--cfg kvcache_mlx` (turns on kvcache-mlx's mlx-rs dependency), an
//! rpath to the wheel's `libmlx.so`, and `--config paths=[...]` pointing at the
//! patched mlx-sys. On macOS runs are plain cargo.
//!
//! Why a path override (`paths`) and not `[patch]`: a `[patch]` is part of
//! dependency resolution, so every patched run rewrote the tracked Cargo.lock
//! (mlx-sys's entry lost its `source` and `checksum`), and only a plain cargo
//! run at the end put it back: a run that was interrupted, timed out or ran
//! beside another left the tree modified. A path override replaces the
//! package's source after resolution, so the lock file keeps the crates.io
//! entry, byte for byte, during and after every run. It requires the override
//! to declare the same dependencies as the registry crate, which the patch
//! keeps (it edits the build script, headers and `lib.rs`, never
//! `Cargo.toml`); cargo warns if that ever stops holding.

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
            cmd.args(override_args(&mlx.patched_mlx_sys));
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

/// The cargo arguments that build `patched` in place of the crates.io crate
/// of the same name and version, leaving Cargo.lock alone (the module docs).
fn override_args(patched: &Path) -> [String; 2] {
    [
        "--config".to_owned(),
        format!("paths=[{}]", toml_string(&patched.to_string_lossy())),
    ]
}

/// Runs made by xtask versions before the path override (and an interrupted
/// one of theirs) recorded mlx-sys in Cargo.lock as a path package. Lets plain
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

    /// The unpacked crates.io source of `name_version` in cargo's home.
    fn registry_source(name_version: &str) -> PathBuf {
        let home = std::env::var_os("CARGO_HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
        std::fs::read_dir(home.join("registry/src"))
            .unwrap()
            .map(|entry| entry.unwrap().path().join(name_version))
            .find(|dir| dir.join("Cargo.toml").is_file())
            .unwrap_or_else(|| panic!("{name_version} is not unpacked in {}", home.display()))
    }

    #[test]
    fn the_override_is_a_paths_config() {
        let args = override_args(Path::new("/t/x \"y\""));
        assert_eq!(
            args,
            ["--config".to_owned(), r#"paths=["/t/x \"y\""]"#.to_owned()]
        );
    }

    /// The mechanism on a crate of our own graph (sha2, xtask's dependency,
    /// so it is in the local registry): a copy of its source given as the
    /// override is what cargo builds, and the lock file keeps its bytes;
    /// the `[patch]` xtask used before rewrites it (so this test can fail).
    #[test]
    fn a_path_override_leaves_the_lock_file_as_it_was() {
        let cargo = program();
        let dir = std::env::temp_dir().join(format!("xtask-override-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(
            dir.join("Cargo.toml"),
            "[package]\nname = \"probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
             [dependencies]\nsha2 = \"0.10\"\n\n[workspace]\n",
        )
        .unwrap();
        std::fs::write(dir.join("src/lib.rs"), "").unwrap();
        let run = |args: &[&str]| {
            let out = Command::new(&cargo)
                .current_dir(&dir)
                .args(args)
                .arg("--offline")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        run(&["generate-lockfile"]);
        let lock = std::fs::read(dir.join("Cargo.lock")).unwrap();
        let text = String::from_utf8(lock.clone()).unwrap();
        let entry = text
            .split("[[package]]")
            .find(|e| e.contains("\nname = \"sha2\"\n"))
            .unwrap();
        let version = entry
            .split("version = \"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let source = registry_source(&format!("sha2-{version}"));
        let copy = dir.join("sha2-copy");
        crate::files::copy_tree(&source, &copy).unwrap();

        let args = override_args(&copy);
        let metadata = run(&["metadata", "--format-version", "1", &args[0], &args[1]]);
        let manifest = copy.join("Cargo.toml");
        assert!(metadata.contains(&format!("\"manifest_path\":\"{}\"", manifest.display())));
        assert_eq!(std::fs::read(dir.join("Cargo.lock")).unwrap(), lock);
        assert!(!has_path_mlx_sys(&text.replace("sha2", "mlx-sys")));

        let patch = format!(
            "patch.crates-io.sha2.path={}",
            toml_string(&copy.to_string_lossy())
        );
        run(&["metadata", "--format-version", "1", "--config", &patch]);
        let patched = std::fs::read_to_string(dir.join("Cargo.lock")).unwrap();
        assert_ne!(patched.as_bytes(), lock);
        assert!(has_path_mlx_sys(&patched.replace("sha2", "mlx-sys")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn patched_lock_entries_are_recognised() {
        let registry = "[[package]]\nname = \"mlx-sys\"\nversion = \"0.7.0\"\nsource = \"registry+x\"\n";
        let patched = "[[package]]\nname = \"mlx-sys\"\nversion = \"0.7.0\"\ndependencies = []\n";
        assert!(!has_path_mlx_sys(registry));
        assert!(has_path_mlx_sys(patched));
    }
}
