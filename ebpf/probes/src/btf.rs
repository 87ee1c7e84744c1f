//! Minimal reader of kernel BTF (`/sys/kernel/btf/vmlinux`): finds the byte
//! offset of a member of a named struct, descending into anonymous
//! struct/union members (as `struct sock_common` needs for `skc_daddr`,
//! `skc_dport`, `skc_num`).
//!
//! Format: `Documentation/bpf/btf.rst` in the kernel tree (header, type
//! section of `struct btf_type` records with kind-specific trailers, string
//! section).

use crate::ProbeError;

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

/// One parsed type record (only what member lookup needs).
#[derive(Clone, Debug)]
struct Ty {
    kind: u32,
    name_off: u32,
    kind_flag: bool,
    /// (name_off, type id, bit offset) for struct/union members.
    members: Vec<(u32, u32, u32)>,
}

/// Parsed BTF blob.
#[derive(Debug)]
pub struct Btf {
    types: Vec<Ty>,
    strings: Vec<u8>,
}

fn err(msg: impl Into<String>) -> ProbeError {
    ProbeError::Offsets(format!("BTF: {}", msg.into()))
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, ProbeError> {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| err(format!("truncated at byte {off}")))
}

impl Btf {
    /// Reads `/sys/kernel/btf/vmlinux`.
    pub fn from_sys_fs() -> Result<Self, ProbeError> {
        let b = std::fs::read("/sys/kernel/btf/vmlinux").map_err(|e| {
            err(format!(
                "reading /sys/kernel/btf/vmlinux: {e} (kernel without CONFIG_DEBUG_INFO_BTF?)"
            ))
        })?;
        Self::parse(&b)
    }

    /// Parses a little-endian BTF blob.
    pub fn parse(b: &[u8]) -> Result<Self, ProbeError> {
        if b.len() < 24 {
            return Err(err("shorter than the header"));
        }
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != BTF_MAGIC {
            return Err(err(format!(
                "bad magic {magic:#x}, expected {BTF_MAGIC:#x}"
            )));
        }
        let hdr_len = u32_at(b, 4)? as usize;
        let type_off = u32_at(b, 8)? as usize;
        let type_len = u32_at(b, 12)? as usize;
        let str_off = u32_at(b, 16)? as usize;
        let str_len = u32_at(b, 20)? as usize;
        let tstart = hdr_len + type_off;
        let tend = tstart + type_len;
        let sstart = hdr_len + str_off;
        let strings = b
            .get(sstart..sstart + str_len)
            .ok_or_else(|| err("string section out of bounds"))?
            .to_vec();
        let tsec = b
            .get(tstart..tend)
            .ok_or_else(|| err("type section out of bounds"))?;
        // id 0 is void
        let mut types = vec![Ty {
            kind: 0,
            name_off: 0,
            kind_flag: false,
            members: Vec::new(),
        }];
        let mut p = 0usize;
        while p + 12 <= tsec.len() {
            let name_off = u32_at(tsec, p)?;
            let info = u32_at(tsec, p + 4)?;
            p += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut members = Vec::new();
            let extra = match kind {
                1 => 4,  // INT
                3 => 12, // ARRAY
                4 | 5 => {
                    for i in 0..vlen {
                        let m = p + i * 12;
                        members.push((
                            u32_at(tsec, m)?,
                            u32_at(tsec, m + 4)?,
                            u32_at(tsec, m + 8)?,
                        ));
                    }
                    vlen * 12
                }
                6 => vlen * 8,   // ENUM
                13 => vlen * 8,  // FUNC_PROTO
                14 => 4,         // VAR
                15 => vlen * 12, // DATASEC
                17 => 4,         // DECL_TAG
                19 => vlen * 12, // ENUM64
                2 | 7..=12 | 16 | 18 => 0,
                k => return Err(err(format!("unknown kind {k} at type {}", types.len()))),
            };
            p += extra;
            types.push(Ty {
                kind,
                name_off,
                kind_flag,
                members,
            });
        }
        Ok(Self { types, strings })
    }

    fn name(&self, off: u32) -> &str {
        let s = self.strings.get(off as usize..).unwrap_or(&[]);
        let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
        std::str::from_utf8(&s[..end]).unwrap_or("")
    }

