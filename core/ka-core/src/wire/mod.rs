//! Wire formats, smoltcp style: `Packet<T>` views and `Repr`s.

pub mod checksum;
pub mod ipv4;

pub use ipv4::{Packet as Ipv4Packet, Repr as Ipv4Repr};
