//! The emulated device memory: host memory, each allocation between two guard zones (redzones) filled with a pattern
//! and its contents poisoned. After every launch the guard zones of every live allocation are checked: a kernel that
//! wrote outside a buffer is reported by name (the host-side memcheck; reads outside are not caught). Poison is
//! 0xFF bytes, a NaN in f32, bf16 and f16 and -1 as an integer, so output a kernel forgot to write shows.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::cuda::device::DevicePtr;
use crate::error::{KernelError, Result};
use crate::view::Memory;

/// Bytes of guard zone before each allocation; after it, the rest of its last 256-byte granule plus as many again.
pub(super) const REDZONE: usize = 256;
/// Allocations are 256-byte aligned, as cudaMalloc's (and the pool's contract in device.rs).
const ALIGN: usize = 256;
const GUARD_BYTE: u8 = 0xfd;
const POISON_BYTE: u8 = 0xff;

/// The backend's name in errors.
pub(super) const BACKEND: &str = "cuda emulator";

struct Allocation {
    /// Start of the host block (the front guard zone); the user's pointer is `base + REDZONE`.
    base: usize,
    layout: Layout,
    /// Bytes asked for.
    bytes: usize,
}

impl Allocation {
    fn user(&self) -> usize {
        self.base + REDZONE
    }
    /// The guard zones: (offset from the user pointer, bytes), before and after.
    fn zones(&self) -> [(isize, usize); 2] {
        [(-(REDZONE as isize), REDZONE), (self.bytes as isize, self.layout.size() - REDZONE - self.bytes)]
    }
    /// The first guard byte overwritten, as an offset from the user pointer, with the count of bad bytes; repairs
    /// the zones so that one bad write is reported once.
    fn check_and_repair(&self) -> Option<(isize, usize)> {
        let mut found = None;
        for (offset, len) in self.zones() {
            let start = (self.user() as isize + offset) as usize;
            // SAFETY: the zones lie within this live allocation of `layout.size()` bytes from `base`.
            let zone = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, len) };
            let bad = zone.iter().filter(|&&b| b != GUARD_BYTE).count();
            if bad > 0 {
                let first = zone.iter().position(|&b| b != GUARD_BYTE).unwrap_or(0);
                found.get_or_insert((offset + first as isize, bad));
                zone.fill(GUARD_BYTE);
            }
        }
        found
    }
}

/// Live allocations by user pointer, within an optional capacity.
#[derive(Default)]
pub(super) struct DeviceMemory {
    allocs: Mutex<BTreeMap<usize, Allocation>>,
    /// The most bytes live at once (`None`: what the machine has), so that a device running out of memory can be
    /// tested without a GPU: `$LONGCTX_EMULATED_MEMORY` (see [`capacity_from_env`]).
    capacity: Option<usize>,
}

/// `$LONGCTX_EMULATED_MEMORY`: the emulated device's memory, in bytes or with a `K`, `M` or `G` suffix (binary:
/// `64M` is 64 MiB); unset or unreadable, no limit but the machine's.
pub(super) fn capacity_from_env() -> Option<usize> {
    parse_capacity(&std::env::var("LONGCTX_EMULATED_MEMORY").ok()?)
}

fn parse_capacity(v: &str) -> Option<usize> {
    let v = v.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, shift) = match v.char_indices().last()? {
        (i, 'K' | 'k') => (&v[..i], 10),
        (i, 'M' | 'm') => (&v[..i], 20),
        (i, 'G' | 'g') => (&v[..i], 30),
        _ => (v, 0),
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(1 << shift)
}

impl DeviceMemory {
    /// Memory of at most `capacity` live bytes (`None`: the machine's).
    pub(super) fn with_capacity(capacity: Option<usize>) -> Self {
        Self { allocs: Mutex::default(), capacity }
    }

    /// The capacity, if one was set.
    pub(super) fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// `bytes` of poisoned memory, 256-byte aligned, between guard zones.
    pub fn alloc(&self, bytes: usize) -> Result<DevicePtr> {
        let oom = || KernelError::OutOfMemory { memory: Memory::Cuda { ordinal: 0 }, bytes, free: physical_memory() };
        // More than the machine has would only be found out by the OOM killer while poisoning it.
        if bytes > physical_memory() {
            return Err(oom());
        }
        if let Some(cap) = self.capacity {
            let used = self.used();
            if used.saturating_add(bytes) > cap {
                return Err(KernelError::OutOfMemory {
                    memory: Memory::Cuda { ordinal: 0 },
                    bytes,
                    free: cap - used.min(cap),
                });
            }
        }
        let total = bytes.checked_next_multiple_of(ALIGN).and_then(|b| b.checked_add(2 * REDZONE)).ok_or_else(oom)?;
        let layout = Layout::from_size_align(total, ALIGN).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size (at least two redzones).
        let base = unsafe { std::alloc::alloc(layout) };
        if base.is_null() {
            return Err(oom());
        }
        // SAFETY: `base` holds `total` bytes.
        unsafe {
            std::ptr::write_bytes(base, GUARD_BYTE, total);
            std::ptr::write_bytes(base.add(REDZONE), POISON_BYTE, bytes);
        }
        let a = Allocation { base: base as usize, layout, bytes };
        let user = a.user();
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(user, a);
        Ok(user as DevicePtr)
    }

