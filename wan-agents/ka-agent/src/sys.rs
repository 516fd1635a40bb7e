//! Thin, checked wrappers over the Linux calls the shells need: clocks,
//! `ppoll`, stop signals, UDP sockets with per-socket DF control and TOS
//! reception. Every failure is an [`Error`] with a hint, never a panic.

use std::fmt;
use std::io;
use std::mem;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use ka_transport::Nanos;

/// One domain error: a message and an optional hint, printed as
/// `PROGRAM: error: ...`.
#[derive(Debug)]
pub struct Error {
    pub msg: String,
    pub hint: Option<String>,
}

impl Error {
    pub fn new(msg: impl Into<String>) -> Self {
        Error {
            msg: msg.into(),
            hint: None,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)?;
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// CLOCK_MONOTONIC in nanoseconds.
pub fn now() -> Nanos {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall clock, whole seconds since the epoch (token expiry).
pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Ask for 1 ns timer slack, so `ppoll` wakes within microseconds of its
/// deadline instead of up to 50 us late (a packet time at 250 Mbit/s):
/// that is what makes a `ppoll` timeout a precise pacing sleep.
pub fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer; failure is harmless.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}

/// Wait until one of `fds` is readable or `timeout_ns` passed (None: no
/// limit; hrtimer precision). Fills `ready`; EINTR (a stop signal) counts
/// as a timeout.
pub fn poll_readable(
    fds: &[RawFd],
    timeout_ns: Option<Nanos>,
    ready: &mut Vec<bool>,
) -> Result<()> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = timeout_ns.map(|t| libc::timespec {
        tv_sec: (t / 1_000_000_000) as libc::time_t,
        tv_nsec: (t % 1_000_000_000) as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: pfds is a valid array of pollfd of the given length; tsp is
    // null or points to a live timespec.
    let rc = unsafe {
        libc::ppoll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            tsp,
            std::ptr::null(),
        )
    };
    ready.clear();
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            ready.resize(fds.len(), false);
            return Ok(());
        }
        return Err(Error::new(format!("poll failed: {e}")));
    }
    ready.extend(
        pfds.iter()
            .map(|p| p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0),
    );
    Ok(())
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_sig: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGTERM/SIGINT/SIGHUP set a flag the main loop checks (and interrupt a
/// poll in progress), so the shells can print their counters and exit.
/// SIGPIPE is ignored: a closed stdout becomes a write error, not a kill.
pub fn install_stop_handlers() -> Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction with a plain handler and no SA_RESTART
        // (we want EINTR); the handler only touches an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = mem::zeroed();
            sa.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(Error::new(format!(
                "cannot install a signal handler: {}",
                io::Error::last_os_error()
            )));
        }
    }
    // SAFETY: ignoring SIGPIPE is always allowed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    Ok(())
}

pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Owned file descriptor, closed on drop.
#[derive(Debug)]
pub struct Fd(pub RawFd);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own this fd and close it once.
        unsafe { libc::close(self.0) };
    }
}

pub fn set_opt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, val: &T) -> io::Result<()> {
    // SAFETY: val points to a live T of the given size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (val as *const T).cast(),
            mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub fn sockaddr_in(a: SocketAddrV4) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain old data; all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = a.port().to_be();
    sa.sin_addr = libc::in_addr {
        s_addr: u32::from(*a.ip()).to_be(),
    };
    sa
}

fn from_sockaddr_in(sa: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    )
}

/// Make `fd`'s buffer `opt` (SO_RCVBUF/SO_SNDBUF) at least `bytes`: the
/// FORCE variant first (root may exceed the sysctl limits), then the
/// ordinary one.
pub fn grow_buffer(fd: RawFd, rcv: bool, bytes: usize) {
    let v = bytes as libc::c_int;
    let (force, plain) = if rcv {
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF)
    } else {
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)
    };
    if set_opt(fd, libc::SOL_SOCKET, force, &v).is_err() {
        let _ = set_opt(fd, libc::SOL_SOCKET, plain, &v);
    }
}

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

/// The IPv4 DF bit of everything this socket sends from now on:
/// `IP_PMTUDISC_DO` (set) or `IP_PMTUDISC_DONT` (clear: a full-size
/// datagram leaves whole and a router may fragment it). Linux sets DF by
/// default, so a Kick-Ass sender must clear it explicitly.
pub fn set_dont_fragment(fd: RawFd, df: bool) -> io::Result<()> {
    let v: libc::c_int = if df {
        libc::IP_PMTUDISC_DO
    } else {
        libc::IP_PMTUDISC_DONT
    };
    set_opt(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, &v)
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
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
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
        len: n as usize,
        peer: from_sockaddr_in(&sa),
        tos,
        truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
    }))
}

/// `recv(2)` on a connected socket: Ok(None) when nothing is waiting.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is a valid writable region of buf.len() bytes.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
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

/// `send(2)` one datagram on a connected socket.
pub fn send(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    // SAFETY: buf is live for the call.
    let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), 0) };
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

/// `read(2)`: Ok(None) when nothing is waiting, Ok(Some(0)) at end of file.
pub fn read_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is a valid writable region of buf.len() bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
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
