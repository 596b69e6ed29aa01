//! Engine processes that share a prefix store: the store benchmarks E3 (a
//! restart over a disk store) and E4 (two replicas over one Redis), and a
//! conversation continued by a second process ([`hand_off`]).
//!
//! A *replica* is a process that calls [`run_process`] with the
//! [`ReplicaOptions`] its command line gave (kvcache-demo's `--replica` is
//! one; its flags are the demo's own): it loads the model, opens a chat
//! over the prefix trie and the store the options name, prints `ready`, then
//! answers one command per line on stdin with one JSON line on stdout:
//!
//! | command | answer |
//! |---|---|
//! | `run I` | [`TurnLine`] of trace request `I` through the trie and the store |
//! | `recompute I` | [`TurnLine`] of request `I` evaluated from scratch (no reuse) |
//! | `flush` | `{"flushed":true}` once the store has written everything queued |
//!
//! End of input flushes the store and exits. [`Replica`] is the other end: it
//! spawns one, sends commands and reads the answers. This module knows no
//! replica binary's flags: a [`ReplicaSetup`] is given, by whoever knows the
//! binary, the command that starts a replica over a given store.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use candle_core::Device;
use kvcache_engine::chat::{Chat, Reuse, TurnOutcome};
use kvcache_engine::store::{self, StoreOptions};
use kvcache_engine::{EngineError, Result};
use kvcache_models::{Llama, ModelFile, WeightMode};
use serde::{Deserialize, Serialize};

use crate::trace::{Request, Trace};

/// Paged-out snapshots a replica's trie keeps in memory (the benchmarks' budget).
pub const TRIE_BUDGET: usize = 4 << 30;

/// How long a replica's trie waits for the store before it evaluates instead.
pub const STORE_DEADLINE: Duration = Duration::from_secs(2);

/// What a replica process serves.
#[derive(Debug, Clone)]
pub struct ReplicaOptions {
    /// The GGUF model file.
    pub model: PathBuf,
    /// Where the candle model runs.
    pub device: Device,
    /// How the weights are loaded (part of the store's model fingerprint).
    pub weights: WeightMode,
    /// The trace whose requests `run I` and `recompute I` name.
    pub trace: PathBuf,
    /// Tokens generated per request.
    pub n_predict: usize,
    /// The store's tiers beside host memory; with none, the trie alone (no store).
    pub store: StoreOptions,
}

/// A replica process's life: loads the model and the trace, opens the store
/// `options` name (none: a trie of its own), then [`serve`]s `input` to `output`.
pub fn run_process(options: &ReplicaOptions, input: impl BufRead, output: impl Write) -> Result<()> {
    let model = ModelFile::open(&options.model)?.load(&options.device, options.weights, &mut |_| {})?;
    let trace = Trace::load(&options.trace)?;
    if options.store.dir.is_none() && options.store.redis.is_none() {
        let mut chat = Chat::new(&model, Reuse::Trie, TRIE_BUDGET)?;
        return serve(
            &model,
            &trace,
            &mut chat,
            &|| {},
            options.n_predict,
            input,
            output,
        );
    }
    let fingerprint = store::model_fingerprint(&options.model, options.weights)?;
    let store = store::open(fingerprint, store::kv_layout(&model), &options.store)?;
    let mut chat = Chat::with_store(&model, TRIE_BUDGET, store.clone(), STORE_DEADLINE)?;
    let flush = || store.flush();
    serve(
        &model,
        &trace,
        &mut chat,
        &flush,
        options.n_predict,
        input,
        output,
    )
}

/// One answered request, as a replica reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnLine {
    /// Index in the trace.
    pub idx: usize,
    /// Conversation.
    pub conv: usize,
    /// Turn in the conversation, from 1.
    pub turn: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens restored (trie and store together).
    pub cached: usize,
    /// Of those, tokens restored from the store.
    pub restored: usize,
    /// `(tier, tokens)` the store served.
    pub tiers: Vec<(String, usize)>,
    /// Prompt tokens evaluated.
    pub evaluated: usize,
    /// Time to first token, milliseconds.
    pub ttft_ms: f64,
}