    /// Frees `ptr`, reporting a guard zone overwritten since the last check (e.g. by a host copy).
    ///
    /// # Safety
    /// Nothing uses `ptr` any more (no launch running on it).
    pub unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        let a = self.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&(ptr as usize)).ok_or_else(|| {
            KernelError::Device {
                backend: BACKEND,
                op: "free".into(),
                why: format!("{ptr:#x} is not a live allocation (freed twice, or never allocated here)"),
            }
        })?;
        let damage = a.check_and_repair();
        // SAFETY: `base` came from `alloc` with this layout and is removed from the map, so freed once.
        unsafe { std::alloc::dealloc(a.base as *mut u8, a.layout) };
        match damage {
            None => Ok(()),
            Some(d) => Err(KernelError::Device {
                backend: BACKEND,
                op: "free".into(),
                why: format!("something wrote outside the buffer {ptr:#x}: {}", describe(a.bytes, d)),
            }),
        }
    }

    /// Checks every live allocation's guard zones after `kernel` ran.
    pub fn check_guards(&self, kernel: &str) -> Result<()> {
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let mut bad = Vec::new();
        for a in allocs.values() {
            if let Some(d) = a.check_and_repair() {
                bad.push(format!("buffer {:#x}: {}", a.user(), describe(a.bytes, d)));
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        Err(KernelError::Device {
            backend: BACKEND,
            op: format!("kernel `{kernel}`"),
            why: format!("wrote outside a buffer: {}", bad.join("; ")),
        })
    }

    /// Whether `[ptr, ptr + bytes)` lies within one live allocation.
    pub fn check_range(&self, ptr: DevicePtr, bytes: usize, op: &str) -> Result<()> {
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let p = ptr as usize;
        let inside = allocs
            .range(..=p)
            .next_back()
            .is_some_and(|(&start, a)| p.checked_add(bytes).is_some_and(|end| end <= start + a.bytes));
        if inside {
            Ok(())
        } else {
            Err(KernelError::Device {
                backend: BACKEND,
                op: op.into(),
                why: format!("{bytes} bytes at {ptr:#x} are not within one live allocation"),
            })
        }
    }

    /// Bytes allocated and live.
    pub fn used(&self) -> usize {
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).values().map(|a| a.bytes).sum()
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let allocs = std::mem::take(self.allocs.get_mut().unwrap_or_else(|e| e.into_inner()));
        for a in allocs.into_values() {
            // SAFETY: each allocation came from `alloc` with its layout; dropping the memory ends every use.
            unsafe { std::alloc::dealloc(a.base as *mut u8, a.layout) };
        }
    }
}

fn describe(bytes: usize, (offset, count): (isize, usize)) -> String {
    if offset < 0 {
        format!("{count} bytes overwritten in the guard zone before its start (the first at byte {offset})")
    } else {
        format!("{count} bytes overwritten past its end of {bytes} bytes (the first at byte {offset})")
    }
}

/// The machine's physical memory, bytes.
fn physical_memory() -> usize {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || page <= 0 {
        usize::MAX
    } else {
        (pages as usize).saturating_mul(page as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capacity_is_bytes_or_binary_units_and_bounds_what_is_live() {
        for (text, want) in [
            ("4096", Some(4096)),
            ("64M", Some(64 << 20)),
            ("2GiB", Some(2 << 30)),
            ("1k", Some(1024)),
            ("x", None),
            ("", None),
        ] {
            assert_eq!(super::parse_capacity(text), want, "{text:?}");
        }
        let m = DeviceMemory::with_capacity(Some(4096));
        let a = m.alloc(3000).unwrap();
        match m.alloc(2000) {
            Err(KernelError::OutOfMemory { bytes: 2000, free: 1096, .. }) => {}
            other => panic!("{other:?}"),
        }
        // SAFETY: allocated above, unused.
        unsafe { m.free(a) }.unwrap();
        let b = m.alloc(4096).unwrap();
        // SAFETY: as above.
        unsafe { m.free(b) }.unwrap();
    }

    #[test]
    fn guard_zones_catch_writes_on_either_side() {
        let m = DeviceMemory::default();
        let p = m.alloc(100).unwrap();
        assert_eq!(p % 256, 0);
        m.check_range(p, 100, "copy").unwrap();
        assert!(m.check_range(p, 101, "copy").is_err());
        // SAFETY: within the allocation and its guard zones.
        unsafe {
            let b = p as *mut u8;
            assert_eq!(*b, POISON_BYTE);
            *b.add(99) = 0;
            m.check_guards("none").unwrap();
            *b.add(100) = 0;
        }
        let e = m.check_guards("k").unwrap_err().to_string();
        assert!(e.contains("kernel `k`") && e.contains("past its end of 100 bytes (the first at byte 100)"), "{e}");
        // Repaired: reported once.
        m.check_guards("k").unwrap();
        // SAFETY: the byte before the start is in the front guard zone; nothing else uses `p`, freed (twice) here.
        let (first, second) = unsafe {
            *(p as *mut u8).sub(1) = 0;
            (m.free(p), m.free(p))
        };
        let e = first.unwrap_err().to_string();
        assert!(e.contains("before its start (the first at byte -1)"), "{e}");
        assert!(second.unwrap_err().to_string().contains("not a live allocation"));
        assert!(matches!(m.alloc(usize::MAX), Err(KernelError::OutOfMemory { .. })));
        assert_eq!(m.used(), 0);
    }
}
