//! `cargo xtask cuda-bundle`: everything the CUDA checks need on a lent GPU
//! machine that has no Rust toolchain and no network, built here without a GPU.
//!
//! Prepares the CUDA build toolchain ([`toolchain`], cached), builds with
//! `--features cuda` in release mode kvcache-causal's test binaries, the
//! models' `paged_attention` test, the `causal` and `e8` benches, the server
//! and its serving drivers (`e6_e7_serving`, `e5s_serving`), and without CUDA
//! the stand-in tool (`kvcache-models`' example `stand_in`), which makes here
//! the skeletons of SmolLM2 and Gemma 3 (their metadata and tensor shapes and
//! types, a few MB: the model files exceed what a device step carries; the
//! device fills them with random weights). Strips the executables' debug info
//! and packs them with the skeletons, the wheel's `libcudart.so.13` and a
//! manifest into `target/cuda-bundle/bundle.tar.xz` (one solid xz stream with
//! a large dictionary: the binaries share candle's PTX, so they compress well
//! together). Beside it goes `run.sh` (this module's `run.sh`), which unpacks
//! the bundle there and runs each piece with its own log and timeout, all
//! under one budget, and leaves four files under `$OUT` (a device step brings
//! back at most eight). Carrying `target/cuda-bundle` and running
//! `bash target/cuda-bundle/run.sh` is the whole device step. A second run with nothing changed rebuilds and
//! repacks nothing.

mod json;
#[cfg(all(test, target_os = "linux"))]
mod run_script_tests;
mod toolchain;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{bail, Context, Result};
use crate::layout::Layout;
use crate::{files, shell};

use json::Value;

/// The script the device runs, written beside the bundle.
const RUN_SH: &str = include_str!("run.sh");
/// The bundle's folder, relative to the repository root: what the device step carries.
const BUNDLE_DIR: &str = "target/cuda-bundle";
/// What one device step may carry, all paths together.
const CARRY_LIMIT: u64 = 64 << 20;
/// xz settings: one thread (one block, so the shared PTX is found across
/// binaries) and a dictionary larger than several binaries; preset 2 is within
/// a few percent of preset 6 here at a tenth of its time.
const XZ_ARGS: [&str; 3] = ["-T1", "--lzma2=preset=2,dict=256MiB", "-c"];

/// One build: the cargo command and which of its executables go in the bundle.
struct Build {
    what: &'static str,
    cargo: &'static [&'static str],
    /// The bundle path (under `bin/`) of an executable, or `None` to leave it out.
    pick: fn(&Artifact) -> Option<String>,
}

const BUILDS: [Build; 6] = [
    Build {
        what: "kvcache-causal's tests",
        cargo: &[
            "test",
            "--release",
            "-p",
            "kvcache-causal",
            "--features",
            "cuda",
            "--no-run",
        ],
        pick: |a| a.profile_test.then(|| format!("causal-tests/{}", a.name)),
    },
    Build {
        what: "the models' paged_attention test",
        cargo: &[
            "test",
            "--release",
            "-p",
            "kvcache-models",
            "--features",
            "cuda",
            "--test",
            "paged_attention",
            "--no-run",
        ],
        pick: |a| {
            (a.kind("test") && a.name == "paged_attention").then(|| "models/paged_attention".to_owned())
        },
    },
    Build {
        what: "the causal bench",
        cargo: &[
            "bench",
            "-p",
            "kvcache-causal",
            "--features",
            "cuda",
            "--bench",
            "causal",
            "--no-run",
        ],
        pick: |a| (a.kind("bench") && a.name == "causal").then(|| "bench/causal".to_owned()),
    },
    Build {
        what: "the E8 bench",
        cargo: &[
            "bench",
            "-p",
            "kvcache-bench",
            "--features",
            "cuda",
            "--bench",
            "e8",
            "--no-run",
        ],
        pick: |a| (a.kind("bench") && a.name == "e8").then(|| "bench/e8".to_owned()),
    },
    Build {
        what: "the server and its serving drivers (E6/E7, E5s)",
        cargo: &[
            "build",
            "--release",
            "-p",
            "kvcache-server",
            "--features",
            "cuda",
            "--bin",
            "kvcache-server",
            "--example",
            "e6_e7_serving",
            "--example",
            "e5s_serving",
        ],
        pick: |a| {
            let wanted = ["kvcache-server", "e6_e7_serving", "e5s_serving"];
            ((a.kind("bin") || a.kind("example")) && wanted.contains(&a.name.as_str()))
                .then(|| format!("server/{}", a.name))
        },
    },
    Build {
        what: "the stand-in model tool (without CUDA: it also makes the skeletons here)",
        cargo: &[
            "build",
            "--release",
            "-p",
            "kvcache-models",
            "--example",
            "stand_in",
        ],
        pick: |a| (a.kind("example") && a.name == "stand_in").then(|| STAND_IN.to_owned()),
    },
];

