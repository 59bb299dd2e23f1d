//! A single-producer, single-consumer ring between two stage workers, driven by two CPU
//! timelines instead of a lock: `filled` counts items published, `freed` counts items the
//! consumer is done with. This is how stages run ahead of each other: each waits only on a
//! timeline, for its input or for room.
//!
//! Item `i` (0, 1, 2, ...) lives in slot `i % depth`. The producer may write slot `i % depth`
//! once `freed >= i + 1 - depth` (the item that used the slot before has been released), and
//! publishes item `i` by signalling `filled = i + 1`. The consumer may read item `i` once
//! `filled >= i + 1` and gives the slot back by signalling `freed = i + 1`. Alongside each slot
//! the ring can own a buffer `B` (in the pipeline, the stage's output tensor in a unified
//! buffer), so the payload that moves is only the small per-item record `T` (frame number,
//! timestamps); the tensor stays where the producing engine wrote it.
//!
//! Live rings ([`live_ring`]): latest wins. The producer never waits for the consumer: it
//! writes into a free slot or, when there is none, over the oldest item published and not yet
//! received (dropping it); the consumer always takes the newest published item and drops the
//! older ones. A slow stage that becomes free therefore takes the newest frame ready upstream,
//! never one that waited in the ring behind it. Slot states (free, writing, ready, reading)
//! are kept under a mutex held only to change them; waits are still timeline waits.
//!
//! Device readers: a consumer that hands a slot's buffer to device work and moves on before
//! that work is done releases the slot with [`Consumer::release_after`] and the timeline value
//! that says the work has finished. The producer, reserving that slot again, waits for the
//! value (backpressure, like waiting for `freed`); nobody blocks on each item to find out.
//!
//! Ending: the producer's [`Producer::close`] records how many items exist and signals
//! `filled` to `u64::MAX`, which wakes a waiting consumer that then sees the end. A consumer
//! that stops early calls [`Consumer::abandon`], which signals `freed` to `u64::MAX` so a
//! waiting producer wakes and learns nobody reads any more. Dropping either half does the
//! same, so a stage that fails or panics never leaves its neighbour waiting.
//!
//! # Invariants
//! - Exactly one [`Producer`] and one [`Consumer`] exist per ring (both are `!Clone`, and
//!   every method that touches a slot takes `&mut self`), so a slot is touched by one side at
//!   a time. In a lossless ring, slot `i % depth` is the producer's between its reserve and
//!   publish of `i` and the consumer's between its receive and release of `i`; the timelines'
//!   `SeqCst` signal and wait order those accesses. In a live ring, a slot's state says whose
//!   it is (writing: the producer's; reading: the consumer's; ready: nobody's until one side
//!   takes it under the mutex).
//! - A slot that device work still uses (a release after a device value, or in a live ring a
//!   ready item whose device write is pending) is not written again before that value.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::{CpuTimeline, Timeline};

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

/// Device work still reading a released slot's buffer: done once the timeline reaches the value.
type PendingRead = (Arc<dyn Timeline>, u64);

/// Where a live ring's slot is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Reserved by the producer.
    Writing,
    /// Published as the `n`-th item, not received.
    Ready(u64),
    /// Received by the consumer, not released.
    Reading,
}

/// A live ring's slot states and publish count.
#[derive(Debug)]
struct Live {
    states: Vec<SlotState>,
    published: u64,
}

struct Shared<T, B> {
    name: &'static str,
    slots: Box<[UnsafeCell<Option<T>>]>,
    /// Per slot, the device work that still reads it after its consumer released it.
    pending: Box<[std::sync::Mutex<Option<PendingRead>>]>,
    buffers: Vec<B>,
    filled: CpuTimeline,
    freed: CpuTimeline,
    /// Items produced, once closed (`u64::MAX` while open).
    end: AtomicU64,
    /// For a live ring, its slot states (see the module notes).
    live: Option<std::sync::Mutex<Live>>,
    /// Items a live ring dropped (replaced by a newer one before the consumer took them).
    dropped: AtomicU64,
    abandoned: AtomicBool,
    stop: Arc<AtomicBool>,
}

