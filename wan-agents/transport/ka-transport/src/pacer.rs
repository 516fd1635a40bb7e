//! A token-bucket pacer on a virtual clock.
//!
//! Kick-Ass mode *is* pacing: the sender emits IP bytes at exactly the
//! advertised rate (paper IV-A: "a modified version of MultiTCP to pace
//! outgoing packets"). The router measures its input rate in IP bytes at
//! enqueue, so the pacer counts IP bytes too. Tokens accumulate at the rate
//! up to a burst of about 2 ms (at least 2, at most 64 full-size packets),
//! as quinn does: the shell's timers are not finer than that, and a short
//! burst costs nothing at a bottleneck that is served at the same rate.

use ka_core::Nanos;

/// Burst the bucket holds, in time at the current rate.
pub const DEFAULT_BURST_INTERVAL: Nanos = 2_000_000;
pub const MIN_BURST_PACKETS: usize = 2;
pub const MAX_BURST_PACKETS: usize = 64;
/// Tolerance for float rounding so a wake-up at the computed deadline
/// always finds enough tokens (no 1-ns spin).
const EPSILON_BYTES: f64 = 0.5;

#[derive(Debug, Clone)]
pub struct Pacer {
    /// Bytes per second; `None` = unpaced.
    rate: Option<f64>,
    tokens: f64,
    capacity: f64,
    last: Nanos,
    burst_interval: Nanos,
    mtu: usize,
}

impl Pacer {
    /// `mtu`: the largest datagram (IP bytes) the burst must hold.
    pub fn new(burst_interval: Nanos, mtu: usize) -> Self {
        let capacity = (MIN_BURST_PACKETS * mtu) as f64;
        Pacer {
            rate: None,
            tokens: capacity,
            capacity,
            last: 0,
            burst_interval,
            mtu,
        }
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    fn tokens_at(&self, now: Nanos) -> f64 {
        match self.rate {
            Some(rate) => {
                let dt = now.saturating_sub(self.last) as f64 / 1e9;
                (self.tokens + rate * dt).min(self.capacity)
            }
            None => self.tokens,
        }
    }

    fn refill(&mut self, now: Nanos) {
        self.tokens = self.tokens_at(now);
        self.last = self.last.max(now);
    }

    /// Change the rate (bytes/s, `None` = unpaced). Tokens earned so far at
    /// the old rate are kept, clipped to the new burst.
    pub fn set_rate(&mut self, now: Nanos, rate: Option<f64>) {
        self.refill(now);
        let rate = rate.filter(|r| r.is_finite() && *r > 0.0);
        self.rate = rate;
        self.capacity = match rate {
            Some(r) => (r * self.burst_interval as f64 / 1e9).clamp(
                (MIN_BURST_PACKETS * self.mtu) as f64,
                (MAX_BURST_PACKETS * self.mtu) as f64,
            ),
            None => (MIN_BURST_PACKETS * self.mtu) as f64,
        };
        self.tokens = self.tokens.min(self.capacity);
    }

    /// `None` when `len` bytes may leave at `now`, else the time they may.
    pub fn delay(&self, now: Nanos, len: usize) -> Option<Nanos> {
        let rate = self.rate?;
        let now = now.max(self.last);
        let need = len as f64 - self.tokens_at(now);
        if need <= EPSILON_BYTES {
            return None;
        }
        let wait = (need / rate * 1e9).ceil() as Nanos;
        Some(now + wait.max(1))
    }

    /// When `len` bytes may leave, judged from the last update (for a
    /// `poll_timeout` that is not told the time): `None` if unpaced.
    pub fn ready_at(&self, len: usize) -> Option<Nanos> {
        self.rate?;
        Some(self.delay(self.last, len).unwrap_or(self.last))
    }

    /// Account for `len` bytes that left at `now`.
    pub fn on_sent(&mut self, now: Nanos, len: usize) {
        self.refill(now);
        if self.rate.is_some() {
            self.tokens -= len as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paces_at_exactly_the_rate_after_the_burst() {
        let mut p = Pacer::new(DEFAULT_BURST_INTERVAL, 1500);
        // 10 Mbit/s = 1.25e6 B/s: 2 ms is 2500 B, so the burst is 2 packets.
        p.set_rate(0, Some(1.25e6));
        assert_eq!(p.capacity(), 3000.0);
        let mut now = 0;
        let mut sent = 0u64;
        let mut times = Vec::new();
        while sent < 1000 {
            match p.delay(now, 1500) {
                None => {
                    p.on_sent(now, 1500);
                    times.push(now);
                    sent += 1;
                }
                Some(t) => {
                    assert!(t > now);
                    now = t;
                }
            }
        }
        // Two at once, then one every 1.2 ms: 1000 packets in 998 * 1.2 ms.
        assert_eq!(times[0], 0);
        assert_eq!(times[1], 0);
        let span = (times[999] - times[1]) as f64 / 1e6;
        assert!((span - 998.0 * 1.2).abs() < 0.01, "{span}");
    }

    #[test]
    fn unpaced_and_rate_changes() {
        let mut p = Pacer::new(DEFAULT_BURST_INTERVAL, 1500);
        assert_eq!(p.delay(0, 1500), None);
        p.set_rate(0, Some(f64::NAN));
        assert_eq!(p.rate(), None);
        p.set_rate(0, Some(1e9));
        // 2 ms at 1 GB/s is 2 MB: clipped to 64 packets.
        assert_eq!(p.capacity(), 64.0 * 1500.0);
        p.set_rate(0, Some(1000.0));
        p.on_sent(0, 3000);
        // Empty bucket: the next 1500 bytes take 1.5 s.
        assert_eq!(p.delay(0, 1500), Some(1_500_000_000));
    }
}