/// Every executable the bundle must hold (under `bin/`), besides the causal
/// tests (as many as the crate has).
const REQUIRED: [&str; 7] = [
    "models/paged_attention",
    "bench/causal",
    "bench/e8",
    "server/kvcache-server",
    "server/e6_e7_serving",
    "server/e5s_serving",
    STAND_IN,
];

/// The stand-in tool's place in the bundle (`kvcache-models`' example `stand_in`).
const STAND_IN: &str = "tools/stand_in";

/// The path of a model file, fetched into the cache (the argument) if need be.
type Fetch = fn(&Path) -> Result<PathBuf>;

/// The models the device serves, as skeletons (`kvcache_models::stand_in`)
/// it fills with random weights: (file under `models/` in the bundle, the
/// model it is made from).
const SKELETONS: [(&str, Fetch); 2] = [
    ("smollm2.skeleton.gguf", crate::model::ensure),
    ("gemma3.skeleton.gguf", crate::model::gemma::ensure),
];

/// An executable cargo reported building.
#[derive(Debug, PartialEq)]
struct Artifact {
    name: String,
    kinds: Vec<String>,
    profile_test: bool,
    executable: PathBuf,
}

impl Artifact {
    fn kind(&self, kind: &str) -> bool {
        self.kinds.iter().any(|k| k == kind)
    }

    /// The executable of a `compiler-artifact` message, if it has one.
    fn from_message(message: &Value) -> Option<Self> {
        if message.get("reason")?.as_str()? != "compiler-artifact" {
            return None;
        }
        let target = message.get("target")?;
        Some(Self {
            name: target.get("name")?.as_str()?.to_owned(),
            kinds: target
                .get("kind")?
                .as_array()
                .iter()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect(),
            profile_test: message.get("profile")?.get("test")?.as_bool()?,
            executable: PathBuf::from(message.get("executable")?.as_str()?),
        })
    }
}

