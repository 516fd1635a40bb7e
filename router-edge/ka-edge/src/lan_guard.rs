//! The packet datapath's guard against the kernel forwarding a second copy.
//!
//! AF_PACKET is a tap: the kernel's IPv4 path still gets every frame the
//! router takes from LAN. An nftables rule on LAN's ingress hook (netdev
//! family; it runs after the taps and before `ip_rcv`) drops the kernel's
//! copy of exactly what the router forwards: IPv4 frames addressed to our
//! MAC (PACKET_HOST, as the router's BPF filter) whose destination is not
//! one of this namespace's own or broadcast addresses and not multicast
//! (the router's `is_local`, from the same address list, kept in a set).
//!
//! The table is created with `flags owner` by an `nft -i` child that keeps
//! reading commands from a pipe: the kernel deletes an owned table when the
//! netlink socket that made it closes. So nothing outlives the router: on
//! a clean stop we close the pipe (nft exits, the table goes); on a crash,
//! even SIGKILL, the pipe's write end closes with our process, nft reads
//! EOF and exits, and the kernel removes the table with its socket. Plain
//! kernel forwarding resumes with no clean-up by anyone.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::sys::{Error, Result};

pub struct LanGuard {
    child: Child,
    stdin: Option<ChildStdin>,
    table: String,
    local: Vec<u32>,
}

impl LanGuard {
    /// Install the drop for `lan` in table `ka_router_<tag>`, with `local`
    /// (addresses the kernel keeps delivering), and wait until it is live.
    pub fn install(lan: &str, tag: &str, local: &[u32]) -> Result<LanGuard> {
        let table = format!("ka_router_{tag}");
        let mut child = Command::new("nft")
            .arg("-i")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                Error::new(format!("cannot run nft: {e}")).hint(
                    "the packet datapath needs nftables (apt-get install nftables), or use --datapath tun",
                )
            })?;
        let stdin = child.stdin.take();
        let mut g = LanGuard {
            child,
            stdin,
            table,
            local: vec![],
        };
        let t = &g.table;
        let cmds = format!(
            "add table netdev {t} {{ flags owner; }}\n\
             add set netdev {t} local {{ type ipv4_addr; }}\n\
             add chain netdev {t} lan_in {{ type filter hook ingress device \"{lan}\" priority 0; policy accept; }}\n\
             add rule netdev {t} lan_in meta pkttype host ether type ip ip daddr != 224.0.0.0/3 ip daddr != @local counter drop\n"
        );
        g.send(&cmds)?;
        g.set_local(local)?;
        g.wait_live()?;
        Ok(g)
    }

    fn send(&mut self, cmds: &str) -> Result<()> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(Error::new("the nft process guarding LAN is gone"));
        };
        stdin
            .write_all(cmds.as_bytes())
            .and_then(|_| stdin.flush())
            .map_err(|e| Error::new(format!("the nft process guarding LAN is gone: {e}")))
    }

    /// Keep the set equal to the router's own list of local addresses
    /// (called whenever the router re-reads them; one transaction).
    pub fn set_local(&mut self, local: &[u32]) -> Result<()> {
        let mut want: Vec<u32> = local.iter().copied().filter(|&a| a < 0xe000_0000).collect();
        want.sort_unstable();
        want.dedup();
        if want == self.local {
            return Ok(());
        }
        let t = self.table.clone();
        let mut line = format!("flush set netdev {t} local");
        if !want.is_empty() {
            let list: Vec<String> = want
                .iter()
                .map(|&a| Ipv4Addr::from(a).to_string())
                .collect();
            line += &format!("; add element netdev {t} local {{ {} }}", list.join(", "));
        }
        line.push('\n');
        self.send(&line)?;
        self.local = want;
        Ok(())
    }

    /// The rule is in the kernel (nft reads its pipe asynchronously).
    fn wait_live(&mut self) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let out = Command::new("nft")
                .args(["list", "chain", "netdev", &self.table, "lan_in"])
                .stderr(Stdio::null())
                .output();
            if let Ok(o) = out {
                if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("drop") {
                    return Ok(());
                }
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(
                    Error::new(format!("nft could not install the LAN drop rule ({st})")).hint(
                        "needs Linux >= 5.12 with nf_tables netdev ingress; or use --datapath tun",
                    ),
                );
            }
            if Instant::now() >= until {
                return Err(
                    Error::new("nft did not install the LAN drop rule within 5 s")
                        .hint("or use --datapath tun"),
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Still in force (the nft process lives)?
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Remove the drop now: new LAN traffic goes to kernel forwarding.
    pub fn remove(&mut self) {
        if self.stdin.take().is_none() {
            return;
        }
        // EOF: nft exits and the kernel deletes the table it owns.
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LanGuard {
    fn drop(&mut self) {
        self.remove();
    }
}