// SAFETY: a slot is accessed by exactly one side at a time (the module invariant: the producer
// only between reserve and publish of an item, the consumer only between receive and release,
// ordered by the timelines' SeqCst operations), so sharing the ring between the two threads is
// sound whenever the payload itself may move between threads.
unsafe impl<T: Send, B: Send + Sync> Sync for Shared<T, B> {}

impl<T, B> Shared<T, B> {
    /// Waits until `timeline` reaches `value`, checking the stop flag every [`STOP_POLL`].
    fn wait(&self, timeline: &dyn Timeline, value: u64) -> Result<(), Ended> {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(Ended::Stopped);
            }
            match timeline.wait(value, STOP_POLL) {
                Ok(()) => return Ok(()),
                Err(crate::Error::Timeout { .. }) => {}
                // A device timeline that fails (device lost) will not reach the value: the
                // ring ends, and the stage that owns the device reports the failure.
                Err(_) => return Err(Ended::Closed),
            }
        }
    }
}

/// The right to write and publish one item: made only by [`Producer::reserve`], spent by
/// [`Producer::publish`], so safe code cannot publish into a slot the consumer may still read.
#[must_use = "a reservation is published with Producer::publish"]
pub struct Reservation<T, B> {
    /// The ring it was made on (held, so its identity cannot be reused by another ring).
    ring: Arc<Shared<T, B>>,
    index: u64,
    /// The slot it writes.
    slot: usize,
    /// Set by `publish`; a live ring's slot goes back to free when a reservation is dropped
    /// unpublished.
    published: bool,
    buffer: Option<B>,
}

impl<T, B> std::fmt::Debug for Reservation<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("ring", &self.ring.name)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl<T, B> Drop for Reservation<T, B> {
    fn drop(&mut self) {
        if !self.published
            && self.ring.live.is_some()
            && let Ok(mut live) = self.ring.live()
            && live.states[self.slot] == SlotState::Writing
        {
            live.states[self.slot] = SlotState::Free;
        }
    }
}

impl<T, B> Reservation<T, B> {
    /// The slot's buffer, for the producer to write (rings without buffers have none).
    pub fn buffer(&self) -> Option<&B> {
        self.buffer.as_ref()
    }
}

/// What [`Consumer::receive`] hands over: the item's record and its slot's buffer (when the
/// ring has buffers).
pub type Received<T, B> = (T, Option<B>);

/// The writing half of a ring.
pub struct Producer<T, B> {
    shared: Arc<Shared<T, B>>,
    next: u64,
}

/// The reading half of a ring.
pub struct Consumer<T, B> {
    shared: Arc<Shared<T, B>>,
    next: u64,
    /// In a live ring, the slot last received.
    reading: Option<usize>,
}

impl<T, B> std::fmt::Debug for Producer<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("ring", &self.shared.name)
            .field("next", &self.next)
            .finish()
    }
}

impl<T, B> std::fmt::Debug for Consumer<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("ring", &self.shared.name)
            .field("next", &self.next)
            .finish()
    }
}

/// A ring of `depth` slots named `name` (for traces and errors), each with the buffer
/// of the same index in `buffers` (none, or exactly `depth`). `stop` ends every wait when raised.
/// Every item published is received, in order.
pub fn ring<T: Send, B>(
    name: &'static str,
    depth: usize,
    buffers: Vec<B>,
    stop: Arc<AtomicBool>,
) -> (Producer<T, B>, Consumer<T, B>) {
    make(name, depth, buffers, stop, false)
}

/// A latest-wins ring (see the module notes) of `slots` slots (at least 2: one the consumer
/// reads, one the producer writes; a third holds the newest item ready while both are busy).
pub fn live_ring<T: Send, B>(
    name: &'static str,
    slots: usize,
    buffers: Vec<B>,
    stop: Arc<AtomicBool>,
) -> (Producer<T, B>, Consumer<T, B>) {
    make(name, slots.max(2), buffers, stop, true)
}

