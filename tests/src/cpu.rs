//! CPU time of a process (user + system, all its threads), for benches
//! that report CPU per request. Linux `/proc/<pid>/stat`.

/// utime + stime of process `pid` (`"self"` for this one), seconds; 0 when
/// the process or its stat line cannot be read.
pub fn process_cpu_s(pid: &str) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    stat_cpu_ticks(&text).unwrap_or(0) as f64 / hz
}

/// utime + stime, clock ticks, of a `/proc/<pid>/stat` line. Fields are
/// taken by position after the `)` that ends the command name (`proc(5)`:
/// utime and stime are fields 14 and 15, the 12th and 13th there): some
/// fields before them are negative (`tpgid` is `-1` without a controlling
/// terminal), so skipping what does not parse as `u64` shifts them.
fn stat_cpu_ticks(text: &str) -> Option<u64> {
    let after = text.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_by_position_with_a_negative_tpgid_and_a_paren_in_the_name() {
        let line =
            "4242 (kvloop (x) r) S 1 4242 4242 0 -1 4194560 900 0 0 0 170 57 0 0 20 0 2 0 1 0 0";
        assert_eq!(stat_cpu_ticks(line), Some(170 + 57));
        assert_eq!(stat_cpu_ticks("garbage"), None);
        assert!(process_cpu_s("self") >= 0.0);
    }
}
