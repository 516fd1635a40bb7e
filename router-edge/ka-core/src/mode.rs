//! Kick-Ass mode vs TCP mode at the router (paper II-C2).
//!
//! Queue above 50% of the buffer means unresponsive (TCP) traffic is
//! present: stop fragmenting so Kick-Ass endpoints fall back to TCP. Back
//! below the threshold, advertise again. A small hysteresis band (leave TCP
//! mode only below `off`, default 40%) keeps a queue hovering at 50% from
//! flapping the mode on every packet.

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
        }
    }

    /// Feed the current occupancy; returns whether TCP mode is on.
    pub fn update(&mut self, occupancy: f64) -> bool {
        let next = if self.tcp {
            occupancy >= self.off
        } else {
            occupancy > self.on
        };
        if next != self.tcp {
            self.switches += 1;
            self.tcp = next;
        }
        self.tcp
    }

    pub fn tcp(&self) -> bool {
        self.tcp
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
        assert!(!m.update(0.5));
        assert!(m.update(0.51));
        assert!(m.update(0.45));
        assert!(m.update(0.40));
        assert!(!m.update(0.39));
        assert_eq!(m.switches(), 2);
        let mut plain = ModeSwitch::new(0.5, 0.5);
        assert!(plain.update(0.6));
        assert!(!plain.update(0.49));
    }
}
