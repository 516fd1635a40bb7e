//! Parsing of the command-line quantities: rates (`10mbit`), buffer sizes
//! (`1000p`, `1500000b`) and durations (`50ms`). tc's spelling is used so
//! operators can reuse what they know: `bit` suffixes are bits per second,
//! `bps` suffixes are *bytes* per second (tc-rate(8)); all prefixes decimal.

use core::fmt;

/// A unit-parsing error, phrased for the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

fn split_number(s: &str) -> Option<(f64, String)> {
    let s = s.trim();
    let end = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.' || *c == 'e' || *c == 'E' || *c == '_'))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    // "1e3bit" is fine, but an 'e' that starts a unit is not a digit: back off.
    let (mut num, mut unit) = s.split_at(end);
    while num.ends_with(['e', 'E']) {
        let cut = num.len() - 1;
        num = &s[..cut];
        unit = &s[cut..];
    }
    let v: f64 = num.replace('_', "").parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    Some((v, unit.trim().to_ascii_lowercase()))
}

/// A rate in bits per second: `10mbit`, `1gbit`, `500kbit`, `12500kbps`
/// (bytes/s, as tc), or a bare number of bits per second.
pub fn parse_rate_bps(s: &str) -> Result<f64, ParseError> {
    let bad = || {
        ParseError(format!(
            "bad rate {s:?}: use a number with a unit such as 10mbit, 100mbit, 1gbit, 500kbit \
             (bits/s) or 1mbps (bytes/s, as tc)"
        ))
    };
    let (v, unit) = split_number(s).ok_or_else(bad)?;
    let mult = match unit.as_str() {
        "" | "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        "tbit" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        _ => return Err(bad()),
    };
    let bps = v * mult;
    if bps <= 0.0 {
        return Err(ParseError(format!(
            "bad rate {s:?}: must be greater than zero"
        )));
    }
    Ok(bps)
}

/// A queue limit in packets or bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    Packets(usize),
    Bytes(usize),
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Packets(n) => write!(f, "{n}p"),
            Limit::Bytes(n) => write!(f, "{n}b"),
        }
    }
}

/// `1000p` (packets), `1500000b`, `1500kb`, `2mb` (bytes, decimal).
pub fn parse_limit(s: &str) -> Result<Limit, ParseError> {
    let bad = || {
        ParseError(format!(
            "bad buffer size {s:?}: use packets like 1000p or bytes like 1500000b / 1500kb"
        ))
    };
    let (v, unit) = split_number(s).ok_or_else(bad)?;
    if v.fract() != 0.0 && unit == "p" {
        return Err(bad());
    }
    let lim = match unit.as_str() {
        "p" | "pkt" | "pkts" | "packets" => Limit::Packets(v as usize),
        "b" | "byte" | "bytes" => Limit::Bytes(v as usize),
        "kb" => Limit::Bytes((v * 1e3) as usize),
        "mb" => Limit::Bytes((v * 1e6) as usize),
        _ => return Err(bad()),
    };
    match lim {
        Limit::Packets(0) | Limit::Bytes(0) => Err(ParseError(format!(
            "bad buffer size {s:?}: must be greater than zero"
        ))),
        l => Ok(l),
    }
}

/// A duration in nanoseconds: `50ms`, `1.5s`, `200us`, `0`.
pub fn parse_duration_ns(s: &str) -> Result<u64, ParseError> {
    let bad = || ParseError(format!("bad duration {s:?}: use e.g. 50ms, 1s, 200us"));
    let (v, unit) = split_number(s).ok_or_else(bad)?;
    let mult = match unit.as_str() {
        "ns" => 1.0,
        "us" => 1e3,
        "ms" => 1e6,
        "s" | "sec" => 1e9,
        "" if v == 0.0 => 0.0,
        _ => return Err(bad()),
    };
    Ok((v * mult).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate_bps("10mbit"), Ok(10e6));
        assert_eq!(parse_rate_bps("100Mbit"), Ok(100e6));
        assert_eq!(parse_rate_bps("1gbit"), Ok(1e9));
        assert_eq!(parse_rate_bps("1.5gbit"), Ok(1.5e9));
        assert_eq!(parse_rate_bps("500kbit"), Ok(500e3));
        assert_eq!(parse_rate_bps("1mbps"), Ok(8e6));
        assert_eq!(parse_rate_bps("64000"), Ok(64000.0));
        for bad in [
            "",
            "fast",
            "10 furlongs",
            "-1mbit",
            "0mbit",
            "mbit",
            "1e999gbit",
        ] {
            assert!(parse_rate_bps(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits() {
        assert_eq!(parse_limit("1000p"), Ok(Limit::Packets(1000)));
        assert_eq!(parse_limit("1500000b"), Ok(Limit::Bytes(1_500_000)));
        assert_eq!(parse_limit("1500kb"), Ok(Limit::Bytes(1_500_000)));
        for bad in ["1000", "0p", "p", "1.5p", "10q"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ns("50ms"), Ok(50_000_000));
        assert_eq!(parse_duration_ns("1.5s"), Ok(1_500_000_000));
        assert_eq!(parse_duration_ns("200us"), Ok(200_000));
        assert_eq!(parse_duration_ns("0"), Ok(0));
        assert!(parse_duration_ns("50").is_err());
        assert!(parse_duration_ns("soon").is_err());
    }
}
