//! `run.sh` run for real, without a GPU: a bundle of the same layout whose
//! executables are small shell programs that say what they were asked to do.
//! What is checked is the script's own work: unpacking, the files it checks,
//! the order and the budget of the pieces, what each piece is given, and what
//! it leaves under `$OUT` (what a device step brings back: at most 8 files).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{REQUIRED, RUN_SH, SKELETONS};

/// The causal test binaries of the fake bundle: two that pass and one that fails.
const CAUSAL_TESTS: [&str; 3] = ["properties", "scenarios", "transfer"];
/// The one that fails, and its exit status.
const FAILING: (&str, i32) = ("transfer", 3);

/// A scratch folder, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn program(path: &Path, body: &str) {
    write(path, &format!("#!/bin/sh\n{body}\n"));
    super::set_executable(path).unwrap();
}

/// What a fake executable at `dest` (under `bin/`) does: tests report passing
/// (or the one failing exits), the rest print the lines the drivers print, the
/// stand-in tool copies the skeleton to the model path.
fn body(dest: &str) -> String {
    let say = format!(
        "echo \"{dest} in $PWD device=$KVCACHE_DEVICE args: $*\"\n\
         echo \"view=$KVCACHE_BENCH_VIEW runs=$KVCACHE_BENCH_RUNS\""
    );
    match dest {
        "tools/stand_in" => format!("{say}\n[ \"$1\" = fill ] && cp \"$2\" \"$3\""),
        "server/e6_e7_serving" | "server/e5s_serving" => {
            format!("{say}\necho \"E6 evaluated 10 / 10 (1.0000x) $* model=$KVCACHE_MODEL\"")
        }
        d if d.starts_with("causal-tests/") && d.ends_with(FAILING.0) => {
            format!(
                "{say}\necho 'test result: FAILED. 1 passed; 1 failed'\nexit {}",
                FAILING.1
            )
        }
        d if d.starts_with("causal-tests/") || d == "models/paged_attention" => {
            format!("{say}\necho 'test result: ok. 2 passed; 0 failed'")
        }
        _ => say,
    }
}

/// A repository (what the script checks for) and `target/cuda-bundle` in it
/// holding `run.sh` and a bundle of fake executables built "in" that repository.
fn fake_bundle(scratch: &Path) -> (PathBuf, PathBuf) {
    let root = scratch.join("repo");
    for dir in ["fixtures/causal", "crates/kvcache-causal/tests/snapshots"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    for file in ["fixtures/e1_trace.json", "fixtures/e5_trace.json"] {
        write(&root.join(file), "{}");
    }
    // How the script finds the repository: two folders above itself.
    write(&root.join("Cargo.toml"), "[workspace]\n");
    for krate in ["kvcache-models", "kvcache-bench", "kvcache-server"] {
        std::fs::create_dir_all(root.join("crates").join(krate)).unwrap();
    }
    let staging = scratch.join("staging");
    let mut binaries: Vec<String> = REQUIRED.iter().map(|d| d.to_string()).collect();
    binaries.extend(CAUSAL_TESTS.iter().map(|t| format!("causal-tests/{t}")));
    for dest in &binaries {
        program(&staging.join("bin").join(dest), &body(dest));
    }
    for (name, _) in SKELETONS {
        write(&staging.join("models").join(name), &format!("skeleton of {name}"));
    }
    write(&staging.join("lib/libcudart.so.13"), "");
    let listed = |prefix: &str, names: Vec<String>| -> String {
        names
            .iter()
            .map(|n| format!("{prefix}{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    write(
        &staging.join("manifest.sh"),
        &format!(
            "BUNDLE_BUILD_ROOT='{}'\nBUNDLE_COMMIT=test\nBUNDLE_TREE='a clean tree'\nBUNDLE_BUILT=now\n\
             BUNDLE_NVCC=13.0\nBUNDLE_COMPUTE_CAP=90\nBUNDLE_BINARIES='{}'\nBUNDLE_SKELETONS='{}'\n",
            root.display(),
            listed("bin/", binaries),
            listed("models/", SKELETONS.iter().map(|(n, _)| n.to_string()).collect()),
        ),
    );
    let bundle = root.join("target/cuda-bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    let packed = Command::new("python3")
        .args([
            "-c",
            "import sys, tarfile\nwith tarfile.open(sys.argv[2], 'w:xz') as t: t.add(sys.argv[1], '.')",
        ])
        .arg(&staging)
        .arg(bundle.join("bundle.tar.xz"))
        .status()
        .unwrap();
    assert!(packed.success(), "packing the fake bundle");
    write(&bundle.join("run.sh"), RUN_SH);
    (root, bundle)
}

/// Runs the bundle's `run.sh` with `envs`, `$OUT` at `out`, temporary files under `tmp`.
fn run(bundle: &Path, out: &Path, tmp: &Path, envs: &[(&str, &str)]) -> Output {
    std::fs::create_dir_all(tmp).unwrap();
    let mut command = Command::new("bash");
    command
        .arg(bundle.join("run.sh"))
        .env("OUT", out)
        .env("TMPDIR", tmp)
        .env_remove("KVCACHE_BUNDLE_ONLY")
        .env_remove("KVCACHE_BUNDLE_DRY_RUN")
        .env_remove("KVCACHE_REPO_ROOT");
    for (key, value) in envs {
        command.env(key, value);
    }
    command.output().unwrap()
}

/// `summary.tsv`'s (piece, status) pairs, in order.
fn summary(out: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(out.join("summary.tsv")).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("piece\tstatus\tseconds\tlog"));
    lines
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 4, "{line}");
            (fields[0].to_owned(), fields[1].to_owned())
        })
        .collect()
}

