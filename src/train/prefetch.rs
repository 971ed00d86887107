//! Reading the next step's data while this step computes: [`Prefetch`] runs a producer on a
//! background thread for the key the trainer will ask for next (the samples consumed before the
//! next step), at most one ahead.
//!
//! Order stays deterministic because the producer is a pure function of its key: an item is the
//! same whether it was prefetched or made on demand, and an item prefetched for another key (after
//! a resume, say) is dropped and the right one made in place. A producer's error travels with its
//! item and is returned by the [`Prefetch::get`] that asks for that key, so it surfaces at the
//! step that needs the data, never earlier.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};

/// What makes the item of a key.
pub type Producer<T> = Arc<dyn Fn(u64) -> Result<T> + Send + Sync>;

/// A one-ahead background producer of items by key; see the module docs.
pub struct Prefetch<T: Send + 'static> {
    produce: Producer<T>,
    requests: Option<SyncSender<u64>>,
    ready: Receiver<(u64, Result<T>)>,
    /// The key requested last and not yet received.
    pending: Option<u64>,
    worker: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Prefetch<T> {
    /// Starts the background thread (named `name`) that runs `produce`.
    pub fn new(name: &str, produce: Producer<T>) -> Result<Self> {
        let (requests, inbox) = sync_channel::<u64>(1);
        let (outbox, ready) = sync_channel(1);
        let p = produce.clone();
        let worker = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for key in inbox {
                    if outbox.send((key, p(key))).is_err() {
                        break; // the trainer is gone
                    }
                }
            })?;
        Ok(Self {
            produce,
            requests: Some(requests),
            ready,
            pending: None,
            worker: Some(worker),
        })
    }

    /// The item of `key` (prefetched when `key` was the last `next`, else made now), after
    /// asking the background thread for `next`'s.
    pub fn get(&mut self, key: u64, next: Option<u64>) -> Result<T> {
        let item = match self.pending.take() {
            Some(k) => {
                let (got, item) = self
                    .ready
                    .recv()
                    .map_err(|_| anyhow!("the data prefetch thread stopped"))?;
                debug_assert_eq!(got, k);
                if got == key {
                    item
                } else {
                    (self.produce)(key)
                }
            }
            None => (self.produce)(key),
        };
        if let (Some(n), Some(requests)) = (next, &self.requests) {
            requests
                .send(n)
                .map_err(|_| anyhow!("the data prefetch thread stopped"))?;
            self.pending = Some(n);
        }
        item
    }
}

impl<T: Send + 'static> Drop for Prefetch<T> {
    fn drop(&mut self) {
        self.requests = None; // ends the thread's loop once its current item is done
        if self.pending.take().is_some() {
            let _ = self.ready.recv();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::thread::ThreadId;

    use super::*;

    /// Items are the producer's for each key, the keys asked for next are made on the background
    /// thread, and a prefetched item for another key is replaced by the right one.
    #[test]
    fn items_match_their_keys_and_come_from_the_thread() {
        let threads: Arc<Mutex<Vec<(u64, ThreadId)>>> = Arc::default();
        let seen = threads.clone();
        let mut p = Prefetch::new(
            "prefetch-test",
            Arc::new(move |k: u64| {
                seen.lock().unwrap().push((k, std::thread::current().id()));
                Ok(k * 10)
            }),
        )
        .unwrap();
        assert_eq!(p.get(0, Some(1)).unwrap(), 0);
        assert_eq!(p.get(1, Some(2)).unwrap(), 10);
        assert_eq!(p.get(5, Some(6)).unwrap(), 50); // 2 was prefetched: dropped, 5 made here
        assert_eq!(p.get(6, None).unwrap(), 60);
        assert_eq!(p.get(7, None).unwrap(), 70);
        let me = std::thread::current().id();
        let log = threads.lock().unwrap().clone();
        let on_thread = |k| log.iter().any(|&(key, t)| key == k && t != me);
        let here = |k| log.iter().any(|&(key, t)| key == k && t == me);
        assert!(here(0) && on_thread(1) && on_thread(2) && here(5) && on_thread(6) && here(7));
    }

    /// A producer's error is returned for its own key only, by the call that asks for it.
    #[test]
    fn errors_surface_at_the_key_that_needs_them() {
        let mut p = Prefetch::new(
            "prefetch-test",
            Arc::new(|k: u64| {
                if k == 2 {
                    Err(anyhow!("no sample {k}"))
                } else {
                    Ok(k)
                }
            }),
        )
        .unwrap();
        assert_eq!(p.get(0, Some(1)).unwrap(), 0);
        assert_eq!(p.get(1, Some(2)).unwrap(), 1); // 2 is being made (and fails) meanwhile
        let e = p.get(2, Some(3)).unwrap_err().to_string();
        assert_eq!(e, "no sample 2");
        assert_eq!(p.get(3, None).unwrap(), 3);
    }

    /// Dropping with a request in flight waits for it and ends the thread.
    #[test]
    fn drop_with_a_pending_item_ends_the_thread() {
        let mut p = Prefetch::new(
            "prefetch-test",
            Arc::new(|k: u64| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                Ok(k)
            }),
        )
        .unwrap();
        p.get(0, Some(1)).unwrap();
        drop(p);
    }
}
