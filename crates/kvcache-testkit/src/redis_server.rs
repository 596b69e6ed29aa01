//! A `redis-server` of one's own for tests, benchmarks and demos: started from
//! `PATH` on a Unix socket in a directory the caller gives (no TCP port, no
//! persistence, a `maxmemory` budget with `allkeys-lru`), and killed by its
//! process id when dropped. Never a server anyone else uses.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Why a server of one's own did not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum LocalServerError {
    /// `redis-server` could not be run.
    #[error("cannot start redis-server: {0}")]
    Spawn(#[source] std::io::Error),
    /// It exited, or did not answer, at start.
    #[error("redis-server: {0}")]
    Start(String),
    /// It did not answer a connection.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
}

/// What a server of one's own answers.
pub type Result<T> = std::result::Result<T, LocalServerError>;

/// Environment variable that makes a missing `redis-server` a failure instead
/// of a skipped test (`cargo xtask test` sets it to `1`).
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_REDIS";

/// Whether `redis-server` is on `PATH`.
pub fn on_path() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("redis-server").is_file()))
}

/// For a test that needs Redis: `true` when `redis-server` is on `PATH`. When it
/// is not, panics if [`REQUIRE_ENV`] is `1` (a set-up that promised Redis), else
/// prints `skipped: redis-server not on PATH` (straight to the process's
/// stderr, past the test harness's capture, so a plain `cargo test` shows it)
/// and answers `false`.
pub fn available_or_skip() -> bool {
    if on_path() {
        return true;
    }
    assert!(
        std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
        "redis-server is not on PATH and {REQUIRE_ENV}=1 (run `cargo xtask prepare`)"
    );
    let name = std::thread::current().name().unwrap_or("a test").to_owned();
    let _ = writeln!(std::io::stderr(), "skipped: {name}: redis-server not on PATH");
    false
}

/// A running `redis-server` (see the [module docs](self)).
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    dir: PathBuf,
    maxmemory: u64,
}

impl RedisServer {
    /// Starts a server listening on `dir/redis.sock` only, holding at most
    /// `maxmemory` bytes, and waits until it answers `PING`.
    pub fn start(dir: &Path, maxmemory: u64) -> Result<Self> {
        let mut server = RedisServer {
            child: None,
            dir: dir.to_path_buf(),
            maxmemory,
        };
        server.launch()?;
        Ok(server)
    }

    /// The server's Unix socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("redis.sock")
    }

    /// The URL the `redis` crate and `kvcache_store::RedisConfig` take.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    /// The configured `maxmemory`.
    pub fn maxmemory(&self) -> u64 {
        self.maxmemory
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A connection for checks of one's own (PING answered).
    pub fn connection(&self) -> Result<redis::Connection> {
        let mut connection =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))?;
        redis::cmd("PING").query::<String>(&mut connection)?;
        Ok(connection)
    }

    /// Kills the server (SIGKILL, by its process id), as an outage would, and
    /// reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a new, empty server on the same socket (killing the old one if
    /// it still runs).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let _ = std::fs::remove_file(self.socket());
        self.launch()
    }

    fn launch(&mut self) -> Result<()> {
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(self.socket())
            .args(["--unixsocketperm", "700", "--save", "", "--appendonly", "no"])
            .args([
                "--maxmemory",
                &self.maxmemory.to_string(),
                "--maxmemory-policy",
                "allkeys-lru",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(LocalServerError::Spawn)?;
        self.child = Some(child);
        for _ in 0..400 {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(LocalServerError::Start(format!("exited at start: {status}")));
            }
            if self.socket().exists() && self.connection().is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        self.kill();
        Err(LocalServerError::Start("no answer to PING within 10 s".into()))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
