//! AF_PACKET sockets: the calls both packet readers share (the link
//! emulator's ports in `ka-edge`, the fragment tap in `ka-agent`). Each
//! returns `io::Error`, so the caller says what failed in its own words.

use std::io;
use std::mem;
use std::os::fd::RawFd;

use crate::{nb_result, set_opt, Fd};

/// Linux 4.20+: do not loop our own transmissions back to this socket.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

/// A non-blocking, close-on-exec AF_PACKET socket. `kind`: `SOCK_RAW`
/// (whole link-layer frames) or `SOCK_DGRAM` (from the network header).
/// `protocol`: an `ETH_P_*` value (host order) it receives from the start;
/// 0 receives nothing until [`bind`].
pub fn open(kind: libc::c_int, protocol: u16) -> io::Result<Fd> {
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            kind | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            protocol.to_be() as libc::c_int,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Fd(fd))
}

/// Bind to `protocol` (an `ETH_P_*` value, host order) on interface
/// `ifindex` (0: every interface).
pub fn bind(fd: RawFd, protocol: u16, ifindex: i32) -> io::Result<()> {
    // SAFETY: sockaddr_ll is plain old data; all-zero is valid.
    let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex;
    // SAFETY: sll is a valid sockaddr_ll of the given size.
    let rc = unsafe {
        libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Ask the kernel not to hand us our own transmissions. Best effort: older
/// kernels lack it, and [`recv_incoming`] skips them anyway.
pub fn ignore_outgoing(fd: RawFd) {
    let one: libc::c_int = 1;
    let _ = set_opt(fd, libc::SOL_PACKET, PACKET_IGNORE_OUTGOING, &one);
}

/// Put interface `ifindex` in promiscuous mode for as long as the socket
/// is open: frames for other MACs reach us on real NICs too.
pub fn add_promiscuous(fd: RawFd, ifindex: i32) -> io::Result<()> {
    // SAFETY: packet_mreq is plain old data; all-zero is valid.
    let mut mreq: libc::packet_mreq = unsafe { mem::zeroed() };
    mreq.mr_ifindex = ifindex;
    mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
    set_opt(fd, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &mreq)
}

/// One classic BPF instruction (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

/// Attach a classic BPF program (SO_ATTACH_FILTER): the kernel runs it on
/// every packet and queues only what it accepts, cut to the length it
/// returns.
pub fn attach_filter(fd: RawFd, prog: &[Insn]) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    set_opt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog)
}

/// The next packet that was not our own transmission, into `buf`;
/// Ok(None) when none is waiting. `flags` go to `recvfrom(2)`: with
/// `MSG_TRUNC` the length returned is the packet's, even when longer than
/// `buf` (the caller decides what a cut packet is worth).
pub fn recv_incoming(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: sockaddr_ll is plain old data; all-zero is valid.
        let mut from: libc::sockaddr_ll = unsafe { mem::zeroed() };
        let mut len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: buf and from are live, writable and of the given sizes.
        let n = unsafe {
            libc::recvfrom(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags,
                (&mut from as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        let Some(n) = nb_result(n)? else {
            return Ok(None);
        };
        if from.sll_pkttype != libc::PACKET_OUTGOING {
            return Ok(Some(n));
        }
    }
}

/// The kernel's counters since the last call (PACKET_STATISTICS: reading
/// resets them): packets that passed the filter, and of those the ones
/// dropped for a full receive buffer.
pub fn statistics(fd: RawFd) -> io::Result<libc::tpacket_stats> {
    let mut st = libc::tpacket_stats {
        tp_packets: 0,
        tp_drops: 0,
    };
    let mut len = mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: st is a writable tpacket_stats of the given size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            (&mut st as *mut libc::tpacket_stats).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insn_is_a_sock_filter() {
        assert_eq!(mem::size_of::<Insn>(), mem::size_of::<libc::sock_filter>());
        assert_eq!(
            mem::align_of::<Insn>(),
            mem::align_of::<libc::sock_filter>()
        );
    }
}
