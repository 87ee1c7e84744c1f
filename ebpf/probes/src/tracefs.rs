//! Tracepoint format files (`/sys/kernel/tracing/events/<cat>/<name>/format`):
//! locating and mounting tracefs, and parsing field offsets.

use std::path::{Path, PathBuf};

use crate::ProbeError;

/// Where tracefs is usually found, in order.
const CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// One field of a tracepoint format file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpField {
    /// Field name (`sk`, `ret`, `daddr_v6`; array suffix removed).
    pub name: String,
    /// Byte offset in the tracepoint record.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
}

/// Parses the `format:` section of a tracepoint format file.
///
/// Lines look like `\tfield:int ret;\toffset:20;\tsize:4;\tsigned:1;`.
/// Lines that do not parse are skipped (the header lines `name:`, `ID:`,
/// `print fmt:`).
pub fn parse_format(text: &str) -> Vec<TpField> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("field:") else {
            continue;
        };
        let mut decl = None;
        let mut offset = None;
        let mut size = None;
        for (i, part) in rest.split(';').enumerate() {
            let part = part.trim();
            if i == 0 {
                decl = Some(part);
            } else if let Some(v) = part.strip_prefix("offset:") {
                offset = v.trim().parse().ok();
            } else if let Some(v) = part.strip_prefix("size:") {
                size = v.trim().parse().ok();
            }
        }
        let (Some(decl), Some(offset), Some(size)) = (decl, offset, size) else {
            continue;
        };
        // last identifier of the declaration, without an array suffix
        let decl = decl.split('[').next().unwrap_or(decl);
        let Some(name) = decl
            .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .find(|s| !s.is_empty())
        else {
            continue;
        };
        out.push(TpField {
            name: name.to_string(),
            offset,
            size,
        });
    }
    out
}

/// Offset of `field` in parsed `fields`, or an error naming the tracepoint.
pub fn field_offset(fields: &[TpField], tracepoint: &str, field: &str) -> Result<u32, ProbeError> {
    fields
        .iter()
        .find(|f| f.name == field)
        .map(|f| f.offset)
        .ok_or_else(|| {
            ProbeError::Offsets(format!("tracepoint {tracepoint} has no field `{field}`"))
        })
}

/// Returns the tracefs mount point, mounting tracefs at
/// `/sys/kernel/tracing` when it is not mounted (needs root; aya looks there).
pub fn ensure_tracefs() -> Result<PathBuf, ProbeError> {
    for c in CANDIDATES {
        let p = Path::new(c);
        if p.join("events").is_dir() {
            return Ok(p.to_path_buf());
        }
    }
    let target = c"/sys/kernel/tracing";
    // SAFETY: plain mount(2) with static NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(ProbeError::Tracefs(format!(
            "tracefs is not mounted and mounting it at /sys/kernel/tracing failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(PathBuf::from(CANDIDATES[0]))
}

/// Reads and parses `<tracefs>/events/<category>/<name>/format`.
pub fn read_format(tracefs: &Path, category: &str, name: &str) -> Result<Vec<TpField>, ProbeError> {
    let p = tracefs
        .join("events")
        .join(category)
        .join(name)
        .join("format");
    let text = std::fs::read_to_string(&p)
        .map_err(|e| ProbeError::Tracefs(format!("reading {}: {e}", p.display())))?;
    Ok(parse_format(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOCK_RECV: &str = "name: sock_recv_length
ID: 2283
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:void * sk;\toffset:8;\tsize:8;\tsigned:0;
\tfield:__u16 protocol;\toffset:18;\tsize:2;\tsigned:0;
\tfield:int ret;\toffset:20;\tsize:4;\tsigned:1;
\tfield:__u8 daddr_v6[16];\toffset:58;\tsize:16;\tsigned:0;

print fmt: \"sk address = %p\", REC->sk
";

    #[test]
    fn parses_fields() {
        let f = parse_format(SOCK_RECV);
        assert_eq!(field_offset(&f, "t", "sk").unwrap(), 8);
        assert_eq!(field_offset(&f, "t", "protocol").unwrap(), 18);
        assert_eq!(field_offset(&f, "t", "ret").unwrap(), 20);
        assert_eq!(field_offset(&f, "t", "daddr_v6").unwrap(), 58);
        assert_eq!(f.iter().find(|x| x.name == "daddr_v6").unwrap().size, 16);
        let e = field_offset(&f, "sock:sock_recv_length", "flags").unwrap_err();
        assert!(e.to_string().contains("flags"), "{e}");
    }
}