/// `cargo xtask cuda-bundle [--target-dir DIR]`.
pub fn bundle(layout: &Layout, args: &[String]) -> Result<()> {
    let Args {
        target_dir,
        clippy: lint,
    } = parse_args(args)?;
    for tool in ["cc", "strip", "tar", "xz", "python3"] {
        if !shell::on_path(tool) {
            bail!("cuda-bundle needs `{tool}` on PATH (Debian: apt-get install build-essential xz-utils python3-pip)");
        }
    }
    let toolchain = toolchain::ensure(layout)?;

    let mut picked: Vec<(String, PathBuf)> = Vec::new();
    for build in &BUILDS {
        println!("cuda-bundle: building {}", build.what);
        let artifacts = cargo_artifacts(layout, &toolchain, target_dir.as_deref(), build.cargo)?;
        let before = picked.len();
        for artifact in &artifacts {
            if let Some(dest) = (build.pick)(artifact) {
                if picked.iter().any(|(d, _)| *d == dest) {
                    bail!("two executables would be bin/{dest} in the bundle");
                }
                picked.push((dest, artifact.executable.clone()));
            }
        }
        if picked.len() == before {
            bail!("building {} reported no executable to bundle", build.what);
        }
    }

    // Cargo reports fresh units in no fixed order.
    picked.sort();
    for dest in REQUIRED {
        if !picked.iter().any(|(d, _)| d == dest) {
            bail!("the builds reported no executable for bin/{dest}");
        }
    }
    let skeletons = skeletons(layout, &picked)?;
    let out = layout.root.join(BUNDLE_DIR);
    files::create_dir_all(&out)?;
    let archive = out.join("bundle.tar.xz");
    let run_sh = out.join("run.sh");
    let key_file = out.join(".bundle-key");
    let commit = git(&layout.root, &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    let key = bundle_key(&picked, &skeletons, &toolchain, &commit)?;
    if archive.is_file() && std::fs::read_to_string(&key_file).is_ok_and(|k| k == key) {
        println!(
            "cuda-bundle: bundle already up to date ({} executables)",
            picked.len()
        );
    } else {
        pack(layout, &toolchain, &picked, &skeletons, &commit, &archive)?;
        files::write(&key_file, &key)?;
    }
    if std::fs::read_to_string(&run_sh).ok().as_deref() != Some(RUN_SH) {
        files::write(&run_sh, RUN_SH)?;
    }
    set_executable(&run_sh)?;

    let size = file_size(&archive)?;
    let carried: u64 = files::list_files(&out)?
        .iter()
        .map(|f| file_size(&out.join(f)).unwrap_or(0))
        .sum();
    if carried >= CARRY_LIMIT {
        bail!(
            "{BUNDLE_DIR} holds {} MiB, over the {} MiB a device step may carry",
            mib(carried),
            CARRY_LIMIT >> 20
        );
    }
    println!(
        "cuda-bundle: {BUNDLE_DIR}/bundle.tar.xz is {} MiB ({} executables; {} MiB in {BUNDLE_DIR} in all)",
        mib(size),
        picked.len(),
        mib(carried)
    );
    println!(
        "cuda-bundle: on a GPU machine, from the repository root, carrying [\"{BUNDLE_DIR}\"] (timeout_s 600), one step:"
    );
    println!("    bash {BUNDLE_DIR}/run.sh");
    println!(
        "cuda-bundle: run.log, summary.tsv, results.txt and logs.tar.gz go to $OUT; without a GPU, `KVCACHE_BUNDLE_DRY_RUN=1 bash {BUNDLE_DIR}/run.sh` checks the plumbing"
    );
    if lint {
        clippy(layout, &toolchain, target_dir.as_deref())?;
    }
    Ok(())
}

/// `cuda-bundle`'s arguments.
#[derive(Debug, Default, PartialEq)]
struct Args {
    /// The cargo build directory (default: the workspace's).
    target_dir: Option<PathBuf>,
    /// Also run clippy (`-D warnings`) over every crate with a `cuda` feature,
    /// built with it, after packing.
    clippy: bool,
}

fn parse_args(args: &[String]) -> Result<Args> {
    let mut parsed = Args::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == "--clippy" {
            parsed.clippy = true;
        } else if arg == "--target-dir" {
            let Some(dir) = args.next() else {
                bail!("--target-dir needs a directory");
            };
            parsed.target_dir = Some(PathBuf::from(dir));
        } else if let Some(dir) = arg.strip_prefix("--target-dir=") {
            parsed.target_dir = Some(PathBuf::from(dir));
        } else {
            bail!(
                "cuda-bundle takes `--target-dir DIR` (the cargo build directory; default the workspace's) and `--clippy`"
            );
        }
    }
    Ok(parsed)
}

/// The crates with a `cuda` feature, for `--clippy`.
const CUDA_CRATES: [&str; 6] = [
    "kvcache-causal",
    "kvcache-models",
    "kvcache-engine",
    "kvcache-bench",
    "kvcache-server",
    "kvcache-demo",
];

/// `cargo clippy --release` (the bundle's profile: candle's kernels are not
/// compiled again) over [`CUDA_CRATES`] with their `cuda` features, every
/// target, warnings denied.
fn clippy(layout: &Layout, toolchain: &toolchain::Toolchain, target_dir: Option<&Path>) -> Result<()> {
    let mut cmd = Command::new(crate::cargo::program());
    cmd.current_dir(&layout.root);
    for (key, value) in toolchain.envs() {
        cmd.env(key, value);
    }
    cmd.args(["clippy", "--release", "--all-targets"]);
    for krate in CUDA_CRATES {
        cmd.args(["-p", krate]);
    }
    let features: Vec<String> = CUDA_CRATES.iter().map(|k| format!("{k}/cuda")).collect();
    cmd.args(["--features", &features.join(",")]);
    if let Some(dir) = target_dir {
        cmd.arg("--target-dir").arg(dir);
    }
    cmd.args(["--", "-D", "warnings"]);
    let shown = shell::display(&cmd);
    println!("$ {shown}");
    let status = cmd.status().context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    println!("cuda-bundle: clippy clean with --features cuda");
    Ok(())
}

