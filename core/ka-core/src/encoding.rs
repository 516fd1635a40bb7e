//! The paper's two length codes, byte-compatible with `kickass_core.rate`
//! and `kickass_core.rtt` (pinned by `core/vectors/*.json`).
//!
//! Rate: a router advertises R (bytes/ms) by cutting a full-size packet so
//! its leading fragment carries `L = 128 ln(R / 12.4392)` bytes of IP
//! payload, rounded down to a multiple of 8, 24 <= L <= 1480.
//! RTT: endpoints send DF packets of IP length 600..611; 600 + k stands for
//! RTTs in [2^k, 2^(k+1)) ms and the router reads the midpoint.

pub const RATE_SCALE_BYTES_PER_MS: f64 = 12.4392;
pub const LENGTH_SCALE: f64 = 128.0;
/// 24 bytes keep the whole TCP/UDP header inside the leading fragment.
pub const MIN_LEADING_FRAGMENT_LEN: usize = 24;
/// A 1500-byte packet has 1480 bytes of payload: nothing longer can be cut.
pub const MAX_LEADING_FRAGMENT_LEN: usize = 1480;
pub const FRAGMENT_UNIT: usize = 8;
/// Only packets of exactly this IP length are marked (paper II-A).
pub const FULL_PACKET_LEN: usize = 1500;
/// Same slack as the Python core: absorbs the last-ulp error of exp/ln so an
/// exact inverse round-trips instead of losing 8 bytes.
const ROUNDING_SLACK: f64 = 1e-9;

pub const RTT_INDICATOR_MIN_LEN: usize = 600;
pub const RTT_INDICATOR_MAX_LEN: usize = 611;
/// 611 is open-ended; 1.5x its lower bound mirrors every other midpoint.
const TOP_BUCKET_RTT_MS: f64 = 3072.0;

/// F(R) before rounding; -inf for a zero or negative rate.
pub fn leading_fragment_len_exact(rate_bytes_per_ms: f64) -> f64 {
    if rate_bytes_per_ms <= 0.0 || rate_bytes_per_ms.is_nan() {
        return f64::NEG_INFINITY;
    }
    LENGTH_SCALE * (rate_bytes_per_ms / RATE_SCALE_BYTES_PER_MS).ln()
}

/// Leading-fragment payload length that advertises `rate_bytes_per_ms`:
/// floor to 8, capped at 1480, `None` below the smallest encodable rate
/// (the router then stops fragmenting).
pub fn leading_fragment_len(rate_bytes_per_ms: f64) -> Option<usize> {
    let exact = leading_fragment_len_exact(rate_bytes_per_ms) + ROUNDING_SLACK;
    if exact < MIN_LEADING_FRAGMENT_LEN as f64 || exact.is_nan() {
        return None;
    }
    let units = (exact / FRAGMENT_UNIT as f64).floor();
    let len = if units >= (MAX_LEADING_FRAGMENT_LEN / FRAGMENT_UNIT) as f64 {
        MAX_LEADING_FRAGMENT_LEN
    } else {
        units as usize * FRAGMENT_UNIT
    };
    Some(len)
}

/// Rate (bytes/ms) carried by a leading fragment of this payload length;
/// `None` outside [24, 1480] or not a multiple of 8.
pub fn advertised_rate(leading_fragment_len: usize) -> Option<f64> {
    if !(MIN_LEADING_FRAGMENT_LEN..=MAX_LEADING_FRAGMENT_LEN).contains(&leading_fragment_len)
        || leading_fragment_len % FRAGMENT_UNIT != 0
    {
        return None;
    }
    Some(RATE_SCALE_BYTES_PER_MS * (leading_fragment_len as f64 / LENGTH_SCALE).exp())
}

pub fn bytes_per_ms_to_bps(r: f64) -> f64 {
    r * 8000.0
}

pub fn bps_to_bytes_per_ms(bps: f64) -> f64 {
    bps / 8000.0
}

/// Smallest rate a leading fragment can carry (about 120 kbit/s).
pub fn min_advertised_rate_bytes_per_ms() -> f64 {
    RATE_SCALE_BYTES_PER_MS * (MIN_LEADING_FRAGMENT_LEN as f64 / LENGTH_SCALE).exp()
}

/// Is this packet an RTT indicator? (DF set, IP length 600..611.)
pub fn is_rtt_indicator(ip_len: usize, dont_frag: bool) -> bool {
    dont_frag && (RTT_INDICATOR_MIN_LEN..=RTT_INDICATOR_MAX_LEN).contains(&ip_len)
}

/// IP length of the indicator an endpoint sends for `rtt_ms`.
pub fn rtt_indicator(rtt_ms: f64) -> usize {
    if rtt_ms.is_nan() || rtt_ms < 2.0 {
        return RTT_INDICATOR_MIN_LEN;
    }
    let k = rtt_ms.log2().floor();
    if k >= (RTT_INDICATOR_MAX_LEN - RTT_INDICATOR_MIN_LEN) as f64 {
        return RTT_INDICATOR_MAX_LEN;
    }
    RTT_INDICATOR_MIN_LEN + k as usize
}

/// RTT the router takes from an indicator length: the midpoint of its
/// range, 600 read as 1 ms and 611 as 3072 ms. `None` for other lengths.
pub fn rtt_indicator_midpoint_ms(ip_len: usize) -> Option<f64> {
    if !(RTT_INDICATOR_MIN_LEN..=RTT_INDICATOR_MAX_LEN).contains(&ip_len) {
        return None;
    }
    let k = (ip_len - RTT_INDICATOR_MIN_LEN) as i32;
    Some(match ip_len {
        RTT_INDICATOR_MIN_LEN => 1.0,
        RTT_INDICATOR_MAX_LEN => TOP_BUCKET_RTT_MS,
        _ => (2f64.powi(k) + 2f64.powi(k + 1)) / 2.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_anchor_points() {
        // About 120 kbit/s (15.0045 B/ms) -> 24, a hair less is not
        // encodable; 10 Gbit/s -> 1474.3 -> 1472.
        assert_eq!(leading_fragment_len(15.01), Some(24));
        assert_eq!(leading_fragment_len(15.0), None);
        assert_eq!(leading_fragment_len(1.25e6), Some(1472));
        assert_eq!(leading_fragment_len(14.0), None);
        assert_eq!(leading_fragment_len(1e12), Some(1480));
        assert_eq!(leading_fragment_len(0.0), None);
        assert_eq!(leading_fragment_len(f64::NAN), None);
        // L = 1000 is about 245 Mbit/s.
        let r = advertised_rate(1000).expect("valid");
        assert!((bytes_per_ms_to_bps(r) / 1e6 - 245.0).abs() < 1.5);
    }

    #[test]
    fn inverse_round_trips() {
        for l in (MIN_LEADING_FRAGMENT_LEN..=MAX_LEADING_FRAGMENT_LEN).step_by(8) {
            let r = advertised_rate(l).expect("valid");
            assert_eq!(leading_fragment_len(r), Some(l));
        }
        assert_eq!(advertised_rate(25), None);
        assert_eq!(advertised_rate(16), None);
        assert_eq!(advertised_rate(1488), None);
    }
}
