//! Sans-IO core of the Kick-Ass edge router and link emulator.
//!
//! Everything here is pure: time comes in as [`Nanos`] (a monotonic clock
//! reading chosen by the caller), packets come in as byte buffers, and the
//! answers are values. The IO shells live in the `ka-edge` crate.

pub mod encoding;
pub mod fragment;
pub mod linkem;
pub mod mode;
pub mod rcp;
pub mod rng;
pub mod router;
pub mod shaper;
pub mod units;
pub mod wire;

/// Nanoseconds on a monotonic clock (CLOCK_MONOTONIC in the shells,
/// plain numbers in tests).
pub type Nanos = u64;