/// Runs `cargo ARGS --message-format=json-render-diagnostics` with the CUDA
/// toolchain's environment and returns the executables it reports.
fn cargo_artifacts(
    layout: &Layout,
    toolchain: &toolchain::Toolchain,
    target_dir: Option<&Path>,
    args: &[&str],
) -> Result<Vec<Artifact>> {
    let mut cmd = Command::new(crate::cargo::program());
    cmd.current_dir(&layout.root);
    for (key, value) in toolchain.envs() {
        cmd.env(key, value);
    }
    cmd.args(args).arg("--message-format=json-render-diagnostics");
    if let Some(dir) = target_dir {
        cmd.arg("--target-dir").arg(dir);
    }
    let shown = shell::display(&cmd);
    println!("$ {shown}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context(|| format!("could not start `{shown}`"))?;
    let mut artifacts = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.context(|| format!("reading the output of `{shown}`"))?;
            match json::parse(&line) {
                Some(message) => artifacts.extend(Artifact::from_message(&message)),
                None => println!("{line}"),
            }
        }
    }
    let status = child.wait().context(|| format!("waiting for `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(artifacts)
}

/// The skeletons of [`SKELETONS`]' models, made by the bundle's stand-in
/// tool under `target/xtask/cuda-skeletons/` (the models are fetched first
/// when they are not here yet).
fn skeletons(layout: &Layout, picked: &[(String, PathBuf)]) -> Result<Vec<(String, PathBuf)>> {
    let Some((_, tool)) = picked.iter().find(|(dest, _)| dest == STAND_IN) else {
        bail!("no {STAND_IN} was built");
    };
    let dir = layout.generated().join("cuda-skeletons");
    files::create_dir_all(&dir)?;
    let mut made = Vec::new();
    for (name, model) in SKELETONS {
        let model = model(&layout.cache)?;
        let out = dir.join(name);
        let mut cmd = Command::new(tool);
        cmd.arg("skeleton").arg(&model).arg(&out);
        println!("$ {}", shell::display(&cmd));
        let status = cmd.status().context(|| format!("running {}", tool.display()))?;
        if !status.success() {
            bail!("making the skeleton of {} failed ({status})", model.display());
        }
        made.push((format!("models/{name}"), out));
    }
    Ok(made)
}

/// What the bundle is made of: the executables (path, size, modification
/// time), the skeletons (their content), the runtime library, the commit (in
/// the manifest), how it is packed. Same key, same bundle. (run.sh is beside
/// the bundle, not in it.)
fn bundle_key(
    picked: &[(String, PathBuf)],
    skeletons: &[(String, PathBuf)],
    toolchain: &toolchain::Toolchain,
    commit: &str,
) -> Result<String> {
    let mut parts = vec![commit.to_owned(), format!("{XZ_ARGS:?}")];
    let describe = |path: &Path| -> Result<String> {
        let meta = std::fs::metadata(path).context(|| format!("reading {}", path.display()))?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        Ok(format!("{} {} {modified}", path.display(), meta.len()))
    };
    for (dest, source) in picked {
        parts.push(format!("{dest} {}", describe(source)?));
    }
    for (dest, source) in skeletons {
        parts.push(format!("{dest} {}", files::sha256_file(source)?));
    }
    parts.push(describe(&toolchain.libcudart())?);
    let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
    Ok(files::sha256_bytes(&bytes))
}

/// Stages the stripped executables, the skeletons, the runtime and the
/// manifest, then packs them into `archive`.
fn pack(
    layout: &Layout,
    toolchain: &toolchain::Toolchain,
    picked: &[(String, PathBuf)],
    skeletons: &[(String, PathBuf)],
    commit: &str,
    archive: &Path,
) -> Result<()> {
    let staging = layout.generated().join("cuda-bundle-staging");
    files::remove_all(&staging)?;
    println!(
        "cuda-bundle: stripping {} executables into {}",
        picked.len(),
        staging.display()
    );
    for (dest, source) in picked {
        let target = staging.join("bin").join(dest);
        if let Some(parent) = target.parent() {
            files::create_dir_all(parent)?;
        }
        // Debug info only: the symbols stay, so backtraces name functions.
        let status = Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&target)
            .arg(source)
            .status()
            .context(|| format!("running strip on {}", source.display()))?;
        if !status.success() {
            bail!("strip --strip-debug failed on {} ({status})", source.display());
        }
    }
    for (dest, source) in skeletons {
        let target = staging.join(dest);
        if let Some(parent) = target.parent() {
            files::create_dir_all(parent)?;
        }
        std::fs::copy(source, &target).context(|| format!("copying {}", source.display()))?;
    }
    let lib = staging.join("lib");
    files::create_dir_all(&lib)?;
    std::fs::copy(toolchain.libcudart(), lib.join("libcudart.so.13"))
        .context(|| format!("copying {}", toolchain.libcudart().display()))?;
    files::write(
        &staging.join("manifest.sh"),
        manifest(layout, picked, skeletons, commit),
    )?;

    let partial = archive.with_extension("xz.tmp");
    let mut tar = Command::new("tar");
    tar.args(["--sort=name", "--owner=0", "--group=0", "--numeric-owner", "-C"])
        .arg(&staging)
        .args(["-cf", "-", "."]);
    let mut xz = Command::new("xz");
    xz.args(XZ_ARGS);
    println!(
        "$ {} | {} > {}",
        shell::display(&tar),
        shell::display(&xz),
        partial.display()
    );
    let output = std::fs::File::create(&partial).context(|| format!("creating {}", partial.display()))?;
    let mut tar_child = tar
        .stdout(Stdio::piped())
        .spawn()
        .context(|| "could not start tar".to_owned())?;
    let tar_out = tar_child.stdout.take().map_or(Stdio::null(), Stdio::from);
    let xz_status = xz
        .stdin(tar_out)
        .stdout(output)
        .status()
        .context(|| "could not start xz".to_owned())?;
    let tar_status = tar_child.wait().context(|| "waiting for tar".to_owned())?;
    if !tar_status.success() || !xz_status.success() {
        files::remove_all(&partial)?;
        bail!("packing the bundle failed (tar: {tar_status}, xz: {xz_status})");
    }
    files::rename(&partial, archive)?;
    files::remove_all(&staging)?;
    Ok(())
}