impl TurnLine {
    fn new(request: &Request, outcome: &TurnOutcome) -> Self {
        TurnLine {
            idx: request.idx,
            conv: request.conv,
            turn: request.turn,
            prompt_tokens: outcome.prompt_tokens,
            cached: outcome.matched,
            restored: outcome.restored,
            tiers: outcome
                .tiers
                .iter()
                .map(|(name, n)| ((*name).to_owned(), *n))
                .collect(),
            evaluated: outcome.evaluated,
            ttft_ms: outcome.time_to_first_token.as_secs_f64() * 1e3,
        }
    }
}

/// Serves replica commands from `input` to `output` (see the module docs) with
/// `chat` for `run` and a fresh no-reuse chat per `recompute`; `flush`
/// waits for `store` to drain.
pub fn serve(
    model: &Llama,
    trace: &Trace,
    chat: &mut Chat<'_>,
    flush: &dyn Fn(),
    n_predict: usize,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<()> {
    let io = |e: std::io::Error| EngineError::io(Path::new("<stdout>"), e);
    writeln!(output, "ready").map_err(io)?;
    output.flush().map_err(io)?;
    for line in input.lines() {
        let line = line.map_err(|e| EngineError::io(Path::new("<stdin>"), e))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            [] => continue,
            ["flush"] => {
                flush();
                "{\"flushed\":true}".to_owned()
            }
            [command @ ("run" | "recompute"), index] => {
                let i: usize = index
                    .parse()
                    .map_err(|_| EngineError::InvalidArgument(format!("not a request index: {index:?}")))?;
                let request = trace.requests.get(i).ok_or_else(|| {
                    EngineError::InvalidArgument(format!("request {i} of {}", trace.requests.len()))
                })?;
                let outcome = if *command == "run" {
                    chat.generate(&request.token_ids, n_predict, None)?
                } else {
                    Chat::new(model, Reuse::None, 0)?.generate(&request.token_ids, n_predict, None)?
                };
                serde_json::to_string(&TurnLine::new(request, &outcome))
                    .map_err(|e| EngineError::Format(e.to_string()))?
            }
            _ => {
                return Err(EngineError::InvalidArgument(format!(
                    "unknown replica command {line:?}"
                )))
            }
        };
        writeln!(output, "{answer}").map_err(io)?;
        output.flush().map_err(io)?;
    }
    flush();
    Ok(())
}

/// How to start the replicas of a run: the command that starts one over a
/// given store. The flags are the replica binary's own, so its owner builds
/// the command (the demo: itself with `--replica`, the run's model, trace and
/// device, and the store's flags); [`ReplicaSetup::spawn`] adds the pipes.
pub struct ReplicaSetup<'a> {
    command: Box<dyn Fn(&StoreOptions) -> Command + 'a>,
}

impl<'a> ReplicaSetup<'a> {
    /// Replicas started by `command(store)`: a process serving the replica
    /// protocol (the module docs) over the tiers `store` names (none: a trie
    /// of its own, no store).
    pub fn new(command: impl Fn(&StoreOptions) -> Command + 'a) -> Self {
        ReplicaSetup {
            command: Box::new(command),
        }
    }

    /// The command that starts a replica over `store`.
    pub fn command(&self, store: &StoreOptions) -> Command {
        (self.command)(store)
    }

    /// Starts one replica over `store`, named `label` in errors.
    pub fn spawn(&self, store: &StoreOptions, label: &str) -> Result<Replica> {
        Replica::spawn(self.command(store), label)
    }
}

impl fmt::Debug for ReplicaSetup<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let command = self.command(&StoreOptions::default());
        f.debug_struct("ReplicaSetup")
            .field("without_a_store", &command)
            .finish()
    }
}

