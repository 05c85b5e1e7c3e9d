//! The thread every BPF watcher lives on: it loads and attaches its program, reports once
//! whether that worked, then polls until told to stop. Dropping the handle stops and joins it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::WatchError;
use crate::realtime::{self, Scheduling};

/// A running watcher thread.
pub(crate) struct PollThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    scheduling: Scheduling,
}

impl PollThread {
    /// Starts `body` on a thread named `name`. `body` sends its start-up result (what the
    /// watcher keeps, or why it failed) on the channel it gets, then polls until the flag it gets
    /// is set. Returns once the start-up result is in. With `realtime` the thread first puts
    /// itself under `SCHED_FIFO` at that priority (see [`crate::realtime`]).
    pub fn spawn<R: Send + 'static>(
        name: &str,
        realtime: Option<u8>,
        body: impl FnOnce(SyncSender<Result<R, WatchError>>, Arc<AtomicBool>) + Send + 'static,
    ) -> Result<(PollThread, R), WatchError> {
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (sched_tx, sched_rx) = mpsc::sync_channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let _ = sched_tx.send(realtime::apply_to_current_thread(realtime));
                body(ready_tx, stop2)
            })
            .map_err(|e| WatchError::Thread(e.to_string()))?;
        let scheduling = sched_rx.recv().unwrap_or(Scheduling::Normal);
        match ready_rx.recv() {
            Ok(Ok(kept)) => Ok((
                PollThread {
                    stop,
                    thread: Some(thread),
                    scheduling,
                },
                kept,
            )),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(WatchError::Thread(match thread.join() {
                Err(p) => format!(
                    "{name} panicked: {}",
                    p.downcast_ref::<&str>()
                        .copied()
                        .or(p.downcast_ref::<String>().map(String::as_str))
                        .unwrap_or("?")
                ),
                Ok(()) => format!("{name} exited during start-up"),
            })),
        }
    }

    /// How the thread is scheduled.
    pub fn scheduling(&self) -> &Scheduling {
        &self.scheduling
    }

    /// False once the thread has ended (it only ends early if it panicked).
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for PollThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
