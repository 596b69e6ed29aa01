//! The command that starts a replica of this program (`--replica`, see
//! `kvcache_bench::replica`): the flags are this binary's own, so they are
//! spelled here, beside the parser that reads them (`cli`'s tests parse what
//! [`Replicas::command`] builds). `benches/end_to_end.rs` includes this file
//! for its E3 and E4.

use std::path::PathBuf;
use std::process::Command;

use kvcache_bench::replica::ReplicaSetup;
use kvcache_engine::store::StoreOptions;
use kvcache_models::WeightMode;

/// What every replica of a run gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// This program.
    pub exe: PathBuf,
    /// The model file (`--model`).
    pub model: PathBuf,
    /// The E1 trace whose requests the replicas answer (`--trace`).
    pub trace: PathBuf,
    /// Tokens generated per request (`--e1-predict`).
    pub n_predict: usize,
    /// The device, as `--device` spells it.
    pub device: &'static str,
    /// How the weights are held (`--weights`; part of the store's model
    /// fingerprint, so every replica of a run needs the same).
    pub weights: WeightMode,
}

impl Replicas {
    /// `exe --replica` with the run's flags, then the flags of the tiers
    /// `store` names (`--store-dir`, `--redis`).
    pub fn command(&self, store: &StoreOptions) -> Command {
        let mut command = Command::new(&self.exe);
        command
            .arg("--replica")
            .arg("--model")
            .arg(&self.model)
            .arg("--trace")
            .arg(&self.trace)
            .args(["--e1-predict", &self.n_predict.to_string()])
            .args(["--device", self.device])
            .args(["--weights", self.weights.name()]);
        if let Some(dir) = &store.dir {
            command.arg("--store-dir").arg(dir);
        }
        if let Some(url) = &store.redis {
            command.args(["--redis", url]);
        }
        command
    }

    /// The setup `kvcache_bench`'s replica drivers start these replicas by.
    pub fn setup(&self) -> ReplicaSetup<'_> {
        ReplicaSetup::new(|store: &StoreOptions| self.command(store))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_replica_gets_the_runs_flags_then_its_stores() {
        use super::{PathBuf, Replicas, StoreOptions, WeightMode};

        let replicas = Replicas {
            exe: PathBuf::from("/bin/demo"),
            model: PathBuf::from("m.gguf"),
            trace: PathBuf::from("t.json"),
            n_predict: 8,
            device: "cpu",
            weights: WeightMode::Q8,
        };
        let run = [
            "--replica",
            "--model",
            "m.gguf",
            "--trace",
            "t.json",
            "--e1-predict",
            "8",
            "--device",
            "cpu",
            "--weights",
            "q8",
        ];
        let command = replicas.setup().command(&StoreOptions::default());
        assert_eq!(command.get_program(), "/bin/demo");
        assert_eq!(command.get_args().collect::<Vec<_>>(), run);
        let store = StoreOptions {
            dir: Some(PathBuf::from("/tmp/s")),
            redis: Some("redis://r".into()),
        };
        let command = replicas.command(&store);
        let args: Vec<_> = command.get_args().skip(run.len()).collect();
        assert_eq!(args, ["--store-dir", "/tmp/s", "--redis", "redis://r"]);
    }
}