fn make<T: Send, B>(
    name: &'static str,
    depth: usize,
    buffers: Vec<B>,
    stop: Arc<AtomicBool>,
    live: bool,
) -> (Producer<T, B>, Consumer<T, B>) {
    let depth = depth.max(1);
    assert!(
        buffers.is_empty() || buffers.len() == depth,
        "a ring's buffers are one per slot"
    );
    let shared = Arc::new(Shared {
        name,
        slots: (0..depth).map(|_| UnsafeCell::new(None)).collect(),
        pending: (0..depth).map(|_| std::sync::Mutex::new(None)).collect(),
        buffers,
        filled: CpuTimeline::new(0),
        freed: CpuTimeline::new(0),
        end: AtomicU64::new(u64::MAX),
        live: live.then(|| {
            std::sync::Mutex::new(Live {
                states: vec![SlotState::Free; depth],
                published: 0,
            })
        }),
        dropped: AtomicU64::new(0),
        abandoned: AtomicBool::new(false),
        stop,
    });
    (
        Producer {
            shared: Arc::clone(&shared),
            next: 0,
        },
        Consumer {
            shared,
            next: 0,
            reading: None,
        },
    )
}

impl<T, B> Shared<T, B> {
    /// Whether slot `slot`'s device reads (registered by `release_after`) are done; never
    /// blocks.
    fn device_done(&self, slot: usize) -> bool {
        match self.pending[slot].lock() {
            Ok(p) => p
                .as_ref()
                .is_none_or(|(t, v)| t.value().is_ok_and(|now| now >= *v)),
            Err(_) => false,
        }
    }

    /// Waits for slot `slot`'s device reads, and forgets them.
    fn wait_device(&self, slot: usize) -> Result<(), Ended> {
        let pending = self.pending[slot].lock().map_err(|_| Ended::Closed)?.take();
        if let Some((timeline, value)) = pending {
            self.wait(&*timeline, value)?;
        }
        Ok(())
    }

    /// Whether a live ring holds an item published and not yet received.
    fn live_has_ready(&self) -> bool {
        self.live()
            .is_ok_and(|live| live.states.iter().any(|s| matches!(s, SlotState::Ready(_))))
    }