fn files_under(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The pieces in the order the script runs them, the causal tests (run at
/// once) where they start.
const ORDER: [&str; 10] = [
    "engine-kernel",
    "stand-ins",
    "e6-e7-cuda",
    "causal-bench-cuda",
    "e8-cuda",
    "e5s-cuda",
    "causal-tests",
    "e6-e7-cpu",
    "causal-bench-cpu",
    "causal-bench-cuda-paged",
];

#[test]
fn every_piece_runs_in_order_and_four_files_come_back() {
    let scratch = Scratch::new("run-sh");
    let (root, bundle) = fake_bundle(&scratch.0);
    let (out, tmp) = (scratch.0.join("out"), scratch.0.join("tmp"));
    let output = run(&bundle, &out, &tmp, &[]);
    let log = text(&output);
    // One test binary failed, so the run did.
    assert_eq!(output.status.code(), Some(1), "{log}");

    let pieces = summary(&out);
    assert_eq!(pieces[0], ("unpack".to_owned(), "ok".to_owned()), "{log}");
    let mut expected = Vec::new();
    for name in ORDER {
        if name == "causal-tests" {
            expected.extend(CAUSAL_TESTS.iter().map(|t| format!("causal-tests/{t}")));
        } else {
            expected.push(name.to_owned());
        }
    }
    // The test binaries run at once and finish in any order: compare them sorted.
    let mut got: Vec<String> = pieces[1..].iter().map(|(p, _)| p.clone()).collect();
    let tests = ORDER.iter().position(|n| *n == "causal-tests").unwrap();
    got[tests..tests + CAUSAL_TESTS.len()].sort();
    assert_eq!(got, expected, "{log}");
    for (piece, status) in &pieces[1..] {
        let want = if piece.ends_with(FAILING.0) {
            format!("failed({})", FAILING.1)
        } else {
            "ok".to_owned()
        };
        assert_eq!(status, &want, "{piece}: {log}");
    }

    // What a device step brings back: four files, no folders.
    assert_eq!(
        files_under(&out),
        ["logs.tar.gz", "results.txt", "run.log", "summary.tsv"]
            .map(str::to_owned)
            .into(),
        "{log}"
    );
    let logs = scratch.0.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let unpacked = Command::new("tar")
        .arg("-xzf")
        .arg(out.join("logs.tar.gz"))
        .arg("-C")
        .arg(&logs)
        .status()
        .unwrap();
    assert!(unpacked.success());
    let read_log = |name: &str| {
        std::fs::read_to_string(logs.join(name)).unwrap_or_else(|e| panic!("{name} in logs.tar.gz: {e}"))
    };
    assert!(read_log("ldd.log").contains("LD_LIBRARY_PATH="));
    assert!(read_log("manifest.sh").contains("BUNDLE_COMMIT=test"));
    assert!(read_log("causal-tests/transfer.log").contains("test result: FAILED"));
    let kernel = read_log("engine-kernel.log");
    assert!(
        kernel.contains(&format!(
            "models/paged_attention in {}/crates/kvcache-models device=cuda args: the_cuda_kernel_on_the_gpu",
            root.display()
        )),
        "{kernel}"
    );
    let cpu = read_log("causal-bench-cpu.log");
    assert!(cpu.contains("device=cpu args: --bench\nview= runs=3"), "{cpu}");
    let paged = read_log("causal-bench-cuda-paged.log");
    assert!(
        paged.contains("device=cuda args: --bench\nview=paged runs=3"),
        "{paged}"
    );

    // Each piece got its device, its model and its crate folder.
    let results = std::fs::read_to_string(out.join("results.txt")).unwrap();
    let stand_ins = tmp.join("kvcache-stand-ins");
    let smollm2 = stand_ins.join("smollm2.gguf");
    for (driver, device, model) in [
        ("e6-e7-cuda", "cuda", format!("model={}", smollm2.display())),
        (
            "e5s-cuda",
            "cuda",
            format!("--gemma {}", stand_ins.join("gemma3.gguf").display()),
        ),
        ("e6-e7-cpu", "cpu", format!("model={}", smollm2.display())),
    ] {
        let section = results
            .split("== ")
            .find(|s| s.starts_with(driver))
            .unwrap_or_else(|| panic!("no {driver} in results.txt: {results}"));
        assert!(
            section.contains(&format!("--mode both --device {device}")),
            "{section}"
        );
        assert!(section.contains("E6 evaluated 10 / 10"), "{section}");
        assert!(section.contains(&model), "{section}");
    }
    let run_log = std::fs::read_to_string(out.join("run.log")).unwrap();
    assert!(
        run_log.contains(&format!("paths: {} is this repository", root.display())),
        "{run_log}"
    );
    // The stand-ins were filled from the skeletons (here: copied).
    assert_eq!(
        std::fs::read_to_string(&smollm2).unwrap(),
        "skeleton of smollm2.skeleton.gguf"
    );
}

#[test]
fn a_spent_budget_skips_and_a_dry_run_runs_nothing() {
    let scratch = Scratch::new("run-sh-budget");
    let (_, bundle) = fake_bundle(&scratch.0);
    let tmp = scratch.0.join("tmp");

    let out = scratch.0.join("spent");
    let only = [("KVCACHE_BUNDLE_ONLY", "serving"), ("KVCACHE_BUNDLE_BUDGET", "0")];
    let output = run(&bundle, &out, &tmp, &only);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let pieces = summary(&out);
    let serving = ["stand-ins", "e6-e7-cuda", "e5s-cuda", "e6-e7-cpu"];
    assert_eq!(pieces.len(), 1 + serving.len(), "{pieces:?}");
    for ((piece, status), want) in pieces[1..].iter().zip(serving) {
        assert_eq!((piece.as_str(), status.as_str()), (want, "skipped(budget)"));
    }
    assert!(!tmp.join("kvcache-stand-ins/smollm2.gguf").exists());

    let out = scratch.0.join("dry");
    let output = run(&bundle, &out, &tmp, &[("KVCACHE_BUNDLE_DRY_RUN", "1")]);
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    let pieces = summary(&out);
    assert_eq!(
        pieces.len(),
        1 + ORDER.len() - 1 + CAUSAL_TESTS.len(),
        "{pieces:?}"
    );
    assert!(
        pieces[1..].iter().all(|(_, status)| status == "dry-run"),
        "{pieces:?}"
    );
    assert!(log.contains("would run: cd "), "{log}");
    assert!(!tmp.join("kvcache-stand-ins/smollm2.gguf").exists());
}
