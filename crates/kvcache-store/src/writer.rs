//! The background writer: a thread fed through a bounded queue. Submitting never
//! blocks (a full queue drops the job and says so); [`Writer::flush`] waits until
//! everything accepted so far is written; [`Writer::shutdown`] finishes the
//! queue and joins the thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::{Result, StoreError};

/// Jobs accepted and finished, and whether the thread has ended.
#[derive(Debug, Default)]
struct Counts {
    accepted: u64,
    done: u64,
    ended: bool,
}

/// The counts, with a condition variable to wait on.
#[derive(Debug, Default)]
struct Progress {
    counts: Mutex<Counts>,
    changed: Condvar,
}

impl Progress {
    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Why [`Writer::try_submit`] dropped a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The queue holds as many jobs as it may.
    Full,
    /// The writer has shut down.
    Closed,
}

/// A background thread running one closure per job.
#[derive(Debug)]
pub(crate) struct Writer<J> {
    sender: Mutex<Option<SyncSender<J>>>,
    progress: Arc<Progress>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<J: Send + 'static> Writer<J> {
    /// Starts the thread `name`, with room for `capacity` queued jobs, running
    /// `work` on each. A panicking job is logged and counted as finished.
    pub(crate) fn spawn(
        name: &str,
        capacity: usize,
        mut work: impl FnMut(J) + Send + 'static,
    ) -> Result<Self> {
        let (sender, receiver) = sync_channel::<J>(capacity);
        let progress = Arc::new(Progress::default());
        let theirs = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                for job in receiver {
                    if catch_unwind(AssertUnwindSafe(|| work(job))).is_err() {
                        tracing::error!("kvcache-store: a write panicked; it is skipped");
                    }
                    theirs.lock().done += 1;
                    theirs.changed.notify_all();
                }
                theirs.lock().ended = true;
                theirs.changed.notify_all();
            })
            .map_err(StoreError::Spawn)?;
        Ok(Writer {
            sender: Mutex::new(Some(sender)),
            progress,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `job`, or drops it and says why: the queue is full, or the
    /// writer has shut down.
    pub(crate) fn try_submit(&self, job: J) -> std::result::Result<(), Refused> {
        let sender = self
            .sender
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(sender) = sender.as_ref() else {
            return Err(Refused::Closed);
        };
        let mut counts = self.progress.lock();
        match sender.try_send(job) {
            Ok(()) => {
                counts.accepted += 1;
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(Refused::Full),
            Err(TrySendError::Disconnected(_)) => Err(Refused::Closed),
        }
    }

    /// Waits until every job accepted before this call has been run.
    pub(crate) fn flush(&self) {
        let mut counts = self.progress.lock();
        let target = counts.accepted;
        while counts.done < target && !counts.ended {
            counts = self
                .progress
                .changed
                .wait(counts)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Runs what is queued, then stops and joins the thread.
    pub(crate) fn shutdown(&self) {
        drop(
            self.sender
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take(),
        );
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}
