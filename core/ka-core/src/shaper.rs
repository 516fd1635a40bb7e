//! Drop-tail FIFO and the virtual-clock pacer that serves it at exactly the
//! link capacity (`next_tx += len / C`, as CAKE does). Never reorders.

use std::collections::VecDeque;

use crate::units::Limit;
use crate::Nanos;

/// A FIFO that refuses packets beyond its limit (packets or bytes).
#[derive(Debug)]
pub struct DropTail<P> {
    items: VecDeque<(P, usize)>,
    bytes: usize,
    limit: Limit,
}

impl<P> DropTail<P> {
    pub fn new(limit: Limit) -> Self {
        let cap = match limit {
            Limit::Packets(n) => n.min(1 << 16),
            Limit::Bytes(b) => (b / 1500).min(1 << 16),
        };
        DropTail {
            items: VecDeque::with_capacity(cap),
            bytes: 0,
            limit,
        }
    }

    /// Append, or hand the packet back when it does not fit.
    pub fn push(&mut self, p: P, len: usize) -> Result<(), P> {
        let fits = match self.limit {
            Limit::Packets(n) => self.items.len() < n,
            Limit::Bytes(b) => self.bytes + len <= b,
        };
        if !fits {
            return Err(p);
        }
        self.bytes += len;
        self.items.push_back((p, len));
        Ok(())
    }

    pub fn pop(&mut self) -> Option<(P, usize)> {
        let (p, len) = self.items.pop_front()?;
        self.bytes -= len;
        Some((p, len))
    }

    pub fn front_len(&self) -> Option<usize> {
        self.items.front().map(|(_, l)| *l)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Fill level in [0, 1] in the limit's own unit.
    pub fn occupancy(&self) -> f64 {
        match self.limit {
            Limit::Packets(n) => self.items.len() as f64 / n as f64,
            Limit::Bytes(b) => self.bytes as f64 / b as f64,
        }
    }
}

/// Virtual-clock pacer: the head of the queue may leave when `next_tx <=
/// now`; each departure pushes `next_tx` by its serialization time.
///
/// Timers are coarse, so the shell may wake late. The lateness is paid back
/// (the clock advances from `next_tx`, not from `now`), which keeps the
/// long-run rate exact, but at most `max_burst` of it, so a process that
/// was descheduled for a long time does not flood the next hop. An idle
/// link accumulates no credit at all: see [`VirtualClock::on_arrival_to_idle`].
#[derive(Debug, Clone)]
pub struct VirtualClock {
    ns_per_byte: f64,
    next_tx: f64,
    max_burst: f64,
}

impl VirtualClock {
    pub fn new(rate_bps: f64, max_burst: Nanos) -> Self {
        VirtualClock {
            ns_per_byte: 8e9 / rate_bps,
            next_tx: 0.0,
            max_burst: max_burst as f64,
        }
    }

    pub fn set_rate(&mut self, rate_bps: f64) {
        self.ns_per_byte = 8e9 / rate_bps;
    }

    /// Earliest time the head may leave.
    pub fn next_tx(&self) -> Nanos {
        self.next_tx.ceil() as Nanos
    }

    pub fn ready(&self, now: Nanos) -> bool {
        self.next_tx <= now as f64
    }

    /// A packet arrived to an empty queue: it may leave now, not earlier
    /// (no credit from idle time).
    pub fn on_arrival_to_idle(&mut self, now: Nanos) {
        if self.next_tx < now as f64 {
            self.next_tx = now as f64;
        }
    }

    /// `bytes` left at `now`.
    pub fn on_departure(&mut self, now: Nanos, bytes: usize) {
        let floor = now as f64 - self.max_burst;
        if self.next_tx < floor {
            self.next_tx = floor;
        }
        self.next_tx += bytes as f64 * self.ns_per_byte;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_tail_packets_and_bytes() {
        let mut q = DropTail::new(Limit::Packets(2));
        assert!(q.push(1, 1500).is_ok());
        assert!(q.push(2, 1500).is_ok());
        assert_eq!(q.push(3, 10), Err(3));
        assert_eq!(q.occupancy(), 1.0);
        assert_eq!(q.pop(), Some((1, 1500)));
        let mut b = DropTail::new(Limit::Bytes(3000));
        assert!(b.push(1, 1500).is_ok());
        assert!(b.push(2, 1500).is_ok());
        assert_eq!(b.push(3, 1), Err(3));
        assert_eq!(b.bytes(), 3000);
    }

    #[test]
    fn paces_exactly_even_when_woken_late() {
        // 12 Mbit/s: 1500 bytes take exactly 1 ms.
        let mut c = VirtualClock::new(12e6, 1_000_000);
        c.on_arrival_to_idle(0);
        let mut now: Nanos = 0;
        let mut sent = 0usize;
        // The "shell" wakes 300 us late every time: the long-run rate holds.
        while now < 1_000_000_000 {
            while c.ready(now) {
                c.on_departure(now, 1500);
                sent += 1;
            }
            now = c.next_tx() + 300_000;
        }
        assert!((999..=1001).contains(&sent), "{sent}");
    }

    #[test]
    fn no_credit_from_idle() {
        let mut c = VirtualClock::new(12e6, 1_000_000);
        c.on_arrival_to_idle(0);
        c.on_departure(0, 1500);
        // Idle for a second, then two packets: the second waits 1 ms.
        c.on_arrival_to_idle(1_000_000_000);
        assert!(c.ready(1_000_000_000));
        c.on_departure(1_000_000_000, 1500);
        assert!(!c.ready(1_000_000_000));
        assert_eq!(c.next_tx(), 1_001_000_000);
    }
}
