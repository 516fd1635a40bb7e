//! Kick-Ass mode vs TCP mode at the router (paper II-C2).
//!
//! Queue above 50% of the buffer means unresponsive (TCP) traffic is
//! present: stop fragmenting so Kick-Ass endpoints fall back to TCP. Back
//! below the threshold, advertise again. A small hysteresis band (leave TCP
//! mode only below `off`, default 40%) keeps a queue hovering at 50% from
//! flapping the mode on every packet.
//!
//! Whose queue is it? The paper's rule exists to detect "excessive queuing
//! caused by non-Kick-Ass flows" (III-D1). Kick-Ass flows that arrive
//! together each start at the advertised rate and overshoot for about one
//! feedback delay; RCP's queue term then drains what they built within a few
//! RTTs, and sending them to TCP mode for it costs them the rate they were
//! about to get. So the queue must stay above the threshold for a `hold`
//! before TCP mode starts, unless the router sees traffic that is not Kick-
//! Ass's own (the caller says so: a share of the arriving bytes that no
//! router could mark, DF set or not full size, as every TCP stack with path
//! MTU discovery sends): then at once, the paper's rule.
//!
//! The mode ends below `off`, or when the caller sees that the traffic has
//! obeyed it (`leave`): Kick-Ass endpoints in TCP mode may keep a drop-tail
//! queue full for good, and return only when rates reach them again.

use crate::Nanos;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[serde(rename = "kickass")]
    KickAss,
    Tcp,
    /// Plain rate-limited drop-tail baseline: never advertises.
    DropTail,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::KickAss => "kickass",
            Mode::Tcp => "tcp",
            Mode::DropTail => "droptail",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ModeSwitch {
    on: f64,
    off: f64,
    tcp: bool,
    switches: u64,
    /// Since when the occupancy has been above `on` (outside TCP mode).
    above_since: Option<Nanos>,
}

impl ModeSwitch {
    /// Enter TCP mode above `on`, leave it below `off` (fractions of the
    /// buffer, `off <= on`).
    pub fn new(on: f64, off: f64) -> Self {
        ModeSwitch {
            on,
            off: off.min(on),
            tcp: false,
            switches: 0,
            above_since: None,
        }
    }

    /// Since when the occupancy has been above `on` outside TCP mode.
    pub fn above_since(&self) -> Option<Nanos> {
        self.above_since
    }

    /// Feed the current occupancy at `now`; TCP mode starts once it has been
    /// above `on` for `hold` (0: at once). Returns whether TCP mode is on.
    pub fn update(&mut self, now: Nanos, occupancy: f64, hold: Nanos) -> bool {
        let next = if self.tcp {
            occupancy >= self.off
        } else if occupancy > self.on {
            let since = *self.above_since.get_or_insert(now);
            now.saturating_sub(since) >= hold
        } else {
            self.above_since = None;
            false
        };
        if !next && self.tcp {
            self.above_since = None;
        }
        if next != self.tcp {
            self.switches += 1;
            self.tcp = next;
        }
        self.tcp
    }

    pub fn tcp(&self) -> bool {
        self.tcp
    }

    /// Leave TCP mode now, whatever the queue (the caller knows why).
    pub fn leave(&mut self) -> bool {
        if self.tcp {
            self.tcp = false;
            self.switches += 1;
            self.above_since = None;
        }
        false
    }

    /// Number of mode changes so far (both directions).
    pub fn switches(&self) -> u64 {
        self.switches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hysteresis() {
        let mut m = ModeSwitch::new(0.5, 0.4);
        assert!(!m.update(0, 0.5, 0));
        assert!(m.update(0, 0.51, 0));
        assert!(m.update(0, 0.45, 0));
        assert!(m.update(0, 0.40, 0));
        assert!(!m.update(0, 0.39, 0));
        assert_eq!(m.switches(), 2);
        let mut plain = ModeSwitch::new(0.5, 0.5);
        assert!(plain.update(0, 0.6, 0));
        assert!(!plain.update(0, 0.49, 0));
    }

    #[test]
    fn hold_asks_for_a_queue_that_stays_up() {
        let mut m = ModeSwitch::new(0.5, 0.4);
        let hold = 200;
        // Above for less than the hold, then below: never TCP mode.
        assert!(!m.update(0, 0.9, hold));
        assert!(!m.update(199, 0.9, hold));
        assert!(!m.update(250, 0.3, hold));
        // The clock restarts with the next excursion.
        assert!(!m.update(300, 0.6, hold));
        assert!(!m.update(450, 0.7, hold));
        assert!(m.update(500, 0.7, hold));
        assert_eq!(m.switches(), 1);
        // Leaving is immediate below `off`, and the next entry waits again.
        assert!(m.update(600, 0.45, hold));
        assert!(!m.update(700, 0.39, hold));
        assert!(!m.update(710, 0.8, hold));
        assert!(m.update(910, 0.8, hold));
        assert_eq!(m.switches(), 3);
    }
}
