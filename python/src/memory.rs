//! What Python hands us as memory: an address and a length, or an object with `data_ptr()`
//! (a torch tensor) or `__array_interface__` (a numpy array), and the check that a host
//! range is mapped before any transport touches it — so a wrong address is an exception,
//! never a crash of the interpreter.

use kvxfer_core::AddrRange;
use pyo3::prelude::*;

use crate::errors::{InvalidArgumentError, InvalidMemoryError};

/// Objects whose memory a worker or push rank uses, kept alive as long as it lives (its
/// registrations and advertised regions go first: the field is declared after the worker).
pub type Kept = Vec<Py<PyAny>>;

/// The start of `obj` as a base of `len` bytes: an integer address as it is (the caller
/// keeps that memory alive), or an object with `data_ptr()` / `__array_interface__`,
/// refused if it says it holds fewer bytes, and kept in `keep` so the memory cannot be
/// freed while registered.
pub fn base_of(obj: &Bound<'_, PyAny>, len: u64, keep: &mut Kept) -> PyResult<u64> {
    let (range, is_object) = object_range(obj, Some(len))?;
    if is_object {
        keep.push(obj.clone().unbind());
    }
    Ok(range.addr)
}

/// The start address and length of `obj` in bytes; `length` overrides the object's own size
/// (needed for a raw integer address).
pub fn object_range(obj: &Bound<'_, PyAny>, length: Option<u64>) -> PyResult<(AddrRange, bool)> {
    if let Ok(addr) = obj.extract::<u64>() {
        let len = length.ok_or_else(|| {
            InvalidArgumentError::new_err("a raw address needs an explicit length")
        })?;
        return Ok((AddrRange::new(addr, len), false));
    }
    let addr: u64 = if obj.hasattr("data_ptr")? {
        obj.call_method0("data_ptr")?.extract()?
    } else if let Ok(iface) = obj.getattr("__array_interface__") {
        iface.get_item("data")?.get_item(0)?.extract()?
    } else {
        return Err(InvalidArgumentError::new_err(
            "expected an address, or an object with data_ptr() or __array_interface__",
        ));
    };
    let own: Option<u64> = obj.getattr("nbytes").ok().and_then(|n| n.extract().ok());
    let len = match (length, own) {
        (Some(l), Some(n)) if l > n => {
            return Err(InvalidArgumentError::new_err(format!(
                "length {l} exceeds the object's {n} bytes"
            )));
        }
        (Some(l), _) => l,
        (None, Some(n)) => n,
        (None, None) => {
            return Err(InvalidArgumentError::new_err(
                "the object has no nbytes: pass length",
            ));
        }
    };
    Ok((AddrRange::new(addr, len), true))
}

/// Checks that `[addr, addr + len)` is mapped readable and writable in this process, from
/// `/proc/self/maps` (adjacent mappings may together cover it).
pub fn check_host_mapped(range: AddrRange) -> PyResult<()> {
    if range.len == 0 {
        return Err(InvalidMemoryError::new_err("empty range"));
    }
    let end = range
        .end()
        .ok_or_else(|| InvalidMemoryError::new_err("range wraps the address space"))?;
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| InvalidMemoryError::new_err(format!("cannot read /proc/self/maps: {e}")))?;
    let mut at = range.addr;
    // The file lists mappings in address order.
    for line in maps.lines() {
        let Some((lo, hi, perms)) = parse_line(line) else {
            continue;
        };
        if hi <= at || lo > at {
            continue;
        }
        if !perms.starts_with("rw") {
            return Err(InvalidMemoryError::new_err(format!(
                "{at:#x} is mapped {perms}, not read-write"
            )));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    Err(InvalidMemoryError::new_err(format!(
        "{:#x}+{} is not mapped in this process (from {at:#x} on)",
        range.addr, range.len
    )))
}

fn parse_line(line: &str) -> Option<(u64, u64, &str)> {
    let mut fields = line.split_whitespace();
    let (lo, hi) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    Some((
        u64::from_str_radix(lo, 16).ok()?,
        u64::from_str_radix(hi, 16).ok()?,
        perms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        assert_eq!(
            parse_line("7f00-7f80 rw-p 00000000 00:00 0"),
            Some((0x7f00, 0x7f80, "rw-p"))
        );
        assert_eq!(parse_line("garbage"), None);
        assert_eq!(parse_line("zz-10 rw-p"), None);
    }

    #[test]
    fn mapped_heap_passes_and_unmapped_fails() {
        let v = vec![0u8; 1 << 20];
        let r = AddrRange::new(v.as_ptr() as u64, v.len() as u64);
        Python::initialize();
        assert!(check_host_mapped(r).is_ok());
        assert!(check_host_mapped(AddrRange::new(8, 8)).is_err());
        assert!(check_host_mapped(AddrRange::new(u64::MAX - 4, 8)).is_err());
        assert!(check_host_mapped(AddrRange::new(r.addr, 0)).is_err());
    }
}
