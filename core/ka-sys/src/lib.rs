//! The syscall layer shared by the router's shells (`ka-edge`: `ka-router`,
//! `ka-linkem`, `ka-blast`) and the transport's shells (`ka-agent`:
//! `ka-agent-recv`, `ka-send`): thin, checked wrappers over the Linux calls
//! both need. Clocks, `ppoll`, stop signals, owned descriptors,
//! non-blocking reads, socket options, interface names and AF_PACKET
//! sockets ([`packet`]). Every failure is an [`Error`] with a hint (or an
//! `io::Error` the caller words), never a panic.
//!
//! What only one side needs stays with it: TUN, `ip` and sysctls in
//! `ka-edge`, UDP flows in `ka-agent`.

pub mod packet;

use std::ffi::CString;
use std::fmt;
use std::io;
use std::mem;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// One domain error: a message and an optional hint, printed by the
/// binaries (`PROGRAM: ERROR: ...` / `PROGRAM: error: ...`), which then
/// exit non-zero.
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

/// CLOCK_MONOTONIC in nanoseconds (`ka_core::Nanos`): the same clock in
/// every namespace, so timestamps from a sender and a receiver in different
/// namespaces compare.
pub fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall clock since the epoch (zero if the clock is before it). Callers
/// pick the unit: `.as_secs_f64()` for telemetry `ts`, `.as_secs()` for
/// token expiry.
pub fn unix_time() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

/// Ask for 1 ns timer slack, so `ppoll` wakes within microseconds of its
/// deadline instead of up to 50 us late (a whole packet time at
/// 250 Mbit/s): that is what makes a `ppoll` timeout a precise sleep.
pub fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer; failure is harmless.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}

/// Wait until one of `fds` is readable or `timeout_ns` passed (None: no
/// limit; hrtimer precision). Fills `ready` (one flag per fd; an error or
/// hang-up counts as readable: the read reports it); EINTR (a stop signal)
/// counts as a timeout.
pub fn poll_readable(fds: &[RawFd], timeout_ns: Option<u64>, ready: &mut Vec<bool>) -> Result<()> {
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
/// poll in progress), so the shells can drain, print their counters and
/// clean up. SIGPIPE is ignored: a closed stdout becomes a write error,
/// not a kill (Rust's runtime already does so; said here so it holds).
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

/// The return value `n` of a non-blocking `read`/`recv` family call, taken
/// right after the call (it reads `errno`): Ok(Some(n)), Ok(None) when
/// nothing is waiting or a signal interrupted, Err for a real failure.
pub fn nb_result(n: libc::ssize_t) -> io::Result<Option<usize>> {
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
}

/// `read(2)`: Ok(None) when nothing is waiting, Ok(Some(0)) at end of file.
pub fn read_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is a valid writable region of buf.len() bytes.
    nb_result(unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) })
}

/// `send(2)` one datagram or frame on a connected or bound socket.
pub fn send(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    // SAFETY: buf is live for the call.
    let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `setsockopt(2)` with a plain-data value.
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

/// Make `fd`'s receive (`rcv`) or send buffer at least `bytes`, best
/// effort: the FORCE variant first (root may exceed the sysctl limits),
/// then the ordinary one.
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

pub fn from_sockaddr_in(sa: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    )
}

/// Interface index, or a clear error naming the interface.
pub fn ifindex(name: &str) -> Result<u32> {
    let bad = || {
        Error::new(format!(
            "interface {name:?} not found in this network namespace"
        ))
        .hint(
            "check the name with `ip link` (run inside the right namespace: ip netns exec NS ...)",
        )
    };
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(bad());
    }
    let c = CString::new(name).map_err(|_| bad())?;
    // SAFETY: c is a valid NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(bad());
    }
    Ok(idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe() -> (Fd, Fd) {
        let mut p = [0; 2];
        // SAFETY: p is a writable array of two ints.
        let rc = unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        assert_eq!(rc, 0);
        (Fd(p[0]), Fd(p[1]))
    }

    #[test]
    fn clocks_move_forward() {
        let a = now();
        let b = now();
        assert!(b >= a);
        assert!(unix_time().as_secs() > 1_600_000_000);
    }

    #[test]
    fn poll_times_out_then_sees_data_and_read_nb_reads_it() {
        let (r, w) = pipe();
        let mut ready = vec![true; 7];
        poll_readable(&[r.0], Some(1_000_000), &mut ready).unwrap();
        assert_eq!(ready, [false]);
        let mut buf = [0u8; 8];
        assert_eq!(read_nb(r.0, &mut buf).unwrap(), None);
        // SAFETY: writing 3 live bytes to our pipe.
        assert_eq!(unsafe { libc::write(w.0, b"abc".as_ptr().cast(), 3) }, 3);
        poll_readable(&[r.0], None, &mut ready).unwrap();
        assert_eq!(ready, [true]);
        assert_eq!(read_nb(r.0, &mut buf).unwrap(), Some(3));
        assert_eq!(&buf[..3], b"abc");
        // A closed writer: readable (hang-up), and the read says end of file.
        drop(w);
        poll_readable(&[r.0], Some(0), &mut ready).unwrap();
        assert_eq!(ready, [true]);
        assert_eq!(read_nb(r.0, &mut buf).unwrap(), Some(0));
    }

    #[test]
    fn bad_fds_are_errors_not_none() {
        let mut buf = [0u8; 4];
        assert!(read_nb(-1, &mut buf).is_err());
    }

    #[test]
    fn ifindex_names_the_interface() {
        assert!(ifindex("lo").is_ok_and(|i| i > 0));
        for bad in ["", "no-such-if0", "sixteen-chars-xx", "a\0b"] {
            let e = ifindex(bad).unwrap_err();
            assert!(e.to_string().contains("not found"), "{e}");
            assert!(e.hint.is_some());
        }
    }

    #[test]
    fn sockaddr_round_trips() {
        let a: SocketAddrV4 = "192.0.2.7:7000".parse().unwrap();
        let sa = sockaddr_in(a);
        assert_eq!(sa.sin_family, libc::AF_INET as libc::sa_family_t);
        assert_eq!(from_sockaddr_in(&sa), a);
    }

    #[test]
    fn errors_print_their_hint() {
        let e = Error::new("boom").hint("do this");
        assert_eq!(e.to_string(), "boom\n  hint: do this");
        assert_eq!(Error::new("boom").to_string(), "boom");
    }
}
