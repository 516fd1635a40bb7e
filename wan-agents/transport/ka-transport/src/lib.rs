//! The Kick-Ass transport: a reliable byte stream over UDP with the
//! paper's endpoint behaviour (Flores, Wenzel, Kuzmanovic, "Enabling
//! Router-Assisted Congestion Control on the Internet", section II-C), as a
//! sans-IO core in the manner of quinn-proto.
//!
//! * [`Connection`]: the sender of one flow. It paces at the rate a
//!   Kick-Ass router advertises through the leading fragment's length
//!   (Kick-Ass mode, [`cc::ExplicitRate`]) and falls back to TCP (CUBIC by
//!   default, [`cc::Cubic`]; the paper's NewReno, [`cc::NewReno`], on
//!   request; both with SACK, RACK-TLP and PRR loss recovery) exactly when
//!   the paper says: no rate for more than one RTT, a loss, three duplicate
//!   ACKs or an ECN echo; it returns when its TCP rate reaches the last
//!   advertised rate.
//! * [`RttIndicatorClock`]: the endpoint's RTT indicator, one every 100 ms
//!   per endpoint (paper II-B), carried by one of its flows.
//! * [`Receiver`]: the agent side. It reassembles the stream, ACKs every
//!   datagram with cumulative ACK + SACK, and echoes the
//!   `leading_fragment_len` the shell observed before reassembly together
//!   with the decoded `advertised_rate`. Flows need a token; before it is
//!   validated nothing larger than what arrived is ever sent back.
//! * [`wire`]: the datagram format (smoltcp-style `Packet`/`Repr`).
//!
//! Time is [`Nanos`] passed in by the caller; datagrams are byte slices.
//! No sockets, threads or clocks here: the shells (UDP socket, AF_PACKET
//! leading-fragment reader) live elsewhere, and every behaviour is tested
//! on simulated time. The rate and RTT-indicator codes come from
//! `ka_core::encoding`, shared with the router.

pub mod cc;
pub mod connection;
pub mod indicator;
pub mod pacer;
pub mod payload;
pub mod receiver;
pub mod record;
pub mod rtt;
pub mod wire;

pub use ka_core::Nanos;

pub use cc::{CongestionControl, Controller, Cubic, ExplicitRate, NewReno};
pub use connection::{
    Config, ConfigError, Connection, ConnectionError, ConnectionStats, DatagramError, Event,
    Transmit, DUP_THRESH, SMSS,
};
pub use indicator::{RttIndicatorClock, RTT_INDICATOR_INTERVAL};
pub use pacer::Pacer;
pub use payload::{pattern_byte, pattern_fill, Payload};
pub use receiver::{
    FlowKey, Receiver, ReceiverConfig, ReceiverEvent, ReceiverStats, ReceiverTransmit, RecvError,
    RecvFlowStats, RxInfo, TokenRequest, TokenValidator,
};
pub use record::{FlowRecord, HandshakeMode, Mode, ModeSwitch, RateStats, SwitchReason};
pub use rtt::RttEstimator;
