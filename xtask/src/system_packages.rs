//! Step 1 of `prepare` on Linux: the Debian packages that building mlx-sys needs,
//! and the Redis server that kvcache-store's tests start.

use std::process::Command;

use crate::error::{bail, Result};
use crate::shell;

/// Always needed: CMake builds mlx-c, bindgen needs libclang, OpenBLAS stands
/// in for the wheel's slow reference BLAS, and kvcache-store's tests start their
/// own `redis-server` (the package also brings `redis-cli` and `redis-benchmark`).
const REQUIRED: [&str; 4] = ["cmake", "libclang-dev", "libopenblas-dev", "redis-server"];

pub fn ensure() -> Result<()> {
    const STEP: &str = "prepare: Debian packages";
    if !shell::on_path("dpkg-query") {
        // Not Debian: nothing to install with; check the one tool we can see.
        if !shell::on_path("cmake") {
            bail!("cmake is not on PATH; install cmake, libclang and OpenBLAS with your system's package manager");
        }
        if !shell::on_path("redis-server") {
            bail!("redis-server is not on PATH; install Redis with your system's package manager (macOS: brew install redis)");
        }
        println!("{STEP}: not a Debian system, assuming libclang and OpenBLAS are installed");
        return Ok(());
    }
    let missing = missing_packages();
    if missing.is_empty() {
        println!("{STEP}: already done ({})", REQUIRED.join(" "));
        return Ok(());
    }
    install(STEP, &missing)?;
    let still = missing_packages();
    if !still.is_empty() {
        bail!(
            "apt-get install finished but these are still missing: {}",
            still.join(" ")
        );
    }
    Ok(())
}

/// Installs `packages` (Debian, as root) unless they are all there already;
/// `why` names the task that needs them.
pub fn ensure_extra(why: &str, packages: &[&str]) -> Result<()> {
    if !shell::on_path("dpkg-query") {
        bail!("{why} needs the Debian packages {}; install their equivalents with your system's package manager", packages.join(" "));
    }
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|name| !dpkg_installed(name))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    install(why, &missing)
}

/// `apt-get install`s `missing` as root, or says how to.
fn install(why: &str, missing: &[&str]) -> Result<()> {
    let list = missing.join(" ");
    if !is_root() {
        bail!("{why}: missing Debian packages; install them with: sudo apt-get install -y {list}");
    }
    println!("{why}: installing {list}");
    shell::run(Command::new("apt-get").arg("update"))?;
    shell::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "--no-install-recommends"])
            .args(missing),
    )
}

fn missing_packages() -> Vec<&'static str> {
    let mut missing: Vec<&str> = REQUIRED
        .into_iter()
        .filter(|name| !dpkg_installed(name))
        .collect();
    // The mlx-c and libzmq (kvcache-events) builds need a C++ compiler;
    // prepare needs pip for the wheels.
    if !shell::on_path("c++") && !dpkg_installed("g++") {
        missing.push("g++");
    }
    if !shell::succeeds(Command::new("python3").args(["-m", "pip", "--version"])) {
        if !shell::on_path("python3") {
            missing.push("python3");
        }
        missing.push("python3-pip");
    }
    missing
}

fn dpkg_installed(package: &str) -> bool {
    shell::capture(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|status| status.trim() == "install ok installed")
}

fn is_root() -> bool {
    shell::capture(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}