/// `manifest.sh`, which run.sh sources: where and from what the bundle was
/// built, and the executables and skeletons it must hold.
fn manifest(
    layout: &Layout,
    picked: &[(String, PathBuf)],
    skeletons: &[(String, PathBuf)],
    commit: &str,
) -> String {
    let changed = git(&layout.root, &["status", "--porcelain"]).map(|s| s.lines().count());
    let tree = match changed {
        Some(0) => "a clean tree".to_owned(),
        Some(n) => format!("{n} paths changed or untracked"),
        None => "tree state unknown".to_owned(),
    };
    let built = shell::capture(Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]))
        .map_or_else(|| "unknown".to_owned(), |d| d.trim().to_owned());
    let cap = toolchain_cap();
    let binaries: Vec<String> = picked.iter().map(|(dest, _)| format!("bin/{dest}")).collect();
    let vars = [
        ("BUNDLE_BUILD_ROOT", layout.root.display().to_string()),
        ("BUNDLE_COMMIT", commit.to_owned()),
        ("BUNDLE_TREE", tree),
        ("BUNDLE_BUILT", built),
        ("BUNDLE_NVCC", toolchain::CUDA_VERSION.to_owned()),
        ("BUNDLE_COMPUTE_CAP", cap),
        ("BUNDLE_BINARIES", binaries.join(" ")),
        (
            "BUNDLE_SKELETONS",
            skeletons
                .iter()
                .map(|(dest, _)| dest.as_str())
                .collect::<Vec<_>>()
                .join(" "),
        ),
    ];
    let mut text = String::from("# Written by `cargo xtask cuda-bundle`; sourced by run.sh.\n");
    for (key, value) in vars {
        text.push_str(&format!("{key}={}\n", shell::quote(&value)));
    }
    text
}

/// The compute capability the build used (what [`toolchain::Toolchain::envs`] sets).
fn toolchain_cap() -> String {
    std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .filter(|cap| !cap.is_empty())
        .unwrap_or_else(|| toolchain::DEFAULT_COMPUTE_CAP.to_owned())
}

fn git(root: &Path, args: &[&str]) -> Option<String> {
    shell::capture(Command::new("git").current_dir(root).args(args)).map(|s| s.trim_end().to_owned())
}

