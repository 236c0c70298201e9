//! A thread of its own fed through a bounded channel, for the half of a shard writer that
//! compresses or writes out while the caller encodes the next rows.

use std::io;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

enum Message<T> {
    Item(T),
    /// Sent by [`Pipe::finish`]: the items are complete.
    End,
}

/// The items a pipe's thread receives: each `Ok`, then the end — or an error once the sending
/// side went away without finishing (a shard abandoned after an error), so the thread stops
/// without completing a file nobody will keep.
pub struct Items<T>(Receiver<Message<T>>);

impl<T> Iterator for Items<T> {
    type Item = io::Result<T>;

    fn next(&mut self) -> Option<io::Result<T>> {
        match self.0.recv() {
            Ok(Message::Item(item)) => Some(Ok(item)),
            Ok(Message::End) => None,
            Err(_) => Some(Err(io::Error::other("the shard was abandoned"))),
        }
    }
}

/// Items go in; the thread's result (or the error that stopped it) comes back at the end.
/// Dropped unfinished, it tells the thread to stop and waits for it.
pub struct Pipe<T, R> {
    items: Option<SyncSender<Message<T>>>,
    thread: Option<JoinHandle<io::Result<R>>>,
}

impl<T: Send + 'static, R: Send + 'static> Pipe<T, R> {
    /// Runs `work` on a new thread over the items sent, at most `depth` of them queued.
    pub fn spawn(depth: usize, work: impl FnOnce(Items<T>) -> io::Result<R> + Send + 'static) -> Self {
        let (items, received) = sync_channel::<Message<T>>(depth);
        let thread = std::thread::spawn(move || work(Items(received)));
        Pipe { items: Some(items), thread: Some(thread) }
    }

    /// Queues `item`, waiting while the queue is full; if the thread stopped, its error.
    pub fn send(&mut self, item: T) -> io::Result<()> {
        self.deliver(Message::Item(item))
    }

    /// Ends the items and waits for the thread's result.
    pub fn finish(mut self) -> io::Result<R> {
        self.deliver(Message::End)?;
        self.join()
    }

    fn deliver(&mut self, message: Message<T>) -> io::Result<()> {
        let sent = self.items.as_ref().is_some_and(|items| items.send(message).is_ok());
        if sent { Ok(()) } else { Err(self.join().err().unwrap_or_else(|| io::Error::other("writer thread stopped"))) }
    }

    fn join(&mut self) -> io::Result<R> {
        self.items = None;
        let thread = self.thread.take().ok_or_else(|| io::Error::other("writer thread already finished"))?;
        thread.join().map_err(|_| io::Error::other("writer thread panicked"))?
    }
}

impl<T, R> Drop for Pipe<T, R> {
    fn drop(&mut self) {
        self.items = None; // the thread sees the items end unfinished and stops
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn an_abandoned_pipe_stops_its_thread_before_the_end() {
        let completed = Arc::new(AtomicBool::new(false));
        let seen = completed.clone();
        let mut pipe = Pipe::spawn(2, move |items: Items<u32>| {
            let mut sum = 0;
            for item in items {
                sum += item?;
            }
            seen.store(true, Ordering::SeqCst); // only a finished pipe gets here
            Ok(sum)
        });
        pipe.send(1).unwrap();
        drop(pipe);
        assert!(!completed.load(Ordering::SeqCst), "the thread did not complete an abandoned shard");
        let mut pipe = Pipe::spawn(2, |items: Items<u32>| items.sum::<io::Result<u32>>());
        pipe.send(1).unwrap();
        pipe.send(2).unwrap();
        assert_eq!(pipe.finish().unwrap(), 3);
    }
}
