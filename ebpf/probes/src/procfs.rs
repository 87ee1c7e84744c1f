//! Finding the processes that listen on a TCP port, from `/proc/net/tcp{,6}`
//! and `/proc/<pid>/fd`, so that the prefill probes' syscall hooks can be
//! limited to the prefill server's processes.

use std::collections::HashSet;

/// Inodes of sockets in LISTEN state (`st` = `0A`) on local `port`, parsed
/// from the text of `/proc/net/tcp` or `/proc/net/tcp6`.
pub fn listening_inodes(proc_net_tcp: &str, port: u16) -> HashSet<u64> {
    let mut out = HashSet::new();
    for line in proc_net_tcp.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
        if f.len() < 10 || f[3] != "0A" {
            continue;
        }
        let Some((_, p)) = f[1].rsplit_once(':') else {
            continue;
        };
        if u16::from_str_radix(p, 16) == Ok(port)
            && let Ok(inode) = f[9].parse::<u64>()
            && inode != 0
        {
            out.insert(inode);
        }
    }
    out
}

/// Process ids holding a listening socket on `port` (IPv4 or IPv6). Processes
/// whose `fd` folder cannot be read are skipped.
pub fn listening_pids(port: u16) -> Vec<u32> {
    let mut inodes = HashSet::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(t) = std::fs::read_to_string(f) {
            inodes.extend(listening_inodes(&t, port));
        }
    }
    if inodes.is_empty() {
        return Vec::new();
    }
    let mut pids = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .ok()
                .and_then(|l| {
                    l.to_str()
                        .and_then(|s| s.strip_prefix("socket:["))
                        .and_then(|s| s.strip_suffix(']'))
                        .and_then(|s| s.parse::<u64>().ok())
                })
                .is_some_and(|i| inodes.contains(&i))
        });
        if holds {
            pids.push(pid);
        }
    }
    pids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_listeners() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1FA4 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 12346 1 0000000000000000 20 4 30 10 -1
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 999 1 0000000000000000 100 0 0 10 0
";
        let s = listening_inodes(t, 8100);
        assert_eq!(s.into_iter().collect::<Vec<_>>(), vec![12345]);
        assert!(listening_inodes(t, 22).contains(&999));
        assert!(listening_inodes(t, 9).is_empty());
    }

    #[test]
    fn finds_own_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening_pids(port).contains(&std::process::id()));
    }
}