    fn live(&self) -> Result<std::sync::MutexGuard<'_, Live>, Ended> {
        self.live
            .as_ref()
            .expect("a live ring")
            .lock()
            .map_err(|_| Ended::Closed)
    }

    /// Drops the record in `slot`, whose state the caller just took away from `Ready` under
    /// the live lock.
    fn drop_record(&self, slot: usize) {
        // SAFETY: the slot was `Ready` and the caller changed that under the live lock it
        // holds: the producer only touches a slot it holds as `Writing`, the consumer one it
        // holds as `Reading`, so nobody else accesses the cell now.
        unsafe { *self.slots[slot].get() = None };
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

impl<T, B: Clone> Producer<T, B> {
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

    /// Whether the next item's slot is free now (never blocks).
    pub fn has_room(&self) -> bool {
        if self.shared.live.is_some() {
            return true;
        }
        self.shared.freed.current() >= self.free_value()
            && self
                .shared
                .device_done((self.next % self.shared.slots.len() as u64) as usize)
    }

    /// Whether an item published is waiting, not yet received by the consumer (live rings; a
    /// lossless ring counts the item the consumer holds too).
    pub fn has_ready(&self) -> bool {
        match &self.shared.live {
            Some(_) => self.shared.live_has_ready(),
            None => self.next > self.shared.freed.current(),
        }
    }

    /// Items this ring dropped (live rings only): replaced by newer ones before they were
    /// received.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// A live ring's reservation: a free slot whose device reads are done, else the oldest
    /// ready item's (dropping it), else the wait for a free slot's device reads or for the
    /// consumer to release one.
    fn reserve_live(&mut self) -> Result<Reservation<T, B>, Ended> {
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                return Err(Ended::Stopped);
            }
            if self.shared.abandoned.load(Ordering::SeqCst) {
                return Err(Ended::Closed);
            }
            let freed = self.shared.freed.current();
            let mut busy = None;
            {
                let mut live = self.shared.live()?;
                let free = (0..live.states.len()).filter(|&i| live.states[i] == SlotState::Free);
                let mut chosen = None;
                for i in free {
                    if self.shared.device_done(i) {
                        chosen = Some(i);
                        break;
                    }
                    busy.get_or_insert(i);
                }
                if chosen.is_none() {
                    // The oldest ready item, unless the device is still writing it: replacing
                    // it then would only queue more device work behind it (frames in flight
                    // stay bounded by the ring's slots).
                    let oldest_ready = (0..live.states.len())
                        .filter_map(|i| match live.states[i] {
                            SlotState::Ready(n) => Some((n, i)),
                            _ => None,
                        })
                        .min();
                    if let Some((_, i)) = oldest_ready {
                        if self.shared.device_done(i) {
                            self.shared.drop_record(i);
                            chosen = Some(i);
                        } else {
                            busy.get_or_insert(i);
                        }
                    }
                }
                if let Some(i) = chosen {
                    live.states[i] = SlotState::Writing;
                    drop(live);
                    self.shared.wait_device(i)?;
                    return Ok(Reservation {
                        ring: Arc::clone(&self.shared),
                        index: self.next,
                        slot: i,
                        published: false,
                        buffer: self.shared.buffers.get(i).cloned(),
                    });
                }
            }
            match busy {
                // The slot's device reads finish soon; then it is the producer's.
                Some(i) => {
                    self.shared.wait_device(i)?;
                }
                // Every slot is being read or written: wait for the consumer to release one.
                None => self.shared.wait(&self.shared.freed, freed + 1)?,
            }
        }
    }

    /// Waits until the next item's slot is free and hands it over as a [`Reservation`] (with
    /// the slot's buffer, if the ring has buffers): the producer may now write it, and
    /// publishes it by giving the reservation back to [`Producer::publish`].
    pub fn reserve(&mut self) -> Result<Reservation<T, B>, Ended> {
        if self.shared.live.is_some() {
            return self.reserve_live();
        }
        self.shared.wait(&self.shared.freed, self.free_value())?;
        if self.shared.abandoned.load(Ordering::SeqCst) {
            return Err(Ended::Closed);
        }
        let depth = self.shared.slots.len() as u64;
        // The consumer released the slot; device work may still read its buffer.
        let slot = (self.next % depth) as usize;
        self.shared.wait_device(slot)?;
        Ok(Reservation {
            ring: Arc::clone(&self.shared),
            index: self.next,
            slot,
            published: false,
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
    pub fn publish(&mut self, slot: Reservation<T, B>, record: T) -> u64 {
        self.publish_written_after(slot, record, None)
    }

    /// Publishes the reserved item whose buffer device work is still writing until `written`
    /// (a timeline and value). In a live ring, the producer does not replace that item before
    /// the write is done, so device work queued per ring stays bounded by its slots; the
    /// consumer waits for the write itself (the value travels in `record`).
    pub fn publish_written_after(
        &mut self,
        mut slot: Reservation<T, B>,
        record: T,
        written: Option<(Arc<dyn Timeline>, u64)>,
    ) -> u64 {
        if self.shared.live.is_some()
            && written.is_some()
            && let Ok(mut pending) = self.shared.pending[slot.slot].lock()
        {
            *pending = written;
        }
        assert!(
            Arc::ptr_eq(&slot.ring, &self.shared) && slot.index == self.next,
            "ring {}: publish with a reservation of another ring or item",
            self.shared.name
        );
        let cell = &self.shared.slots[slot.slot];
        // SAFETY: `slot` is this ring's reservation of item `next` (checked above; it cannot be
        // made outside `reserve`). In a lossless ring, `reserve` saw `freed >= next + 1 -
        // depth`: the consumer released the item that used this slot before and will not read
        // it until `filled` reaches `next + 1`, which happens below. In a live ring the slot is
        // `Writing`, which only this producer touches, until the state change below. We are
        // the only producer.
        unsafe { *cell.get() = Some(record) };
        slot.published = true;
        self.next += 1;
        if self.shared.live.is_some()
            && let Ok(mut live) = self.shared.live()
        {
            live.published += 1;
            let n = live.published;
            live.states[slot.slot] = SlotState::Ready(n);
        }
        // Values only grow and this side is the only signaller of `filled` (below `MAX`).
        let _ = self.shared.filled.signal(self.next);
        self.next
    }
}

impl<T, B> Producer<T, B> {
    /// Ends the stream: the consumer receives every published item, then `None`.
    pub fn close(&mut self) {
        self.shared.end.fetch_min(self.next, Ordering::SeqCst);
        let _ = self.shared.filled.signal(u64::MAX);
    }
}

impl<T, B> Drop for Producer<T, B> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<T, B: Clone> Consumer<T, B> {
    /// The ring's name.
    pub fn name(&self) -> &'static str {
        self.shared.name
    }

    /// Waits for the next item; `Ok(None)` at the end of the stream. The item's buffer stays
    /// the consumer's to read until [`Consumer::release`].
    pub fn receive(&mut self) -> Result<Option<Received<T, B>>, Ended> {
        if self.shared.live.is_some() {
            return self.receive_live();
        }
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

    /// Whether [`Consumer::receive`] has an item for it now (never blocks; `false` at the end
    /// of the stream).
    pub fn has_ready(&self) -> bool {
        match &self.shared.live {
            Some(_) => self.shared.live_has_ready(),
            None => {
                self.shared.filled.current() > self.next
                    && self.next < self.shared.end.load(Ordering::SeqCst)
            }
        }
    }

    /// Whether the run's stop flag is raised (for a consumer waiting on something else).
    pub fn stopped(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }

    /// Items this ring dropped (live rings only).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// A live ring's receive: the newest ready item, the older ones dropped.
    fn receive_live(&mut self) -> Result<Option<Received<T, B>>, Ended> {
        loop {
            let filled = self.shared.filled.current();
            {
                let mut live = self.shared.live()?;
                let newest = (0..live.states.len())
                    .filter_map(|i| match live.states[i] {
                        SlotState::Ready(n) => Some((n, i)),
                        _ => None,
                    })
                    .max();
                if let Some((n, slot)) = newest {
                    for i in 0..live.states.len() {
                        if matches!(live.states[i], SlotState::Ready(m) if m < n) {
                            live.states[i] = SlotState::Free;
                            self.shared.drop_record(i);
                        }
                    }
                    live.states[slot] = SlotState::Reading;
                    drop(live);
                    self.reading = Some(slot);
                    // SAFETY: the slot is `Reading`, which only this consumer touches until it
                    // releases it; the producer wrote the record before marking it `Ready`.
                    let record = unsafe { (*self.shared.slots[slot].get()).take() };
                    let buffer = self.shared.buffers.get(slot).cloned();
                    return Ok(record.map(|r| (r, buffer)));
                }
                if self.shared.end.load(Ordering::SeqCst) != u64::MAX {
                    return Ok(None);
                }
            }
            self.shared.wait(&self.shared.filled, filled + 1)?;
        }
    }

    /// Gives the last received item's slot back to the producer once `timeline` reaches
    /// `value`: the device work that reads the slot's buffer, submitted and not waited for.
    pub fn release_after(&mut self, timeline: Arc<dyn Timeline>, value: u64) {
        let slot = self
            .reading
            .unwrap_or((self.next % self.shared.slots.len() as u64) as usize);
        if let Ok(mut pending) = self.shared.pending[slot].lock() {
            *pending = Some((timeline, value));
        }
        self.release();
    }

    /// Gives the last received item's slot back to the producer.
    pub fn release(&mut self) {
        if let Some(slot) = self.reading.take()
            && let Ok(mut live) = self.shared.live()
        {
            live.states[slot] = SlotState::Free;
        }
        self.next += 1;
        let _ = self.shared.freed.signal(self.next);
    }
}

impl<T, B> Consumer<T, B> {
    /// Stops reading: a producer waiting for room wakes and ends.
    pub fn abandon(&mut self) {
        self.shared.abandoned.store(true, Ordering::SeqCst);
        let _ = self.shared.freed.signal(u64::MAX);
    }
}

impl<T, B> Drop for Consumer<T, B> {
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
        let (mut tx, mut rx) = ring::<u64, ()>("test", 2, Vec::new(), stop);
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
        let (mut tx, mut rx) = ring::<u8, ()>("test", 1, Vec::new(), stop);
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
    fn the_consumer_sees_an_item_ready_without_waiting_and_none_at_the_end() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8, ()>("test", 2, Vec::new(), stop);
        assert!(!rx.has_ready());
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 7);
        assert!(rx.has_ready());
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(7));
        rx.release();
        assert!(!rx.has_ready(), "the one item was taken");
        tx.close();
        assert!(!rx.has_ready(), "the end of the stream is no item");
        assert!(rx.receive().unwrap().is_none());
    }

    #[test]
    fn abandoning_wakes_a_waiting_producer_and_stop_wakes_a_waiting_consumer() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8, ()>("test", 1, Vec::new(), Arc::clone(&stop));
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 1);
        let waiter = std::thread::spawn(move || tx.reserve().map(|_| ()));
        std::thread::sleep(Duration::from_millis(20));
        rx.abandon();
        assert_eq!(waiter.join().unwrap(), Err(Ended::Closed));

        let (_tx2, mut rx2) = ring::<u8, ()>("test", 1, Vec::new(), Arc::clone(&stop));
        let waiter = std::thread::spawn(move || rx2.receive().map(|r| r.map(|(v, _)| v)));
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::SeqCst);
        assert_eq!(waiter.join().unwrap(), Err(Ended::Stopped));
    }

    #[test]
    fn dropping_the_producer_ends_the_stream_after_its_items() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8, ()>("test", 3, Vec::new(), stop);
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

    #[test]
    fn a_slot_released_after_device_work_is_free_once_the_work_is_done() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = ring::<u8, ()>("test", 1, Vec::new(), stop);
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 1);
        rx.receive().unwrap();
        let gpu = Arc::new(CpuTimeline::new(0));
        rx.release_after(gpu.clone(), 5);
        assert!(!tx.has_room(), "the device still reads the slot");
        let signaller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            gpu.signal(5).unwrap();
        });
        // The producer waits for the device work, then gets the slot.
        let slot = tx.reserve().unwrap();
        signaller.join().unwrap();
        tx.publish(slot, 2);
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(2));
    }

    /// Latest wins: the producer never waits, the consumer takes the newest item, and every
    /// item replaced or skipped is counted as dropped.
    #[test]
    fn a_live_ring_hands_the_consumer_the_newest_item() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = live_ring::<u64, ()>("live", 3, Vec::new(), stop);
        // The consumer holds item 0 while the producer publishes 1..=9 without blocking.
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 0);
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(0));
        for i in 1..10 {
            let slot = tx.reserve().unwrap();
            tx.publish(slot, i);
        }
        rx.release();
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(9));
        rx.release();
        // 1..=8 were replaced or skipped.
        assert_eq!(rx.dropped(), 8);
        // An unpublished reservation gives its slot back.
        drop(tx.reserve().unwrap());
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 10);
        tx.close();
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(10));
        rx.release();
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), None);
    }

    #[test]
    fn a_live_producer_waits_for_device_reads_only_when_no_slot_is_free() {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut tx, mut rx) = live_ring::<u8, ()>("live", 2, Vec::new(), stop);
        let gpu = Arc::new(CpuTimeline::new(0));
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 1);
        rx.receive().unwrap();
        rx.release_after(gpu.clone(), 1);
        // Slot A is device-busy, slot B free: the producer takes B at once.
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 2);
        // B is ready (replaceable), A busy: the producer replaces B rather than wait.
        let slot = tx.reserve().unwrap();
        tx.publish(slot, 3);
        assert_eq!(rx.dropped(), 1);
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(3));
        // The consumer reads B; A is the only other slot and busy: the producer waits for it.
        let signaller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            gpu.signal(1).unwrap();
        });
        let slot = tx.reserve().unwrap();
        signaller.join().unwrap();
        tx.publish(slot, 4);
        rx.release();
        assert_eq!(rx.receive().unwrap().map(|(v, _)| v), Some(4));
    }

    /// A reservation is spent by its publish: a second one for the same item (reserved before
    /// the first was published) is stale and refused, never written into a slot the consumer
    /// may be reading.
    #[test]
    #[should_panic(expected = "reservation of another ring or item")]
    fn a_stale_reservation_cannot_publish() {
        let (mut tx, _rx) = ring::<u32, ()>("r", 2, Vec::new(), Arc::new(AtomicBool::new(false)));
        let first = tx.reserve().unwrap();
        let second = tx.reserve().unwrap();
        tx.publish(first, 1);
        tx.publish(second, 2);
    }
}
