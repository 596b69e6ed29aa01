//! Where things live: the repository, the download cache outside it, and the
//! git-ignored directory for generated sources.

use std::env;
use std::path::{Path, PathBuf};

use crate::error::{bail, Result};

pub struct Layout {
    /// The main workspace's root (the parent of `xtask/`).
    pub root: PathBuf,
    /// Downloads and extracted archives, shared by all clones of the project.
    pub cache: PathBuf,
}

impl Layout {
    pub fn detect() -> Result<Self> {
        let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let Some(root) = xtask_dir.parent() else {
            bail!("{} has no parent directory", xtask_dir.display());
        };
        if !root.join("Cargo.toml").is_file() {
            bail!(
                "{} has no Cargo.toml: xtask must live in the repository's xtask/ directory",
                root.display()
            );
        }
        Ok(Self {
            root: root.to_path_buf(),
            cache: cache_dir()?,
        })
    }

    /// Generated, git-ignored files of xtask inside the repository.
    pub fn generated(&self) -> PathBuf {
        self.root.join("target").join("xtask")
    }
}

/// `$KVCACHE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvcache-rs`, else `~/.cache/kvcache-rs`.
fn cache_dir() -> Result<PathBuf> {
    let non_empty = |name: &str| env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = non_empty("KVCACHE_CACHE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = non_empty("XDG_CACHE_HOME").map(PathBuf::from) {
        if dir.is_absolute() {
            return Ok(dir.join("kvcache-rs"));
        }
    }
    match non_empty("HOME") {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("kvcache-rs")),
        None => bail!("neither KVCACHE_CACHE_DIR, XDG_CACHE_HOME nor HOME is set: set KVCACHE_CACHE_DIR to a directory for downloads"),
    }
}
