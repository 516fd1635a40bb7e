//! I/O shells of the Kick-Ass transport (`ka-transport`, sans-IO):
//!
//! * `ka-agent-recv` ([`recv_shell`]): the wan agent's receiver. One UDP
//!   socket, the sans-IO `Receiver`, and a fragment tap ([`afpacket`]):
//!   an AF_PACKET socket behind a kernel BPF filter that reads each
//!   datagram's leading fragment before reassembly, so every datagram is
//!   handed to the core with the `leading_fragment_len` a router wrote
//!   ([`fragments`] joins the two views). Flow tokens are checked with the
//!   agent's secret ([`token`]).
//! * `ka-send` ([`send_shell`]): the trial runner's sender. One flow, or an
//!   NDJSON schedule of flows run concurrently; DF per datagram as the core
//!   asks; paced by a nanosecond `ppoll` loop.
//!
//! No protocol logic lives here: every decision is the core's.

pub mod afpacket;
pub mod fragments;
pub mod recv_shell;
pub mod send_shell;
pub mod sys;
pub mod token;
