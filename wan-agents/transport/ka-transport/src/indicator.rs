//! The endpoint's RTT indicator clock (paper II-B): "Every 100 ms, the
//! endpoint sends a packet of an indicator size". One clock per endpoint
//! and destination, not per flow: a sender with nine flows to one receiver
//! still sends ten indicators a second, and each is carried by one of its
//! flows ([`Connection::poll_rtt_indicator`]: a data segment cut to the
//! indicator's length where one is due, so it costs no extra bytes).

use ka_core::Nanos;

use crate::connection::{Connection, Transmit};

/// Paper II-B's interval.
pub const RTT_INDICATOR_INTERVAL: Nanos = 100_000_000;

#[derive(Debug, Clone)]
pub struct RttIndicatorClock {
    interval: Nanos,
    /// When the next indicator is due; `None`: due now (none sent yet).
    next: Option<Nanos>,
    sent: u64,
    /// Where the next offer starts, so the flows take turns carrying it.
    turn: usize,
}

impl Default for RttIndicatorClock {
    fn default() -> Self {
        RttIndicatorClock::new(RTT_INDICATOR_INTERVAL)
    }
}

impl RttIndicatorClock {
    pub fn new(interval: Nanos) -> Self {
        RttIndicatorClock {
            interval: interval.max(1),
            next: None,
            sent: 0,
            turn: 0,
        }
    }

    pub fn is_due(&self, now: Nanos) -> bool {
        self.next.is_none_or(|t| now >= t)
    }

    /// When the next indicator is due (`None`: due whenever a flow can
    /// carry it).
    pub fn next_due(&self) -> Option<Nanos> {
        self.next
    }

    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// When [`poll`](Self::poll) next has something to do for `conns`: the
    /// due time, or later when every flow's pacer holds the indicator back;
    /// `None` when no flow can carry one.
    pub fn poll_timeout<'a, I>(&self, conns: I) -> Option<Nanos>
    where
        I: IntoIterator<Item = &'a Connection>,
    {
        let ready = conns
            .into_iter()
            .filter_map(|c| c.rtt_indicator_ready_at())
            .min()?;
        Some(self.next.map_or(ready, |t| t.max(ready)))
    }

    /// One indicator left at `now`: the next is due one interval after the
    /// last one was due (no drift), but never in the past.
    pub fn on_sent(&mut self, now: Nanos) {
        self.sent += 1;
        let mut next = self.next.unwrap_or(now).saturating_add(self.interval);
        if next <= now {
            next = now.saturating_add(self.interval);
        }
        self.next = Some(next);
    }

    /// If the indicator is due, offer it to `conns` (the endpoint's flows
    /// to this destination) in turn; the first that can send it now does.
    /// Returns which flow sent it, and the datagram.
    pub fn poll<'a, I>(
        &mut self,
        now: Nanos,
        conns: I,
        buf: &mut Vec<u8>,
    ) -> Option<(usize, Transmit)>
    where
        I: IntoIterator<Item = &'a mut Connection>,
    {
        if !self.is_due(now) {
            return None;
        }
        let mut conns: Vec<&mut Connection> = conns.into_iter().collect();
        let n = conns.len();
        for k in 0..n {
            let i = (self.turn + k) % n;
            if let Some(t) = conns[i].poll_rtt_indicator(now, buf) {
                self.on_sent(now);
                self.turn = (i + 1) % n.max(1);
                return Some((i, t));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_interval_after_the_last_due_time_without_drift() {
        let mut c = RttIndicatorClock::default();
        assert!(c.is_due(0));
        c.on_sent(5);
        assert_eq!(c.next_due(), Some(100_000_005));
        assert!(!c.is_due(100_000_004));
        // Sent a little late: the next one keeps the grid.
        c.on_sent(100_000_300);
        assert_eq!(c.next_due(), Some(200_000_005));
        // Far behind (nobody could carry it): no burst to catch up.
        c.on_sent(900_000_000);
        assert_eq!(c.next_due(), Some(1_000_000_000));
        assert_eq!(c.sent(), 3);
    }
}
