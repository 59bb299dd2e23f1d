//! A single-producer, single-consumer ring between two stage workers, driven by two CPU
//! timelines instead of a lock: `filled` counts items published, `freed` counts items the
//! consumer is done with.
//!
//! Item `i` (0, 1, 2, ...) lives in slot `i % depth`. The producer may write slot `i % depth`
//! once `freed >= i + 1 - depth` (the item that used the slot before has been released), and
//! publishes item `i` by signalling `filled = i + 1`. The consumer may read item `i` once
//! `filled >= i + 1` and gives the slot back by signalling `freed = i + 1`. Alongside each slot
//! the ring can own a unified buffer (the stage's output tensor), so the payload that moves
//! is only the small per-item record `T` (frame number, timestamps); the tensor stays where
//! the producing engine wrote it.
//!
//! Ending: the producer's [`Producer::close`] records how many items exist and signals
//! `filled` to `u64::MAX`, which wakes a waiting consumer that then sees the end. A consumer
//! that stops early calls [`Consumer::abandon`], which signals `freed` to `u64::MAX` so a
//! waiting producer wakes and learns nobody reads any more. Dropping either half does the
//! same, so a stage that fails or panics never leaves its neighbour waiting.
//!
//! # Invariants
//! - Exactly one [`Producer`] and one [`Consumer`] exist per ring (both are `!Clone`, and
//!   every method takes `&mut self`), so slot `i % depth` is touched by one side at a time:
//!   the producer between its reserve and publish of `i`, the consumer between its receive
//!   and release of `i`. The timelines' `SeqCst` signal and wait order those accesses.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sync_timeline::{CpuTimeline, Timeline};
use uvm_alloc::UnifiedBuffer;

/// How long one timeline wait lasts before the stop flag is checked again.
const STOP_POLL: Duration = Duration::from_millis(50);

/// What ended a wait other than the item becoming available.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The other side closed (producer: the consumer abandoned the ring).
    Closed,
    /// The run's stop flag was raised (Ctrl-C, or another stage failed).
    Stopped,
}

struct Shared<T> {
    name: &'static str,
    slots: Box<[UnsafeCell<Option<T>>]>,
    buffers: Vec<Arc<UnifiedBuffer>>,
    filled: CpuTimeline,
    freed: CpuTimeline,
    /// Items produced, once closed (`u64::MAX` while open).
    end: AtomicU64,
    abandoned: AtomicBool,
    stop: Arc<AtomicBool>,
}

// SAFETY: a slot is accessed by exactly one side at a time (the module invariant: the producer
// only between reserve and publish of an item, the consumer only between receive and release,
// ordered by the timelines' SeqCst operations), so sharing the ring between the two threads is
// sound whenever the payload itself may move between threads.
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// Waits until `timeline` reaches `value`, checking the stop flag every [`STOP_POLL`].
    fn wait(&self, timeline: &CpuTimeline, value: u64) -> Result<(), Ended> {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(Ended::Stopped);
            }
            if timeline.wait(value, STOP_POLL).is_ok() {
                return Ok(());
            }
        }
    }
}

/// The right to write and publish one item: made only by [`Producer::reserve`], spent by
/// [`Producer::publish`], so safe code cannot publish into a slot the consumer may still read.
#[must_use = "a reservation is published with Producer::publish"]
pub struct Reservation<T> {
    /// The ring it was made on (held, so its identity cannot be reused by another ring).
    ring: Arc<Shared<T>>,
    index: u64,
    buffer: Option<Arc<UnifiedBuffer>>,
}

impl<T> std::fmt::Debug for Reservation<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("ring", &self.ring.name)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl<T> Reservation<T> {
    /// The slot's buffer, for the producer to write (rings without buffers have none).
    pub fn buffer(&self) -> Option<&Arc<UnifiedBuffer>> {
        self.buffer.as_ref()
    }
}

/// What [`Consumer::receive`] hands over: the item's record and its slot's buffer (when the
/// ring has buffers).
pub type Received<T> = (T, Option<Arc<UnifiedBuffer>>);

/// The writing half of a ring.
pub struct Producer<T> {
    shared: Arc<Shared<T>>,
    next: u64,
}

