//! Thin, checked wrappers over the Linux calls the shells need: clock,
//! poll, signals, interfaces, capabilities, sysctls and `ip` commands.
//! Every failure becomes an [`Error`] with a hint, never a panic.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use ka_core::Nanos;

/// One domain error: a message and an optional hint, printed as
/// `ERROR: ...` by the binaries, which then exit non-zero.
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
        write!(f, "{}", self.msg)?;
        if let Some(h) = &self.hint {
            write!(f, "\n  hint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Print an error the way every binary here does and pick the exit code.
pub fn report(program: &str, e: &Error) -> i32 {
    eprintln!("{program}: ERROR: {e}");
    1
}

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every namespace, so
/// timestamps from a sender and a receiver in different namespaces compare.
pub fn now() -> Nanos {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall clock, seconds since the epoch (telemetry `ts`).
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Ask for 1 ns timer slack: the default 50 us would make every sleep up to
/// 50 us late, which is a whole packet time at 250 Mbit/s.
pub fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer; failure is harmless.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}

/// Wait until one of `fds` is readable or `timeout_ns` passed (None: no
/// limit). Returns which fds are readable; EINTR counts as a timeout.
pub fn poll_readable(fds: &[RawFd], timeout_ns: Option<Nanos>) -> Result<Vec<bool>> {
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
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(Error::new(format!("poll failed: {e}")));
    }
    Ok(pfds
        .iter()
        .map(|p| p.revents & (libc::POLLIN | libc::POLLERR) != 0)
        .collect())
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_sig: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGTERM/SIGINT/SIGHUP set a flag the main loop checks (and interrupt
/// any poll in progress), so the shells can drain and clean up.
pub fn install_stop_handlers() -> Result<()> {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction with a plain handler and no SA_RESTART
        // (we want EINTR); the handler only touches an atomic.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(Error::new(format!(
                "cannot install signal handler: {}",
                io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
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

pub fn iface_exists(name: &str) -> bool {
    ifindex(name).is_ok()
}

#[repr(C)]
struct IfReqInt {
    name: [libc::c_char; libc::IFNAMSIZ],
    value: libc::c_int,
    _pad: [u8; 20],
}

/// MTU of an interface (SIOCGIFMTU: namespace-correct, unlike sysfs).
pub fn iface_mtu(name: &str) -> Result<usize> {
    // SAFETY: plain socket creation; closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::new(format!(
            "socket: {}",
            io::Error::last_os_error()
        )));
    }
    let mut req = IfReqInt {
        name: [0; libc::IFNAMSIZ],
        value: 0,
        _pad: [0; 20],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: req is a properly sized ifreq for SIOCGIFMTU.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(Error::new(format!("cannot read the MTU of {name}: {err}")));
    }
    Ok(req.value as usize)
}

/// Does this process hold CAP_NET_ADMIN and CAP_NET_RAW (effective)?
pub fn has_net_caps() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    let Some(line) = status.lines().find(|l| l.starts_with("CapEff:")) else {
        return false;
    };
    let Ok(bits) = u64::from_str_radix(line["CapEff:".len()..].trim(), 16) else {
        return false;
    };
    const CAP_NET_ADMIN: u64 = 12;
    const CAP_NET_RAW: u64 = 13;
    bits & (1 << CAP_NET_ADMIN) != 0 && bits & (1 << CAP_NET_RAW) != 0
}

pub fn require_net_caps(program: &str) -> Result<()> {
    if has_net_caps() {
        return Ok(());
    }
    Err(Error::new(format!("{program} needs CAP_NET_ADMIN and CAP_NET_RAW"))
        .hint(format!("run it as root (sudo {program} ...) or grant the capabilities: setcap cap_net_admin,cap_net_raw+ep $(which {program})")))
}

/// Run `ip ARGS...`; an error carries ip's own message.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().map_err(|e| {
        Error::new(format!("cannot run `ip`: {e}"))
            .hint("install iproute2 (apt-get install iproute2)")
    })?;
    if !out.status.success() {
        return Err(Error::new(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Run `ip ARGS...` where failure is expected and fine (clean-up).
pub fn ip_quiet(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn sysctl_path(key: &str) -> String {
    format!("/proc/sys/{}", key.replace('.', "/"))
}

pub fn sysctl_read(key: &str) -> Result<String> {
    std::fs::read_to_string(sysctl_path(key))
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::new(format!("cannot read sysctl {key}: {e}")))
}

pub fn sysctl_write(key: &str, value: &str) -> Result<()> {
    std::fs::write(sysctl_path(key), value)
        .map_err(|e| Error::new(format!("cannot set sysctl {key}={value}: {e}")))
}

/// Owned file descriptor that is closed on drop.
pub struct Fd(pub RawFd);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own this fd and close it once.
        unsafe { libc::close(self.0) };
    }
}

/// `read(2)` into `buf`: Ok(None) when nothing is waiting.
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

/// `writev(2)` of up to two slices.
pub fn writev2(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    let cnt = if b.is_empty() { 1 } else { 2 };
    // SAFETY: iov points to live slices for the duration of the call.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), cnt) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Ask for SCHED_FIFO at `priority` (1..99) so a wake-up preempts ordinary
/// processes: timing, not throughput, is what the caller sells. Returns
/// false (and changes nothing) when not permitted.
pub fn realtime_priority(priority: i32) -> bool {
    let p = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: p is a valid sched_param; pid 0 is this thread.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) == 0 }
}
