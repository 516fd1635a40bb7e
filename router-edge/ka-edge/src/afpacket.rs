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

use crate::sys::{ifindex, Error, Fd, Result};

/// Linux 4.20+: do not loop our own transmissions back to this socket.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
const PACKET_VNET_HDR: libc::c_int = 15;
/// Size of the `virtio_net_hdr` in front of every frame.
pub const VNET_HDR_LEN: usize = 10;

pub struct PacketSocket {
    fd: Fd,
    ifindex: i32,
    pub name: String,
}

impl PacketSocket {
    pub fn open(name: &str, rcvbuf: usize) -> Result<PacketSocket> {
        let idx = ifindex(name)? as i32;
        let proto = (libc::ETH_P_ALL as u16).to_be() as libc::c_int;
        // SAFETY: plain socket creation.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                proto,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(Error::new(format!("cannot open an AF_PACKET socket: {e}"))
                .hint("run as root or with CAP_NET_RAW"));
        }
        let fd = Fd(fd);
        let set = |level, opt, val: &[u8]| -> io::Result<()> {
            // SAFETY: val is a live buffer of the given length.
            let rc = unsafe {
                libc::setsockopt(
                    fd.0,
                    level,
                    opt,
                    val.as_ptr().cast(),
                    val.len() as libc::socklen_t,
                )
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        // Best effort: older kernels lack it and we filter by pkttype too.
        let _ = set(
            libc::SOL_PACKET,
            PACKET_IGNORE_OUTGOING,
            &1i32.to_ne_bytes(),
        );
        set(libc::SOL_PACKET, PACKET_VNET_HDR, &1i32.to_ne_bytes())
            .map_err(|e| Error::new(format!("cannot enable PACKET_VNET_HDR on {name}: {e}")))?;
        let buf = (rcvbuf as i32).to_ne_bytes();
        if set(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &buf).is_err() {
            let _ = set(libc::SOL_SOCKET, libc::SO_RCVBUF, &buf);
        }
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid start.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = idx;
        // SAFETY: sll is a valid sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd.0,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            return Err(Error::new(format!(
                "cannot bind to {name}: {}",
                io::Error::last_os_error()
            )));
        }
        // Frames for other MACs must reach us on real NICs too.
        // SAFETY: packet_mreq is plain data.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = idx;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        // SAFETY: mreq is a valid packet_mreq.
        let mreq_bytes = unsafe {
            std::slice::from_raw_parts(
                (&mreq as *const libc::packet_mreq).cast::<u8>(),
                std::mem::size_of::<libc::packet_mreq>(),
            )
        };
        set(libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, mreq_bytes)
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
            // SAFETY: sockaddr_ll is plain data.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: buf and from are valid for the sizes given.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.0,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_TRUNC,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                    _ => Err(e),
                };
            }
            if from.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            // MSG_TRUNC reports the real length: a frame larger than the
            // buffer (GRO left on?) is dropped rather than cut.
            if n as usize > buf.len() {
                continue;
            }
            return Ok(Some(n as usize));
        }
    }

    /// Send one frame (vnet header + Ethernet frame, as received) out of
    /// this interface (the bound one).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: frame is valid for its length; the socket is bound.
        let n = unsafe { libc::send(self.fd.0, frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn ifindex(&self) -> i32 {
        self.ifindex
    }
}
