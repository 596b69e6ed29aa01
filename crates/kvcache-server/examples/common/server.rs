//! A `kvcache-server` an example starts: on 127.0.0.1, on a free port, with
//! the example's flags; killed (by its process id) when dropped, or stopped
//! gracefully (SIGTERM, a bounded wait) by [`Server::stop`].

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

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
                // Its stdout closed: it exited (or is exiting), having said
                // why on its stderr, which is the example's.
                let _ = child.kill();
                let status = child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                return Err(format!(
                    "{} exited before listening ({status}); its error is printed above",
                    bin.display()
                )
                .into());
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

/// How [`Server::stop`] ended a server.
#[allow(dead_code)] // Not every example stops its servers gracefully.
#[derive(Debug, Clone, Copy)]
pub enum Stopped {
    /// It exited within the grace period after SIGTERM, with this status.
    Exited(ExitStatus),
    /// It had not exited by the end of the grace period and was killed.
    Killed,
}

impl Server {
    /// Stops the server gracefully: SIGTERM by its process id (`kill -TERM`),
    /// which lets it finish the requests in flight and its queued work, then
    /// waits up to `grace` for it to exit; SIGKILL if it has not.
    #[allow(dead_code)] // Not every example stops its servers gracefully.
    pub fn stop(mut self, grace: Duration) -> Result<Stopped, Box<dyn std::error::Error>> {
        if let Some(status) = self.child.try_wait()? {
            return Ok(Stopped::Exited(status));
        }
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status()?;
        if !sent.success() {
            // Gone between the check and the signal, or not signalable.
            if let Some(status) = self.child.try_wait()? {
                return Ok(Stopped::Exited(status));
            }
            return Err(format!("kill -TERM {pid}: {sent}").into());
        }
        let deadline = Instant::now() + grace;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Stopped::Exited(status));
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Ok(Stopped::Killed);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
