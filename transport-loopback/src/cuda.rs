//! GPU copies through cudarc, with the driver loaded at run time.
//!
//! cudarc's dynamic loader panics when `libcuda` is missing, so the driver library is first
//! probed with `libloading`; only when it opens is cudarc touched. Everything is gated by
//! [`available`], which answers once per process.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;

/// `Ok(device count)` when a CUDA driver and at least one device exist, else why not.
pub fn available() -> Result<u32, String> {
    static PROBE: OnceLock<Result<u32, String>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<u32, String> {
    let names = ["libcuda.so.1", "libcuda.so"];
    // SAFETY: loading the CUDA driver library runs its initialisers, which is what any CUDA
    // program does; the handle is dropped right after, cudarc loads it again for itself.
    let opened = names
        .iter()
        .any(|n| unsafe { libloading::Library::new(n) }.is_ok());
    if !opened {
        return Err("no CUDA driver library (libcuda.so.1) could be loaded".into());
    }
    cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let count =
        CudaContext::device_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
    if count <= 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(count as u32)
}

/// The process's contexts.
pub fn contexts() -> &'static Contexts {
    static CTX: OnceLock<Contexts> = OnceLock::new();
    CTX.get_or_init(Contexts::default)
}

/// Primary contexts per device, shared by the copy workers.
#[derive(Default)]
pub struct Contexts(Mutex<Vec<Option<Arc<CudaContext>>>>);

impl Contexts {
    fn get(&self, device: u32) -> Result<Arc<CudaContext>, String> {
        let mut ctxs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = device as usize;
        if ctxs.len() <= i {
            ctxs.resize(i + 1, None);
        }
        if let Some(c) = &ctxs[i] {
            return Ok(Arc::clone(c));
        }
        let ctx =
            CudaContext::new(i).map_err(|e| format!("cannot open CUDA device {device}: {e:?}"))?;
        ctxs[i] = Some(Arc::clone(&ctx));
        Ok(ctx)
    }

    /// Copies `len` bytes between any mix of host and device pointers (unified addressing
    /// infers the direction), in `device`'s context on the calling thread.
    ///
    /// # Safety
    /// Both ranges must be valid, registered memory for the duration of the call.
    pub unsafe fn copy(&self, device: u32, dst: u64, src: u64, len: u64) -> Result<(), String> {
        let ctx = self.get(device)?;
        ctx.bind_to_thread()
            .map_err(|e| format!("cannot bind CUDA context: {e:?}"))?;
        // SAFETY: the caller guarantees both ranges; cuMemcpy is synchronous.
        unsafe { cudarc::driver::sys::cuMemcpy(dst, src, len as usize) }
            .result()
            .map_err(|e| format!("cuMemcpy of {len} bytes failed: {e:?}"))
    }
}
