//! File-system helpers with errors that name the path.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{bail, Context, Result};

/// Lower-case hex SHA-256 of a file's contents.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Fails unless `path` hashes to `expected`.
pub fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual != expected {
        bail!(
            "{} has sha256 {actual}, expected {expected}; delete it and run again",
            path.display()
        );
    }
    Ok(())
}

/// Hashes a directory tree: every file's relative path and contents, in sorted order.
/// Names for which `skip` returns true are left out.
pub fn sha256_tree(root: &Path, skip: impl Fn(&str) -> bool) -> Result<String> {
    let mut hasher = Sha256::new();
    for relative in list_files(root)? {
        let name = relative.to_string_lossy().replace('\\', "/");
        if skip(&name) {
            continue;
        }
        let bytes = fs::read(root.join(&relative))
            .context(|| format!("reading {}", root.join(&relative).display()))?;
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(&bytes);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lower-case hex SHA-256 of some bytes.
pub fn sha256_bytes(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Relative paths of all files under `root`, sorted.
pub fn list_files(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(dir) = pending.pop() {
        let entries = fs::read_dir(root.join(&dir)).context(|| format!("listing {}", dir.display()))?;
        for entry in entries {
            let entry = entry.context(|| format!("listing {}", root.join(&dir).display()))?;
            let relative = dir.join(entry.file_name());
            if entry.path().is_dir() {
                pending.push(relative);
            } else {
                files.push(relative);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Copies the tree `from` into the new directory `to`.
pub fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    for relative in list_files(from)? {
        let target = to.join(&relative);
        if let Some(parent) = target.parent() {
            create_dir_all(parent)?;
        }
        fs::copy(from.join(&relative), &target).context(|| {
            format!(
                "copying {} to {}",
                from.join(&relative).display(),
                target.display()
            )
        })?;
    }
    Ok(())
}

pub fn create_dir_all(path: &Path) -> Result<()> {
    fs::create_dir_all(path).context(|| format!("creating {}", path.display()))
}

/// Removes a file or directory tree if it exists.
pub fn remove_all(path: &Path) -> Result<()> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
    .context(|| format!("removing {}", path.display()))
}

pub fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).context(|| format!("moving {} to {}", from.display(), to.display()))
}

pub fn read_to_string(path: &Path) -> Result<String> {
    fs::read_to_string(path).context(|| format!("reading {}", path.display()))
}

pub fn write(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    fs::write(path, contents).context(|| format!("writing {}", path.display()))
}

/// The only file in `dir` whose name starts with `prefix` and ends with `suffix`.
pub fn find_one(dir: &Path, prefix: &str, suffix: &str) -> Result<PathBuf> {
    let mut found = Vec::new();
    let entries = fs::read_dir(dir).context(|| format!("listing {}", dir.display()))?;
    for entry in entries {
        let entry = entry.context(|| format!("listing {}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) && name.ends_with(suffix) {
            found.push(entry.path());
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => bail!("no {prefix}*{suffix} in {}", dir.display()),
        _ => bail!(
            "several {prefix}*{suffix} in {}: remove the directory and run again",
            dir.display()
        ),
    }
}
