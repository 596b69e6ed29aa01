//! A `kvcache-server` an example starts: on 127.0.0.1, on a free port, with
//! the example's flags; killed (by its process id) when dropped.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running server this example started.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Server {
    /// Starts `bin` with `args` after the address flags and `env` set, and
    /// waits until it says where it listens.
    pub fn start<I, S>(bin: &Path, args: I, env: &[(&str, &str)]) -> Result<Self, Box<dyn std::error::Error>>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let url = loop {
            let Some(line) = lines.next() else {
                let _ = child.kill();
                return Err("the server exited before listening".into());
            };
            let line = line?;
            if let Some(url) = line.split("listening on ").nth(1) {
                break url.trim().to_string();
            }
        };
        // Keep draining its stdout so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Ok(Server { child, url })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