/// One conversation of `trace` continued across a restart: a replica over the
/// disk store in `dir` answers conversation `conv`'s first `turns - 1` turns and
/// stops (flushing its store); a second replica over the same directory, its
/// trie empty, answers turn `turns`, restoring the conversation from the store.
/// `on_turn(process, line)` sees each answer, `process` being 1 or 2.
///
/// `turns` below 2, or a conversation with fewer turns, is an
/// [`EngineError::InvalidArgument`] before any process starts.
pub fn hand_off(
    setup: &ReplicaSetup<'_>,
    trace: &Trace,
    conv: usize,
    turns: usize,
    dir: &Path,
    on_turn: &mut dyn FnMut(usize, &TurnLine),
) -> Result<()> {
    let requests: Vec<usize> = trace
        .requests
        .iter()
        .filter(|r| r.conv == conv)
        .map(|r| r.idx)
        .take(turns)
        .collect();
    if turns < 2 || requests.len() < turns {
        return Err(EngineError::InvalidArgument(format!(
            "a hand-off needs two turns or more of conversation {conv}: {turns} asked, {} in the trace",
            requests.len()
        )));
    }
    let store = StoreOptions {
        dir: Some(dir.to_owned()),
        redis: None,
    };
    let (last, before) = requests.split_last().expect("two requests or more");
    let mut first = setup.spawn(&store, "first process")?;
    for &i in before {
        on_turn(1, &first.run(i)?);
    }
    first.stop()?;
    let mut second = setup.spawn(&store, "second process")?;
    on_turn(2, &second.run(*last)?);
    second.stop()
}

/// A replica process, spawned and driven over its stdin and stdout.
#[derive(Debug)]
pub struct Replica {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    label: String,
}

