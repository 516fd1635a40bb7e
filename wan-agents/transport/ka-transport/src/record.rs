//! The per-flow record: what the wide-area trials store for every flow
//! (paper §IV-B: protocol, size, flow completion time, time spent in
//! Kick-Ass mode, mode switches, retransmissions), plus RTT and the
//! advertised rates the flow saw. Serializable as one JSON object.

use ka_core::Nanos;
use serde::{Deserialize, Serialize};

/// The endpoint's two modes (paper II-C).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mode {
    /// Pace at the router's advertised rate.
    #[serde(rename = "kickass")]
    KickAss,
    /// Behave as TCP (the flow's `cc`: CUBIC by default, NewReno as in the paper).
    #[serde(rename = "tcp")]
    Tcp,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::KickAss => "kickass",
            Mode::Tcp => "tcp",
        }
    }
}

/// Why the endpoint changed mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwitchReason {
    /// No advertised rate for more than one SRTT (paper II-C2).
    NoRate,
    /// The retransmission timer expired: a dropped packet (II-C3).
    Rto,
    /// Three duplicate ACKs (II-C3): DupThresh segments SACKed above a hole.
    DupAcks,
    /// A loss found by time (RACK, RFC 8985) before three duplicate ACKs
    /// came, or repaired by a tail loss probe (II-C3: "a dropped packet").
    Loss,
    /// An ECN-echo (II-C3).
    Ecn,
    /// TCP mode's rate cwnd/SRTT reached the last advertised rate (II-C3).
    RateReached,
    /// The receiver does not echo rates: Kick-Ass is impossible on this flow.
    NotNegotiated,
}

/// One mode change, `at_ns` counted from the first handshake datagram.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModeSwitch {
    pub at_ns: Nanos,
    pub from: Mode,
    pub to: Mode,
    pub reason: SwitchReason,
}

/// Which opening the flow used (our improvement on paper §III-C2 is the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HandshakeMode {
    /// Paper behaviour (III-C2): a small handshake; the first rate rides
    /// back on the ACK of the first data packet, one RTT later than RCP.
    Paper,
    /// The opening HANDSHAKE is padded to IP length 1500 with DF clear, so
    /// a Kick-Ass router marks it and the first rate arrives in the
    /// HANDSHAKE_ACK: data is paced at the advertised rate from the start.
    #[default]
    Padded,
}

/// Advertised rates (bytes/ms) the sender accepted from ACK echoes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct RateStats {
    pub count: u64,
    pub min_bytes_per_ms: Option<f64>,
    pub max_bytes_per_ms: Option<f64>,
    pub last_bytes_per_ms: Option<f64>,
}

impl RateStats {
    pub fn on_rate(&mut self, r: f64) {
        self.count += 1;
        self.min_bytes_per_ms = Some(self.min_bytes_per_ms.map_or(r, |m| m.min(r)));
        self.max_bytes_per_ms = Some(self.max_bytes_per_ms.map_or(r, |m| m.max(r)));
        self.last_bytes_per_ms = Some(r);
    }
}

/// Everything the trial runner stores about one flow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowRecord {
    pub flow_id: u64,
    /// "kickass" when Kick-Ass was configured and negotiated, else "tcp".
    pub protocol: String,
    pub handshake_mode: HandshakeMode,
    pub size_bytes: u64,
    /// DATA datagrams needed (1440 payload bytes each, the last shorter).
    pub size_packets: u64,
    /// Flow completion time: first HANDSHAKE sent -> last byte acknowledged.
    pub fct_ns: Option<Nanos>,
    pub completed: bool,
    /// Why the flow failed, when it did.
    pub error: Option<String>,
    /// Time in Kick-Ass mode over the flow's life (up to completion, or up
    /// to now while running).
    pub ka_mode_ns: Nanos,
    /// `ka_mode_ns` as a fraction of the flow's life.
    pub ka_mode_fraction: f64,
    pub mode_switch_count: u64,
    /// The first few switches (the list is bounded; the count is not).
    pub mode_switches: Vec<ModeSwitch>,
    /// DATA datagrams sent again.
    pub retransmissions: u64,
    pub retransmitted_bytes: u64,
    pub rto_count: u64,
    pub fast_retransmits: u64,
    pub srtt_ns: Option<Nanos>,
    pub min_rtt_ns: Option<Nanos>,
    pub advertised_rates: RateStats,
    pub datagrams_sent: u64,
    /// RTT indicators this flow carried for its endpoint (paper II-B: one
    /// per endpoint every 100 ms, not one per flow): data segments cut to
    /// the indicator's length and standalone indicators alike. Both are
    /// also in `datagrams_sent`.
    pub rtt_indicators_sent: u64,
}