fn file_size(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path)
        .context(|| format!("reading {}", path.display()))?
        .len())
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1 << 20))
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .context(|| format!("making {} executable", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(line: &str) -> Option<Artifact> {
        Artifact::from_message(&json::parse(line).unwrap())
    }

    #[test]
    fn executables_are_picked_from_cargo_messages() {
        let lib_tests = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"kvcache_causal","test":true},"profile":{"test":true},"executable":"/t/kvcache_causal-1"}"#;
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"kvcache_causal","test":true},"profile":{"test":false},"executable":null}"#;
        let example = r#"{"reason":"compiler-artifact","target":{"kind":["example"],"name":"demo","test":false},"profile":{"test":false},"executable":"/t/demo"}"#;
        let bench = r#"{"reason":"compiler-artifact","target":{"kind":["bench"],"name":"e8","test":false},"profile":{"test":false},"executable":"/t/e8-2"}"#;
        let finished = r#"{"reason":"build-finished","success":true}"#;
        let causal_tests = BUILDS[0].pick;
        assert_eq!(
            artifact(lib_tests).as_ref().and_then(causal_tests).as_deref(),
            Some("causal-tests/kvcache_causal")
        );
        assert_eq!(artifact(lib), None);
        assert_eq!(artifact(example).as_ref().and_then(causal_tests), None);
        assert_eq!(artifact(finished), None);
        let e8 = artifact(bench).unwrap();
        assert_eq!(e8.executable, PathBuf::from("/t/e8-2"));
        assert_eq!((BUILDS[3].pick)(&e8).as_deref(), Some("bench/e8"));
        assert_eq!((BUILDS[2].pick)(&e8), None);

        let server = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"kvcache-server","test":true},"profile":{"test":false},"executable":"/t/kvcache-server"}"#;
        let driver = r#"{"reason":"compiler-artifact","target":{"kind":["example"],"name":"e5s_serving","test":false},"profile":{"test":false},"executable":"/t/e5s_serving"}"#;
        let other = r#"{"reason":"compiler-artifact","target":{"kind":["example"],"name":"e4r_routing","test":false},"profile":{"test":false},"executable":"/t/e4r_routing"}"#;
        let tool = r#"{"reason":"compiler-artifact","target":{"kind":["example"],"name":"stand_in","test":false},"profile":{"test":false},"executable":"/t/stand_in"}"#;
        let picks = |line: &str| -> Vec<Option<String>> {
            let a = artifact(line).unwrap();
            BUILDS.iter().map(|b| (b.pick)(&a)).collect()
        };
        let only = |index: usize, dest: &str| {
            let mut v = vec![None; BUILDS.len()];
            v[index] = Some(dest.to_owned());
            v
        };
        assert_eq!(picks(server), only(4, "server/kvcache-server"));
        assert_eq!(picks(driver), only(4, "server/e5s_serving"));
        assert_eq!(picks(other), vec![None; BUILDS.len()]);
        assert_eq!(picks(tool), only(5, STAND_IN));
        // What is required is what some build picks.
        for dest in REQUIRED {
            assert!(
                RUN_SH.contains(&format!("bin/{dest}")) || RUN_SH.contains(&format!("$BIN/{dest}")),
                "{dest}"
            );
        }
    }

    #[test]
    fn the_run_script_knows_the_bundle_layout() {
        // Where `pack` puts what BUILDS pick (`bin/` is `$BIN` there).
        for path in [
            "$BIN/models/paged_attention",
            "\"$BIN\"/causal-tests/*",
            "$BIN/bench/causal",
            "$BIN/bench/e8",
            "$BIN/server/kvcache-server",
            "$BIN/server/e6_e7_serving",
            "$BIN/server/e5s_serving",
            "$BIN/tools/stand_in",
        ] {
            assert!(RUN_SH.contains(path), "{path}");
        }
        assert!(RUN_SH.contains("lib/libcudart.so.13") && RUN_SH.contains("manifest.sh"));
        for (name, _) in SKELETONS {
            assert!(RUN_SH.contains(&format!("$unpack/models/{name}")), "{name}");
        }
    }

    #[test]
    fn arguments_are_a_target_dir_and_clippy() {
        let args = |a: &[&str]| parse_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let dir = |d: &str| Some(PathBuf::from(d));
        assert_eq!(args(&[]).unwrap(), Args::default());
        assert_eq!(args(&["--target-dir", "/t"]).unwrap().target_dir, dir("/t"));
        assert_eq!(args(&["--target-dir=/t"]).unwrap().target_dir, dir("/t"));
        assert_eq!(
            args(&["--clippy", "--target-dir=/t"]).unwrap(),
            Args {
                target_dir: dir("/t"),
                clippy: true
            }
        );
        assert!(args(&["--release"]).is_err());
        assert!(args(&["--target-dir"]).is_err());
    }
}
