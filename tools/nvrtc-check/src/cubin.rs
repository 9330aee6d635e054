//! What a compiled kernel needs of the GPU, read from the cubin NVRTC
//! produced: registers per thread and the per-thread stack frame (local
//! memory: arrays the compiler could not keep in registers, and spills).
//! These decide occupancy, and a frame that grows is usually a spill, so the
//! figures say something about a kernel's speed with no GPU at hand.
//!
//! A cubin is an ELF64 file. Its `.nv.info` sections hold attribute records
//! `(format: u8, attribute: u8, size: u16, value)`; with format 4
//! (`EIFMT_SVAL`) the value is `size` bytes, for the two attributes read here
//! a `(symbol index: u32, value: u32)` pair naming the kernel through the
//! ELF symbol table: `EIATTR_REGCOUNT` (0x2f) and `EIATTR_FRAME_SIZE` (0x11).
//! Attribute numbers as in the CUDA binary utilities' documentation and
//! every open cubin reader; an unknown layout yields no rows, never a wrong
//! one (every read is bounds-checked).

use std::collections::BTreeMap;

const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_REGCOUNT: u8 = 0x2f;
const EIFMT_SVAL: u8 = 4;
const SHT_SYMTAB: u32 = 2;

/// Registers and stack frame of one kernel.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub registers: Option<u32>,
    pub frame_bytes: Option<u32>,
}

fn u16_at(d: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(d.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(d: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(d: &[u8], o: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(d.get(o..o + 8)?.try_into().ok()?)).ok()
}
fn c_str(d: &[u8], o: usize) -> Option<&str> {
    let rest = d.get(o..)?;
    let end = rest.iter().position(|&b| b == 0)?;
    std::str::from_utf8(&rest[..end]).ok()
}

struct Section {
    name: u32,
    kind: u32,
    offset: usize,
    size: usize,
    link: u32,
}

/// Each kernel (function symbol named in a `.nv.info` record) and what it
/// needs, by name; `None` if `image` is not a 64-bit little-endian ELF.
pub fn resources(image: &[u8]) -> Option<BTreeMap<String, Resources>> {
    if image.get(0..4)? != b"\x7fELF" || *image.get(4)? != 2 || *image.get(5)? != 1 {
        return None;
    }
    let shoff = u64_at(image, 0x28)?;
    let (shentsize, shnum, shstrndx) = (
        usize::from(u16_at(image, 0x3a)?),
        usize::from(u16_at(image, 0x3c)?),
        usize::from(u16_at(image, 0x3e)?),
    );
    let sections: Vec<Section> = (0..shnum)
        .map(|i| {
            let o = shoff + i * shentsize;
            Some(Section {
                name: u32_at(image, o)?,
                kind: u32_at(image, o + 4)?,
                offset: u64_at(image, o + 0x18)?,
                size: u64_at(image, o + 0x20)?,
                link: u32_at(image, o + 0x28)?,
            })
        })
        .collect::<Option<_>>()?;
    let names = sections.get(shstrndx)?;
    let section_name = |s: &Section| c_str(image, names.offset + s.name as usize);
    let symtab = sections.iter().find(|s| s.kind == SHT_SYMTAB)?;
    let strtab = sections.get(symtab.link as usize)?;
    let symbol = |index: u32| {
        let o = symtab.offset + index as usize * 24;
        if (index as usize + 1) * 24 > symtab.size {
            return None;
        }
        c_str(image, strtab.offset + u32_at(image, o)? as usize)
    };
    let mut out: BTreeMap<String, Resources> = BTreeMap::new();
    for s in &sections {
        if !section_name(s).is_some_and(|n| n.starts_with(".nv.info")) {
            continue;
        }
        let data = image.get(s.offset..s.offset + s.size)?;
        let mut o = 0;
        while o + 4 <= data.len() {
            let (format, attr) = (data[o], data[o + 1]);
            let size = usize::from(u16_at(data, o + 2)?);
            if format != EIFMT_SVAL {
                // Other formats hold at most a 16-bit value after the header.
                o += if format == 1 { 2 } else { 4 };
                continue;
            }
            let value = data.get(o + 4..o + 4 + size)?;
            o += 4 + size;
            if (attr == EIATTR_REGCOUNT || attr == EIATTR_FRAME_SIZE) && size == 8 {
                let (sym, v) = (u32_at(value, 0)?, u32_at(value, 4)?);
                let Some(name) = symbol(sym) else { continue };
                let r = out.entry(name.to_string()).or_default();
                if attr == EIATTR_REGCOUNT {
                    r.registers = Some(v);
                } else {
                    r.frame_bytes = Some(v);
                }
            }
        }
    }
    // Kernels only: entries with a register count (helper functions such as
    // the division slow path carry a frame size alone).
    out.retain(|_, r| r.registers.is_some());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made ELF with one `.nv.info` section naming symbol 1 (`k`):
    /// 40 registers, a 16-byte frame, and a record of another format.
    #[test]
    fn reads_registers_and_frame_by_kernel_name() {
        let strtab = b"\0k\0".to_vec();
        let shstr = b"\0.symtab\0.strtab\0.shstrtab\0.nv.info\0".to_vec();
        let mut symtab = vec![0u8; 48];
        symtab[24..28].copy_from_slice(&1u32.to_le_bytes()); // symbol 1's name: "k"
        let mut info = vec![1u8, 0x05]; // format 1: two bytes
        for (attr, v) in [(EIATTR_REGCOUNT, 40u32), (EIATTR_FRAME_SIZE, 16)] {
            info.extend_from_slice(&[EIFMT_SVAL, attr, 8, 0]);
            info.extend_from_slice(&1u32.to_le_bytes());
            info.extend_from_slice(&v.to_le_bytes());
        }
        let blobs = [symtab, strtab, shstr, info];
        let mut image = vec![0u8; 64];
        let mut offsets = vec![];
        for b in &blobs {
            offsets.push(image.len());
            image.extend_from_slice(b);
        }
        let shoff = image.len();
        // Sections: null, .symtab (link 2), .strtab, .shstrtab, .nv.info.
        let sec = |name: u32, kind: u32, i: usize, link: u32| {
            let mut h = vec![0u8; 64];
            h[0..4].copy_from_slice(&name.to_le_bytes());
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(offsets[i] as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(blobs[i].len() as u64).to_le_bytes());
            h[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
            h
        };
        image.extend_from_slice(&[0u8; 64]);
        image.extend(sec(1, SHT_SYMTAB, 0, 2));
        image.extend(sec(9, 3, 1, 0));
        image.extend(sec(17, 3, 2, 0));
        image.extend(sec(27, 0x7000_0000, 3, 0));
        image[0..6].copy_from_slice(b"\x7fELF\x02\x01");
        image[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        image[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        image[0x3c..0x3e].copy_from_slice(&5u16.to_le_bytes());
        image[0x3e..0x40].copy_from_slice(&3u16.to_le_bytes());
        let r = resources(&image).expect("an ELF");
        assert_eq!(
            r.get("k"),
            Some(&Resources {
                registers: Some(40),
                frame_bytes: Some(16)
            })
        );
        assert!(resources(b"not an elf").is_none());
        assert!(resources(&image[..100]).is_none());
    }
}