/// The reading half of a ring.
pub struct Consumer<T> {
    shared: Arc<Shared<T>>,
    next: u64,
}

impl<T> std::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("ring", &self.shared.name)
            .field("next", &self.next)
            .finish()
    }
}

impl<T> std::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("ring", &self.shared.name)
            .field("next", &self.next)
            .finish()
    }
}

/// A ring of `depth` slots named `name` (for traces and errors), each with the unified buffer
/// of the same index in `buffers` (none, or exactly `depth`). `stop` ends every wait when raised.
pub fn ring<T: Send>(
    name: &'static str,
    depth: usize,
    buffers: Vec<Arc<UnifiedBuffer>>,
    stop: Arc<AtomicBool>,
) -> (Producer<T>, Consumer<T>) {
    let depth = depth.max(1);
    assert!(
        buffers.is_empty() || buffers.len() == depth,
        "a ring's buffers are one per slot"
    );
    let shared = Arc::new(Shared {
        name,
        slots: (0..depth).map(|_| UnsafeCell::new(None)).collect(),
        buffers,
        filled: CpuTimeline::new(0),
        freed: CpuTimeline::new(0),
        end: AtomicU64::new(u64::MAX),
        abandoned: AtomicBool::new(false),
        stop,
    });
    (
        Producer {
            shared: Arc::clone(&shared),
            next: 0,
        },
        Consumer { shared, next: 0 },
    )
}

