//! Running other programs: every command that changes something is echoed first,
//! in a form that can be pasted into a shell.

use std::ffi::OsStr;
use std::process::{Command, Stdio};

use crate::error::{bail, Context, Result};

/// Echoes `cmd` (with the environment variables xtask set on it), runs it with
/// inherited stdio and fails unless it exits with status 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("$ {shown}");
    let status = cmd.status().context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a probe quietly and returns whether it exited with status 0
/// (false as well when the program does not exist).
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Runs a probe quietly and returns its standard output, or `None` when it
/// could not start or failed.
pub fn capture(cmd: &mut Command) -> Option<String> {
    let output = cmd.stderr(Stdio::null()).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Whether `program` is found on `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            let candidate = dir.join(program);
            candidate.is_file()
        })
    })
}

/// `KEY=value ... program args...`, shell-quoted.
pub fn display(cmd: &Command) -> String {
    let mut words = Vec::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            words.push(format!(
                "{}={}",
                key.to_string_lossy(),
                quote(&value.to_string_lossy())
            ));
        }
    }
    words.push(quote(&cmd.get_program().to_string_lossy()));
    words.extend(cmd.get_args().map(OsStr::to_string_lossy).map(|a| quote(&a)));
    words.join(" ")
}

/// Quotes one word for a POSIX shell (bash's `$'...'` form for control characters).
pub fn quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:=,+@%^".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        return word.to_owned();
    }
    if word.chars().any(char::is_control) {
        let mut out = String::from("$'");
        for c in word.chars() {
            match c {
                '\'' | '\\' => {
                    out.push('\\');
                    out.push(c);
                }
                c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
                c => out.push(c),
            }
        }
        out.push('\'');
        return out;
    }
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote("--cfg"), "--cfg");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote("a\u{1f}b"), r"$'a\x1fb'");
        assert_eq!(quote(""), "''");
    }

    #[test]
    fn display_shows_env_then_command() {
        let mut cmd = Command::new("cargo");
        cmd.env("RUSTFLAGS", "--cfg x").args(["test", "--workspace"]);
        assert_eq!(display(&cmd), "RUSTFLAGS='--cfg x' cargo test --workspace");
    }
}