    /// Byte offset of `member` in `struct struct_name` (first struct of that
    /// name), searching anonymous struct/union members recursively.
    pub fn member_offset(&self, struct_name: &str, member: &str) -> Result<u32, ProbeError> {
        let id = self
            .types
            .iter()
            .position(|t| t.kind == KIND_STRUCT && self.name(t.name_off) == struct_name)
            .ok_or_else(|| err(format!("no struct `{struct_name}`")))?;
        self.find_in(id, member, 0, 0)
            .map(|bits| bits / 8)
            .ok_or_else(|| err(format!("struct `{struct_name}` has no member `{member}`")))
    }

    fn find_in(&self, id: usize, member: &str, base_bits: u32, depth: u32) -> Option<u32> {
        if depth > 8 {
            return None;
        }
        let t = self.types.get(id)?;
        for &(name_off, ty, off) in &t.members {
            let bits = if t.kind_flag { off & 0x00ff_ffff } else { off };
            let name = self.name(name_off);
            if name == member {
                return Some(base_bits + bits);
            }
            if name.is_empty() {
                // anonymous members point straight at a struct or union
                let inner = ty as usize;
                if let Some(k) = self.types.get(inner).map(|t| t.kind)
                    && (k == KIND_STRUCT || k == KIND_UNION)
                    && let Some(found) = self.find_in(inner, member, base_bits + bits, depth + 1)
                {
                    return Some(found);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds BTF: struct outer { int a; union { int x; struct { int y; int z; }; }; }
    fn synthetic() -> Vec<u8> {
        let strings = b"\0int\0outer\0a\0x\0y\0z\0".to_vec();
        let s = |n: &str| {
            let pos = strings
                .windows(n.len() + 2)
                .position(|w| w[0] == 0 && &w[1..=n.len()] == n.as_bytes() && w[n.len() + 1] == 0)
                .unwrap();
            (pos + 1) as u32
        };
        let mut t: Vec<u8> = Vec::new();
        let mut push = |v: u32| t.extend_from_slice(&v.to_le_bytes());
        // 1: int
        push(s("int"));
        push(1 << 24);
        push(4);
        push(32);
        // 2: anon struct { y @0, z @32 }
        push(0);
        push((4 << 24) | 2);
        push(8);
        push(s("y"));
        push(1);
        push(0);
        push(s("z"));
        push(1);
        push(32);
        // 3: anon union { x @0, <anon 2> @0 }
        push(0);
        push((5 << 24) | 2);
        push(8);
        push(s("x"));
        push(1);
        push(0);
        push(0);
        push(2);
        push(0);
        // 4: struct outer { a @0, <anon 3> @64 }
        push(s("outer"));
        push((4 << 24) | 2);
        push(16);
        push(s("a"));
        push(1);
        push(0);
        push(0);
        push(3);
        push(64);
        let mut b = Vec::new();
        b.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        b.push(1);
        b.push(0);
        b.extend_from_slice(&24u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(t.len() as u32).to_le_bytes());
        b.extend_from_slice(&(t.len() as u32).to_le_bytes());
        b.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        b.extend_from_slice(&t);
        b.extend_from_slice(&strings);
        b
    }

    #[test]
    fn finds_nested_members() {
        let btf = Btf::parse(&synthetic()).unwrap();
        assert_eq!(btf.member_offset("outer", "a").unwrap(), 0);
        assert_eq!(btf.member_offset("outer", "x").unwrap(), 8);
        assert_eq!(btf.member_offset("outer", "z").unwrap(), 12);
        assert!(
            btf.member_offset("outer", "w")
                .unwrap_err()
                .to_string()
                .contains("`w`")
        );
        assert!(btf.member_offset("nope", "a").is_err());
    }

    #[test]
    fn rejects_garbage() {
        assert!(Btf::parse(&[0u8; 30]).is_err());
    }

    #[test]
    fn reads_vmlinux_sock_common_when_present() {
        let Ok(btf) = Btf::from_sys_fs() else { return };
        // skc_daddr is the first field of struct sock_common on every kernel
        assert_eq!(btf.member_offset("sock_common", "skc_daddr").unwrap(), 0);
        let num = btf.member_offset("sock_common", "skc_num").unwrap();
        let dport = btf.member_offset("sock_common", "skc_dport").unwrap();
        assert_eq!(num, dport + 2);
    }
}