impl<T> Producer<T> {
    /// The ring's name.
    pub fn name(&self) -> &'static str {
        self.shared.name
    }

    /// The index the next published item gets.
    pub fn next_index(&self) -> u64 {
        self.next
    }

    fn free_value(&self) -> u64 {
        (self.next + 1).saturating_sub(self.shared.slots.len() as u64)
    }

    /// Whether the next item's slot is free now (never blocks): how a live source decides to
    /// drop a frame instead of waiting.
    pub fn has_room(&self) -> bool {
        self.shared.freed.current() >= self.free_value()
    }

    /// Waits until the next item's slot is free and hands it over as a [`Reservation`] (with
    /// the slot's buffer, if the ring has buffers): the producer may now write it, and
    /// publishes it by giving the reservation back to [`Producer::publish`].
    pub fn reserve(&mut self) -> Result<Reservation<T>, Ended> {
        self.shared.wait(&self.shared.freed, self.free_value())?;
        if self.shared.abandoned.load(Ordering::SeqCst) {
            return Err(Ended::Closed);
        }
        let depth = self.shared.slots.len() as u64;
        Ok(Reservation {
            ring: Arc::clone(&self.shared),
            index: self.next,
            buffer: self
                .shared
                .buffers
                .get((self.next % depth) as usize)
                .cloned(),
        })
    }

    /// Publishes the reserved item with its record; returns the timeline value signalled (the
    /// item's index + 1).
    ///
    /// # Panics
    /// If `slot` was reserved on another ring, or is stale (an item was published since it
    /// was reserved): both are bugs in the caller, and publishing then could race the consumer.
    pub fn publish(&mut self, slot: Reservation<T>, record: T) -> u64 {
        assert!(
            Arc::ptr_eq(&slot.ring, &self.shared) && slot.index == self.next,
            "ring {}: publish with a reservation of another ring or item",
            self.shared.name
        );
        let cell = &self.shared.slots[(self.next % self.shared.slots.len() as u64) as usize];
        // SAFETY: `slot` is this ring's reservation of item `next` (checked above; it cannot be
        // made outside `reserve`), so `reserve` saw `freed >= next + 1 - depth`: the consumer
        // released the item that used this slot before and will not read it until `filled`
        // reaches `next + 1`, which happens below; we are the only producer.
        unsafe { *cell.get() = Some(record) };
        self.next += 1;
        // Values only grow and this side is the only signaller of `filled` (below `MAX`).
        let _ = self.shared.filled.signal(self.next);
        self.next
    }

    /// Ends the stream: the consumer receives every published item, then `None`.
    pub fn close(&mut self) {
        self.shared.end.fetch_min(self.next, Ordering::SeqCst);
        let _ = self.shared.filled.signal(u64::MAX);
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<T> Consumer<T> {
    /// The ring's name.
    pub fn name(&self) -> &'static str {
        self.shared.name
    }

    /// Waits for the next item; `Ok(None)` at the end of the stream. The item's buffer stays
    /// the consumer's to read until [`Consumer::release`].
    pub fn receive(&mut self) -> Result<Option<Received<T>>, Ended> {
        self.shared.wait(&self.shared.filled, self.next + 1)?;
        if self.next >= self.shared.end.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let depth = self.shared.slots.len() as u64;
        let slot = &self.shared.slots[(self.next % depth) as usize];
        // SAFETY: `filled >= next + 1` and `next < end`, so the producer published this item
        // and will not touch the slot again until we signal `freed = next + 1` in `release`;
        // we are the only consumer.
        let record = unsafe { (*slot.get()).take() };
        let buffer = self
            .shared
            .buffers
            .get((self.next % depth) as usize)
            .cloned();
        Ok(record.map(|r| (r, buffer)))
    }

    /// Whether an item newer than the one last received is already published (a live
    /// consumer then skips to it). Call between [`Consumer::receive`] and
    /// [`Consumer::release`].
    pub fn newer_available(&self) -> bool {
        let published = self
            .shared
            .filled
            .current()
            .min(self.shared.end.load(Ordering::SeqCst));
        published > self.next + 1
    }

    /// Gives the last received item's slot back to the producer.
    pub fn release(&mut self) {
        self.next += 1;
        let _ = self.shared.freed.signal(self.next);
    }

    /// Stops reading: a producer waiting for room wakes and ends.
    pub fn abandon(&mut self) {
        self.shared.abandoned.store(true, Ordering::SeqCst);
        let _ = self.shared.freed.signal(u64::MAX);
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.abandon();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_arrive_in_order_and_the_producer_waits_for_room() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u64>("test", 2, Vec::new(), stop);
        let producer = std::thread::spawn(move || {
            for i in 0..100 {
                let slot = tx.reserve().unwrap();
                tx.publish(slot, i);
            }
            tx.close();
        });
        let mut got = Vec::new();
        while let Some((v, _)) = rx.receive().unwrap() {
            got.push(v);
            rx.release();
        }
        producer.join().unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_full_ring_has_no_room_until_the_consumer_releases() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8>("test", 1, Vec::new(), stop);
        assert!(tx.has_room());
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 7);
        assert!(!tx.has_room());
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(7));
        assert!(!tx.has_room(), "the slot is the consumer's until release");
        rx.release();
        assert!(tx.has_room());
    }

    #[test]
    fn abandoning_wakes_a_waiting_producer_and_stop_wakes_a_waiting_consumer() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8>("test", 1, Vec::new(), Arc::clone(&stop));
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 1);
        let waiter = std::thread::spawn(move || tx.reserve().map(|_| ()));
        std::thread::sleep(Duration::from_millis(20));
        rx.abandon();
        assert_eq!(waiter.join().unwrap(), Err(Ended::Closed));

        let (_tx2, mut rx2) = ring::<u8>("test", 1, Vec::new(), Arc::clone(&stop));
        let waiter = std::thread::spawn(move || rx2.receive().map(|r| r.map(|(v, _)| v)));
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::SeqCst);
        assert_eq!(waiter.join().unwrap(), Err(Ended::Stopped));
    }

    #[test]
    fn dropping_the_producer_ends_the_stream_after_its_items() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8>("test", 3, Vec::new(), stop);
        for i in 0..3 {
            let slot = tx.reserve().unwrap();
            tx.publish(slot, i);
        }
        drop(tx);
        for i in 0..3 {
            assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(i));
            rx.release();
        }
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), None);
    }

    /// A reservation is spent by its publish: a second one for the same item (reserved before
    /// the first was published) is stale and refused, never written into a slot the consumer
    /// may be reading.
    #[test]
    #[should_panic(expected = "reservation of another ring or item")]
    fn a_stale_reservation_cannot_publish() {
        let (mut tx, _rx) = ring::<u32>("r", 2, Vec::new(), Arc::new(AtomicBool::new(false)));
        let first = tx.reserve().unwrap();
        let second = tx.reserve().unwrap();
        tx.publish(first, 1);
        tx.publish(second, 2);
    }
}
