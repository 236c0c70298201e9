//! A thread of its own fed through a bounded channel, for the half of a shard writer that
//! compresses or writes out while the caller encodes the next rows.

use std::io;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// Items go in; the thread's result (or the error that stopped it) comes back at the end.
pub struct Pipe<T, R> {
    items: Option<SyncSender<T>>,
    thread: Option<JoinHandle<io::Result<R>>>,
}

impl<T: Send + 'static, R: Send + 'static> Pipe<T, R> {
    /// Runs `work` on a new thread over the items sent, at most `depth` of them queued.
    pub fn spawn(depth: usize, work: impl FnOnce(Receiver<T>) -> io::Result<R> + Send + 'static) -> Self {
        let (items, received) = sync_channel::<T>(depth);
        let thread = std::thread::spawn(move || work(received));
        Pipe { items: Some(items), thread: Some(thread) }
    }

    /// Queues `item`, waiting while the queue is full; if the thread stopped, its error.
    pub fn send(&mut self, item: T) -> io::Result<()> {
        let sent = self.items.as_ref().is_some_and(|items| items.send(item).is_ok());
        if sent { Ok(()) } else { Err(self.join().err().unwrap_or_else(|| io::Error::other("writer thread stopped"))) }
    }

    /// Ends the items and waits for the thread's result.
    pub fn finish(mut self) -> io::Result<R> {
        self.join()
    }

    fn join(&mut self) -> io::Result<R> {
        self.items = None;
        let thread = self.thread.take().ok_or_else(|| io::Error::other("writer thread already finished"))?;
        thread.join().map_err(|_| io::Error::other("writer thread panicked"))?
    }
}
