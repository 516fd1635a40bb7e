//! The agent's own Linux calls (UDP sockets, TOS reception, flow ids) on
//! top of the shared syscall layer `ka-sys`, re-exported here so the shells
//! name one module. Every failure is an [`Error`] with a hint, never a panic.

use std::io;
use std::mem;
use std::net::SocketAddrV4;
use std::os::fd::RawFd;

pub use ka_sys::*;

/// A non-blocking IPv4 UDP socket bound to `bind`.
pub fn udp_socket(bind: SocketAddrV4) -> Result<Fd> {
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(Error::new(format!(
            "cannot open a UDP socket: {}",
            io::Error::last_os_error()
        )));
    }
    let fd = Fd(fd);
    let sa = sockaddr_in(bind);
    // SAFETY: sa is a valid sockaddr_in of the given size.
    let rc = unsafe {
        libc::bind(
            fd.0,
            (&sa as *const libc::sockaddr_in).cast(),
            mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        let hint = match e.raw_os_error() {
            Some(libc::EADDRINUSE) => {
                "another program uses this port (a receiver already running?)"
            }
            Some(libc::EADDRNOTAVAIL) => "the address is not one of this host's (see `ip addr`)",
            Some(libc::EACCES) => "ports below 1024 need root or CAP_NET_BIND_SERVICE",
            _ => "check the address and port",
        };
        return Err(Error::new(format!("cannot bind UDP {bind}: {e}")).hint(hint));
    }
    Ok(fd)
}

/// `connect(2)` a UDP socket: the kernel then delivers only the peer's
/// datagrams to it (one socket per flow needs no demultiplexing).
pub fn connect(fd: RawFd, peer: SocketAddrV4) -> Result<()> {
    let sa = sockaddr_in(peer);
    // SAFETY: sa is a valid sockaddr_in of the given size.
    let rc = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(Error::new(format!(
            "cannot connect a UDP socket to {peer}: {}",
            io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Deliver each datagram's TOS byte (ECN CE) as a control message.
pub fn enable_recv_tos(fd: RawFd) -> io::Result<()> {
    let on: libc::c_int = 1;
    set_opt(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, &on)
}

/// One received datagram's metadata.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub len: usize,
    pub peer: SocketAddrV4,
    /// The IP TOS byte, when IP_RECVTOS is on.
    pub tos: Option<u8>,
    /// The datagram was longer than the buffer.
    pub truncated: bool,
}

/// `recvmsg(2)`: Ok(None) when nothing is waiting.
pub fn recv_from(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<Received>> {
    // SAFETY: plain old data, all-zero valid.
    let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8]; // 64 bytes, aligned for cmsghdr
                              // SAFETY: plain old data, all-zero valid.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = (&mut sa as *mut libc::sockaddr_in).cast();
    msg.msg_namelen = mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = mem::size_of_val(&cbuf) as _;
    // SAFETY: msg points to live buffers of the declared sizes.
    let Some(n) = nb_result(unsafe { libc::recvmsg(fd, &mut msg, 0) })? else {
        return Ok(None);
    };
    let mut tos = None;
    // SAFETY: the CMSG macros walk the control buffer the kernel filled
    // within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_TOS {
                tos = Some(*libc::CMSG_DATA(c));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Some(Received {
        len: n,
        peer: from_sockaddr_in(&sa),
        tos,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
    }))
}

/// `recv(2)` on a connected socket: Ok(None) when nothing is waiting.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is a valid writable region of buf.len() bytes.
    nb_result(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) })
}

/// `sendto(2)` one datagram.
pub fn send_to(fd: RawFd, buf: &[u8], dst: SocketAddrV4) -> io::Result<()> {
    let sa = sockaddr_in(dst);
    // SAFETY: buf and sa are live for the call.
    let n = unsafe {
        libc::sendto(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            0,
            (&sa as *const libc::sockaddr_in).cast(),
            mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Make a descriptor (stdin) non-blocking.
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we were given; flags are plain ints.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Random bytes from the kernel (flow ids).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: b is a writable 8-byte buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Never expected; the clock is a fine fallback for a flow id.
        return now() ^ (std::process::id() as u64) << 32;
    }
    u64::from_ne_bytes(b)
}