impl Replica {
    /// Starts `command` (a replica: see the module docs) with its input and
    /// output piped and waits for its `ready` line (the model is loaded and
    /// the store open).
    pub fn spawn(mut command: Command, label: &str) -> Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| EngineError::io(Path::new(command.get_program()), e))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut replica = Replica {
            child,
            stdin,
            stdout,
            label: label.to_owned(),
        };
        let first = replica.read_line()?;
        if first != "ready" {
            return Err(EngineError::Format(format!(
                "{label}: expected `ready`, got {first:?}"
            )));
        }
        Ok(replica)
    }

    /// Runs trace request `i` through the replica's trie and store.
    pub fn run(&mut self, i: usize) -> Result<TurnLine> {
        self.ask(&format!("run {i}"))
    }

    /// Evaluates trace request `i` from scratch in the replica (its time to
    /// first token without any reuse, under the same load).
    pub fn recompute(&mut self, i: usize) -> Result<TurnLine> {
        self.ask(&format!("recompute {i}"))
    }

    /// Waits until the replica's store has written everything queued.
    pub fn flush(&mut self) -> Result<()> {
        self.send("flush")?;
        let line = self.read_line()?;
        if line.contains("flushed") {
            Ok(())
        } else {
            Err(EngineError::Format(format!(
                "{}: flush answered {line:?}",
                self.label
            )))
        }
    }

    /// Stops the replica the way an engine is shut down: its input closes, it
    /// writes what its store still has queued and exits.
    pub fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        let status = self
            .child
            .wait()
            .map_err(|e| EngineError::io(Path::new(&self.label), e))?;
        if status.success() {
            Ok(())
        } else {
            Err(EngineError::Format(format!(
                "{} exited with {status}",
                self.label
            )))
        }
    }

    fn ask(&mut self, command: &str) -> Result<TurnLine> {
        self.send(command)?;
        let line = self.read_line()?;
        serde_json::from_str(&line)
            .map_err(|e| EngineError::Format(format!("{}: {e} in {line:?}", self.label)))
    }

    fn send(&mut self, command: &str) -> Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| EngineError::InvalidArgument(format!("{} is stopping", self.label)))?;
        writeln!(stdin, "{command}")
            .and_then(|()| stdin.flush())
            .map_err(|e| EngineError::io(Path::new(&self.label), e))
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(|e| EngineError::io(Path::new(&self.label), e))?;
        if n == 0 {
            return Err(EngineError::Format(format!("{} closed its output", self.label)));
        }
        Ok(line.trim_end().to_owned())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // A replica left running (an error on our side) is killed by its pid.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setup_starts_each_replica_with_the_command_for_its_store() {
        let setup = ReplicaSetup::new(|store: &StoreOptions| {
            let mut command = Command::new("/nonexistent/engine");
            command.args(store.dir.iter()).args(store.redis.iter());
            command
        });
        let store = StoreOptions {
            dir: Some(PathBuf::from("/tmp/s")),
            redis: Some("redis+unix:///tmp/r.sock".into()),
        };
        let command = setup.command(&store);
        let args: Vec<_> = command.get_args().collect();
        assert_eq!(command.get_program(), "/nonexistent/engine");
        assert_eq!(args, ["/tmp/s", "redis+unix:///tmp/r.sock"]);
        assert_eq!(setup.command(&StoreOptions::default()).get_args().count(), 0);
        let err = setup.spawn(&store, "replica").unwrap_err();
        assert!(matches!(err, EngineError::Io { .. }), "{err}");
    }

    #[test]
    fn a_hand_off_needs_two_turns_of_a_conversation_before_starting_anything() {
        let trace = Trace::load(kvcache_models::paths::e1_trace_path()).unwrap();
        // A binary that does not exist: spawning would fail with an io error.
        let setup = ReplicaSetup::new(|_: &StoreOptions| Command::new("/nonexistent/engine"));
        let dir = std::env::temp_dir();
        let turns = trace.conversations[0].len();
        for (conv, n) in [(0, 1), (0, turns + 1), (trace.conversations.len(), 2)] {
            let err = hand_off(&setup, &trace, conv, n, &dir, &mut |_, _| unreachable!()).unwrap_err();
            assert!(
                matches!(err, EngineError::InvalidArgument(_)),
                "{conv} {n}: {err}"
            );
        }
        let err = hand_off(&setup, &trace, 0, 2, &dir, &mut |_, _| unreachable!()).unwrap_err();
        assert!(matches!(err, EngineError::Io { .. }), "{err}");
    }

    #[test]
    fn a_replica_without_a_store_answers_commands_and_rejects_bad_ones() {
        let model = Llama::random(kvcache_models::LlamaConfig::tiny(), 2, &Device::Cpu).unwrap();
        let trace: Trace = serde_json::from_str(
            r#"{"system":"s","conversations":[],"requests":[
                {"idx":0,"conv":0,"turn":1,"prompt":"p","n_predict":1,"prompt_tokens":4,
                 "best_prefix_with_earlier":0,"token_ids":[1,2,3,4],"min_prefill":4},
                {"idx":1,"conv":0,"turn":2,"prompt":"p","n_predict":1,"prompt_tokens":6,
                 "best_prefix_with_earlier":4,"token_ids":[1,2,3,4,9,9],"min_prefill":2}]}"#,
        )
        .unwrap();
        let mut chat = Chat::new(&model, Reuse::Trie, 1 << 20).unwrap();
        let mut out = Vec::new();
        // One token each: the trie keeps exactly the evaluated prompt.
        serve(
            &model,
            &trace,
            &mut chat,
            &|| {},
            1,
            "run 0\nrun 1\nrecompute 1\n".as_bytes(),
            &mut out,
        )
        .unwrap();
        let lines: Vec<&str> = std::str::from_utf8(&out).unwrap().lines().collect();
        assert_eq!(lines[0], "ready");
        let turn = |i: usize| serde_json::from_str::<TurnLine>(lines[i]).unwrap();
        assert_eq!((turn(1).idx, turn(1).evaluated), (0, 4));
        assert_eq!((turn(2).idx, turn(2).cached, turn(2).evaluated), (1, 4, 2));
        assert_eq!((turn(3).cached, turn(3).evaluated), (0, 6));
        for bad in ["run 7\n", "jump 1\n", "run x\n"] {
            let err = serve(&model, &trace, &mut chat, &|| {}, 1, bad.as_bytes(), Vec::new()).unwrap_err();
            assert!(matches!(err, EngineError::InvalidArgument(_)), "{bad:?}: {err}");
        }
    }
}
