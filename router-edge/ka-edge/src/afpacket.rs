//! AF_PACKET sockets bound to one interface: the link emulator's ports.
//! Whole Ethernet frames in and out, our own transmissions ignored.
//!
//! Every frame is prefixed by a 10-byte `virtio_net_hdr` (PACKET_VNET_HDR)
//! that we pass through untouched. Why: a sender's UDP/TCP checksum is
//! often left for the "hardware" (CHECKSUM_PARTIAL, veth does that by
//! default); a plain packet socket would copy the unfinished checksum and
//! the receiver would drop the datagram. The header carries the "checksum
//! still to do" note across, and the egress side finishes it.

use std::io;
use std::os::fd::RawFd;

use crate::sys::{grow_buffer, ifindex, packet, send, set_opt, Error, Fd, Result};

const PACKET_VNET_HDR: libc::c_int = 15;
/// Size of the `virtio_net_hdr` in front of every frame.
pub const VNET_HDR_LEN: usize = 10;

/// A raw AF_PACKET socket for interface `name` (not bound yet) that skips
/// our own transmissions and carries the `virtio_net_hdr`; returns it with
/// the interface index.
pub(crate) fn open_vnet(name: &str, protocol: u16) -> Result<(Fd, i32)> {
    let idx = ifindex(name)? as i32;
    let fd = packet::open(libc::SOCK_RAW, protocol).map_err(|e| {
        Error::new(format!("cannot open an AF_PACKET socket: {e}"))
            .hint("run as root or with CAP_NET_RAW")
    })?;
    packet::ignore_outgoing(fd.0);
    let one: libc::c_int = 1;
    set_opt(fd.0, libc::SOL_PACKET, PACKET_VNET_HDR, &one)
        .map_err(|e| Error::new(format!("cannot enable PACKET_VNET_HDR on {name}: {e}")))?;
    Ok((fd, idx))
}

pub struct PacketSocket {
    fd: Fd,
    ifindex: i32,
    pub name: String,
}

impl PacketSocket {
    pub fn open(name: &str, rcvbuf: usize) -> Result<PacketSocket> {
        let eth_all = libc::ETH_P_ALL as u16;
        let (fd, idx) = open_vnet(name, eth_all)?;
        grow_buffer(fd.0, true, rcvbuf);
        packet::bind(fd.0, eth_all, idx)
            .map_err(|e| Error::new(format!("cannot bind to {name}: {e}")))?;
        packet::add_promiscuous(fd.0, idx)
            .map_err(|e| Error::new(format!("cannot put {name} in promiscuous mode: {e}")))?;
        Ok(PacketSocket {
            fd,
            ifindex: idx,
            name: name.to_string(),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.0
    }

    /// One incoming frame (vnet header + Ethernet frame) into `buf`;
    /// Ok(None) when none is waiting. Our own outgoing frames are skipped.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            match packet::recv_incoming(self.fd.0, buf, libc::MSG_TRUNC)? {
                // MSG_TRUNC reports the real length: a frame larger than
                // the buffer (GRO left on?) is dropped rather than cut.
                Some(n) if n > buf.len() => continue,
                got => return Ok(got),
            }
        }
    }

    /// Send one frame (vnet header + Ethernet frame, as received) out of
    /// this interface (the bound one).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        send(self.fd.0, frame)
    }

    pub fn ifindex(&self) -> i32 {
        self.ifindex
    }
}
