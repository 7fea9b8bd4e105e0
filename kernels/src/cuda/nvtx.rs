//! [`NvtxPool`]: a KV pool's pages described to NVIDIA's compute-sanitizer
//! through the NVTX memory API (feature `nvtx`), a second witness that
//! needs no kvsan check at all.
//!
//! An engine's KV pool is one large device allocation, so compute-sanitizer
//! sees every byte of it as valid whatever the engine does with its pages.
//! Registered this way, it sees what the sanitizer sees:
//!
//! ```text
//!  device memory   | plane 0: page 0 | page 1 | page 2 | ... |      one NVTX heap per allocation
//!                  |          (held)   (free)   (held)             (sub-allocator)
//!  NVTX regions        [region]                 [region]           one per held page and plane,
//!                       "kvsan page 0 gen 3      "… page 2 …"      named by page, generation
//!                        request 7"                                and request
//!
//!  memcheck:   a kernel access to a byte no region covers (a free page, a
//!              page freed since the block table was built) is an error
//!  bind():     a permissions object bound to the CUDA work this thread
//!              enqueues: the holders' pages read-write, every other held
//!              page no access — a kernel of one request touching another
//!              request's page is an error
//! ```
//!
//! A page is a region while the sanitizer's record says it is held: owned
//! (shared or not) or receiving. [`NvtxPool::sync`] brings the regions in
//! step with the kernel shadow for the pages a hook touched; [`NvtxPool::hold`]
//! and [`NvtxPool::release`] do it by hand for an engine that keeps its own
//! books.
//!
//! Planes: a page may be several byte ranges (vLLM keeps a K and a V tensor
//! per layer: 2 × layers planes). Plane `i`'s page `p` is
//! `[base + p·page_stride, + page_bytes)`; each plane's extent is a heap,
//! overlapping extents merged into one (interleaved K and V of one tensor).
//!
//! Without a tool attached (no `NVTX_INJECTION64_PATH`, which
//! compute-sanitizer sets) NVTX answers no heap, and every call here returns
//! at once having done nothing but its bookkeeping.

use std::ffi::{CString, c_char, c_void};
use std::ptr::NonNull;

use kvsan_ids::{Generation, PageId, RequestId};
use kvsan_sanitizer::KernelShadow;
use kvsan_sanitizer::shadow::{PageState, StateWord};

use super::error::CudaError;

// The C side: src/cuda/nvtx.c, compiled against the NVTX3 headers by build.rs.
unsafe extern "C" {
    fn kvsan_nvtx_domain_create(name: *const c_char) -> *mut c_void;
    fn kvsan_nvtx_domain_destroy(domain: *mut c_void);
    fn kvsan_nvtx_heap_register(
        domain: *mut c_void,
        base: u64,
        bytes: u64,
        name: *const c_char,
    ) -> *mut c_void;
    fn kvsan_nvtx_heap_unregister(domain: *mut c_void, heap: *mut c_void);
    fn kvsan_nvtx_regions_register(
        domain: *mut c_void,
        heap: *mut c_void,
        starts: *const u64,
        sizes: *const u64,
        n: usize,
    );
    fn kvsan_nvtx_regions_unregister(domain: *mut c_void, starts: *const u64, n: usize);
    fn kvsan_nvtx_regions_name(
        domain: *mut c_void,
        starts: *const u64,
        names: *const *const c_char,
        n: usize,
    );
    fn kvsan_nvtx_permissions_create(domain: *mut c_void) -> *mut c_void;
    fn kvsan_nvtx_permissions_assign(
        domain: *mut c_void,
        permissions: *mut c_void,
        starts: *const u64,
        flags: *const u32,
        n: usize,
    );
    fn kvsan_nvtx_permissions_bind_stream(domain: *mut c_void, permissions: *mut c_void);
    fn kvsan_nvtx_permissions_unbind_stream(domain: *mut c_void);
    fn kvsan_nvtx_permissions_destroy(domain: *mut c_void, permissions: *mut c_void);
}

/// `NVTX_MEM_PERMISSIONS_REGION_FLAGS_NONE`.
const PERMISSION_NONE: u32 = 0x0;
/// `NVTX_MEM_PERMISSIONS_REGION_FLAGS_READ | _WRITE`.
const PERMISSION_READ_WRITE: u32 = 0x1 | 0x2;

/// Where one plane of a pool's pages lies in device memory: page `p` is
/// `[base + p·page_stride, base + p·page_stride + page_bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvtxPlane {
    /// Device address of page 0.
    pub base: u64,
    /// Bytes from one page to the next.
    pub page_stride: u64,
    /// Bytes of one page in this plane.
    pub page_bytes: u64,
}

/// Who holds a registered page: what its region is named after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvtxHolder {
    /// The holding request.
    pub owner: RequestId,
    /// The page's generation when it was registered.
    pub generation: Generation,
}

/// What [`NvtxPool::sync`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvtxSync {
    /// Pages registered (newly held, or held again in a new generation).
    pub registered: usize,
    /// Pages unregistered (no longer held).
    pub unregistered: usize,
}

struct Heap {
    start: u64,
    end: u64,
    handle: *mut c_void,
}

/// A pool's pages registered with NVTX (see the module doc).
pub struct NvtxPool {
    domain: *mut c_void,
    heaps: Vec<Heap>,
    planes: Vec<NvtxPlane>,
    held: Vec<Option<NvtxHolder>>,
    bound: Option<NonNull<c_void>>,
    attached: bool,
}

impl std::fmt::Debug for NvtxPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvtxPool")
            .field("planes", &self.planes)
            .field("heaps", &self.heaps.len())
            .field("pages", &self.held.len())
            .field("held", &self.held_pages())
            .field("attached", &self.attached)
            .field("bound", &self.bound.is_some())
            .finish()
    }
}

// SAFETY: the handles are opaque values of the NVTX tool, which takes
// calls from any thread; `NvtxPool` has no interior mutability and every
// call that changes it takes `&mut self`.
unsafe impl Send for NvtxPool {}

/// The end of plane `plane`'s extent over `n_pages` pages, checked.
fn plane_end(index: usize, plane: &NvtxPlane, n_pages: usize) -> Result<u64, CudaError> {
    let problem = |problem| CudaError::NvtxPlane {
        plane: index,
        problem,
    };
    if plane.page_bytes == 0 {
        return Err(problem("page_bytes is 0"));
    }
    if plane.page_bytes > plane.page_stride {
        return Err(problem(
            "page_bytes is larger than page_stride: pages would overlap",
        ));
    }
    if plane.base == 0 {
        return Err(problem("base is the null address"));
    }
    let last = u64::try_from(n_pages.saturating_sub(1)).unwrap_or(u64::MAX);
    last.checked_mul(plane.page_stride)
        .and_then(|o| o.checked_add(plane.page_bytes))
        .and_then(|len| plane.base.checked_add(len))
        .ok_or_else(|| problem("the last page ends past the address space"))
}

/// Whether two planes put some page's bytes on the same address.
fn planes_overlap(a: &NvtxPlane, a_end: u64, b: &NvtxPlane, b_end: u64) -> bool {
    if a_end <= b.base || b_end <= a.base {
        return false;
    }
    if a.page_stride != b.page_stride {
        // Interleaving planes must share a stride.
        return true;
    }
    // Same stride: b's pages sit at offset d into a's page period.
    let stride = a.page_stride;
    let d = (b.base.wrapping_sub(a.base)) % stride;
    !(d >= a.page_bytes && stride - d >= b.page_bytes)
}

/// Checks `planes` over `n_pages` pages; returns each plane's end.
fn check_planes(planes: &[NvtxPlane], n_pages: usize) -> Result<Vec<u64>, CudaError> {
    if planes.is_empty() {
        return Err(CudaError::Length {
            what: "NVTX planes of the pool",
            len: 0,
            expected: 1,
        });
    }
    if n_pages == 0 {
        return Err(CudaError::ZeroDimension { what: "n_pages" });
    }
    let ends = planes
        .iter()
        .enumerate()
        .map(|(i, p)| plane_end(i, p, n_pages))
        .collect::<Result<Vec<_>, _>>()?;
    for i in 0..planes.len() {
        for j in i + 1..planes.len() {
            if planes_overlap(&planes[i], ends[i], &planes[j], ends[j]) {
                return Err(CudaError::NvtxPlanesOverlap {
                    first: i,
                    second: j,
                });
            }
        }
    }
    Ok(ends)
}

/// Registers a sub-allocator heap over `[base, base + bytes)` in a fresh
/// domain and unregisters it at once: whether an attached tool accepts
/// such a heap (named after `name`, or unnamed). For diagnosing a tool
/// that refuses [`NvtxPool::new`]'s heaps.
pub fn probe_heap(base: u64, bytes: u64, name: Option<&str>) -> bool {
    let domain_name = c"kvsan NVTX probe";
    let c_name = name.map(|n| CString::new(n).unwrap_or_default());
    let name_ptr = c_name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr());
    // SAFETY: NUL-terminated names (or null) that outlive the calls; the
    // heap, when one comes back, is unregistered in the domain it was
    // registered in, and the domain destroyed last.
    unsafe {
        let domain = kvsan_nvtx_domain_create(domain_name.as_ptr());
        let heap = kvsan_nvtx_heap_register(domain, base, bytes, name_ptr);
        let accepted = !heap.is_null();
        if accepted {
            kvsan_nvtx_heap_unregister(domain, heap);
        }
        kvsan_nvtx_domain_destroy(domain);
        accepted
    }
}

impl NvtxPool {
    /// Describes a pool of `n_pages` pages lying on `planes` to NVTX, under
    /// `name` (the heaps' and domain's name): registers each allocation
    /// as a sub-allocator heap, holding no page yet. Call it once the CUDA
    /// context that owns the memory exists, and drop it before the memory
    /// is freed (a [`super::CudaKvPool`] holds its own: `attach_nvtx`).
    ///
    /// What compute-sanitizer (CUDA 13.0, H200) takes, measured with
    /// `nvtx_witness probe`: a heap over a whole plain allocation
    /// (cuMemAlloc, cudaMalloc), named or not; not one over part of an
    /// allocation, not one over a stream-ordered allocation
    /// (cuMemAllocAsync), and not a second heap over an allocation that had
    /// one. Each refusal is a warning of the tool's, and every later call
    /// of this pool is bookkeeping only ([`NvtxPool::tool_attached`] is
    /// false).
    ///
    /// # Errors
    /// A plane with no bytes per page, pages longer than their stride, a
    /// null base or an extent past the address space; two planes whose
    /// pages overlap; no planes, no pages, or a name with a NUL byte.
    pub fn new(name: &str, planes: &[NvtxPlane], n_pages: usize) -> Result<NvtxPool, CudaError> {
        let ends = check_planes(planes, n_pages)?;
        let mut extents: Vec<(u64, u64)> = planes
            .iter()
            .zip(&ends)
            .map(|(p, &end)| (p.base, end))
            .collect();
        extents.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (start, end) in extents {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        NvtxPool::register(name, planes, n_pages, &merged)
    }

    /// As [`NvtxPool::new`], with the heaps given: `allocations` are the
    /// `(start, bytes)` of the whole allocations that hold the planes (a
    /// tool takes a heap only over a whole allocation, and an engine's
    /// tensor may be part of a larger one: see
    /// [`super::allocation_containing`]). Every plane lies inside one.
    ///
    /// # Errors
    /// As [`NvtxPool::new`], and a plane outside every allocation given.
    pub fn with_heaps(
        name: &str,
        planes: &[NvtxPlane],
        n_pages: usize,
        allocations: &[(u64, u64)],
    ) -> Result<NvtxPool, CudaError> {
        let ends = check_planes(planes, n_pages)?;
        let mut heaps: Vec<(u64, u64)> = allocations
            .iter()
            .map(|&(start, bytes)| (start, start.saturating_add(bytes)))
            .collect();
        heaps.sort_unstable();
        heaps.dedup();
        for (i, (plane, &end)) in planes.iter().zip(&ends).enumerate() {
            if !heaps.iter().any(|&(s, e)| s <= plane.base && end <= e) {
                return Err(CudaError::NvtxPlane {
                    plane: i,
                    problem: "its pages do not lie inside one of the allocations given",
                });
            }
        }
        NvtxPool::register(name, planes, n_pages, &heaps)
    }

    /// Registers one heap per `(start, end)` of `heaps_at` under a new
    /// domain named after `name`.
    fn register(
        name: &str,
        planes: &[NvtxPlane],
        n_pages: usize,
        heaps_at: &[(u64, u64)],
    ) -> Result<NvtxPool, CudaError> {
        let c_name =
            CString::new(format!("kvsan KV pool {name}")).map_err(|_| CudaError::NvtxPlane {
                plane: 0,
                problem: "the pool's name holds a NUL byte",
            })?;
        // SAFETY: `c_name` is a NUL-terminated string that outlives the call.
        let domain = unsafe { kvsan_nvtx_domain_create(c_name.as_ptr()) };
        let mut heaps = Vec::with_capacity(heaps_at.len());
        for &(start, end) in heaps_at {
            // SAFETY: `domain` is the one just created (or null: NVTX's
            // default domain); `c_name` outlives the call.
            let handle =
                unsafe { kvsan_nvtx_heap_register(domain, start, end - start, c_name.as_ptr()) };
            heaps.push(Heap { start, end, handle });
        }
        let attached = heaps.iter().all(|h| !h.handle.is_null());
        Ok(NvtxPool {
            domain,
            heaps,
            planes: planes.to_vec(),
            held: vec![None; n_pages],
            bound: None,
            attached,
        })
    }

    /// Whether a tool (compute-sanitizer, Nsight) took the heaps: without
    /// one, registrations are bookkeeping only.
    pub fn tool_attached(&self) -> bool {
        self.attached
    }

    /// The planes the pool was described with.
    pub fn planes(&self) -> &[NvtxPlane] {
        &self.planes
    }

    /// Pages in the pool.
    pub fn n_pages(&self) -> usize {
        self.held.len()
    }

    /// Who holds `page`, as registered; `None` if it is not a region.
    pub fn holder(&self, page: PageId) -> Option<NvtxHolder> {
        self.held.get(page.0 as usize).copied().flatten()
    }

    /// The registered pages, in order.
    pub fn held_pages(&self) -> Vec<PageId> {
        self.held
            .iter()
            .enumerate()
            .filter(|(_, h)| h.is_some())
            .map(|(p, _)| PageId(p as u32))
            .collect()
    }

    fn index(&self, page: PageId) -> Result<usize, CudaError> {
        let index = page.0 as usize;
        if index < self.held.len() {
            Ok(index)
        } else {
            Err(CudaError::OutOfRange {
                what: "page to register with NVTX",
                value: index,
                limit: self.held.len(),
            })
        }
    }

    /// The start of each plane's bytes of page `index`.
    fn starts(&self, index: usize) -> impl Iterator<Item = u64> + '_ {
        // In range: `plane_end` checked the last page's end.
        self.planes
            .iter()
            .map(move |p| p.base + index as u64 * p.page_stride)
    }

    fn heap_of(&self, start: u64) -> *mut c_void {
        self.heaps
            .iter()
            .find(|h| h.start <= start && start < h.end)
            .map_or(std::ptr::null_mut(), |h| h.handle)
    }

    /// Makes `page` a region (in every plane) held by `holder`, named after
    /// it. Registering it again for the same holder does nothing; for
    /// another holder or generation it is unregistered and registered
    /// again (a new allocation).
    ///
    /// # Errors
    /// A page outside the pool.
    pub fn hold(&mut self, page: PageId, holder: NvtxHolder) -> Result<(), CudaError> {
        let index = self.index(page)?;
        match self.held[index] {
            Some(h) if h == holder => return Ok(()),
            Some(_) => self.unregister_pages(&[index]),
            None => {}
        }
        self.held[index] = Some(holder);
        self.register_pages(&[index]);
        Ok(())
    }

    /// Ends `page`'s regions: a kernel access to it is then a memcheck
    /// error. Releasing a page that is not held does nothing.
    ///
    /// # Errors
    /// A page outside the pool.
    pub fn release(&mut self, page: PageId) -> Result<(), CudaError> {
        let index = self.index(page)?;
        if self.held[index].take().is_some() {
            self.unregister_pages(&[index]);
        }
        Ok(())
    }

    /// Brings `pages`' regions in step with the sanitizer's records in
    /// `host` (the pool's kernel shadow): a page owned or receiving is held
    /// by its owner in its generation; any other is not. Call it after the
    /// hooks that allocate or free those pages.
    ///
    /// # Errors
    /// A page outside the pool or the shadow, or a shadow of another size.
    pub fn sync(
        &mut self,
        host: &KernelShadow<'_>,
        pages: &[PageId],
    ) -> Result<NvtxSync, CudaError> {
        if host.pages() != self.held.len() {
            return Err(CudaError::ShadowGeometry {
                what: "pages",
                shadow: host.pages(),
                other: "NVTX pool",
                expected: self.held.len(),
            });
        }
        let mut indices = pages
            .iter()
            .map(|&p| self.index(p))
            .collect::<Result<Vec<_>, _>>()?;
        indices.sort_unstable();
        indices.dedup();
        let mut out = NvtxSync::default();
        let mut gone = Vec::new();
        let mut new = Vec::new();
        for index in indices {
            let page = PageId(index as u32);
            let (word, owner) = host.record_words(page).ok_or(CudaError::OutOfRange {
                what: "page of the kernel shadow",
                value: index,
                limit: host.pages(),
            })?;
            let word = StateWord(word);
            let now = matches!(word.state(), PageState::Owned | PageState::Receiving).then_some(
                NvtxHolder {
                    owner: RequestId(owner),
                    generation: word.generation(),
                },
            );
            let before = self.held[index];
            if before == now {
                continue;
            }
            if before.is_some() {
                gone.push(index);
                out.unregistered += usize::from(now.is_none());
            }
            self.held[index] = now;
            if now.is_some() {
                new.push(index);
                out.registered += 1;
            }
        }
        self.unregister_pages(&gone);
        self.register_pages(&new);
        Ok(out)
    }

    fn unregister_pages(&mut self, indices: &[usize]) {
        if !self.attached || indices.is_empty() {
            return;
        }
        let starts: Vec<u64> = indices.iter().flat_map(|&i| self.starts(i)).collect();
        // SAFETY: `starts` holds `starts.len()` addresses, each the start of
        // a region registered before (pages enter `held` only through
        // `register_pages`); the domain is this pool's.
        unsafe { kvsan_nvtx_regions_unregister(self.domain, starts.as_ptr(), starts.len()) };
    }

    fn register_pages(&mut self, indices: &[usize]) {
        if !self.attached || indices.is_empty() {
            return;
        }
        let mut by_heap: Vec<(*mut c_void, Vec<u64>, Vec<u64>)> = Vec::new();
        let mut starts = Vec::new();
        let mut names = Vec::new();
        for &i in indices {
            let Some(holder) = self.held[i] else { continue };
            for (plane, start) in self.planes.iter().zip(self.starts(i)) {
                let heap = self.heap_of(start);
                match by_heap.iter_mut().find(|(h, _, _)| *h == heap) {
                    Some((_, s, z)) => {
                        s.push(start);
                        z.push(plane.page_bytes);
                    }
                    None => by_heap.push((heap, vec![start], vec![plane.page_bytes])),
                }
                starts.push(start);
                // Ids and numbers only: never KV contents or prompt text.
                names.push(
                    CString::new(format!(
                        "kvsan page {i} gen {} request {}",
                        holder.generation.0, holder.owner.0
                    ))
                    .expect("no NUL in a formatted number"),
                );
            }
        }
        for (heap, s, z) in &by_heap {
            // SAFETY: `s` and `z` hold one start and size per region, each
            // inside `heap` (found by address), a heap of this pool's domain.
            unsafe {
                kvsan_nvtx_regions_register(self.domain, *heap, s.as_ptr(), z.as_ptr(), s.len())
            };
        }
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        // SAFETY: `starts` and `name_ptrs` hold one region start and one
        // NUL-terminated name each, alive for the call; the regions were
        // registered just above.
        unsafe {
            kvsan_nvtx_regions_name(
                self.domain,
                starts.as_ptr(),
                name_ptrs.as_ptr(),
                starts.len(),
            )
        };
    }

    /// Binds, to the CUDA work this thread enqueues from now on, a
    /// permissions object in which the pages held by `owners` are
    /// read-write and every other held page has no access: a kernel
    /// launched for these requests that touches another request's page is
    /// a memcheck error. Replaces an earlier binding of this pool.
    pub fn bind(&mut self, owners: &[RequestId]) {
        self.unbind();
        if !self.attached {
            return;
        }
        // SAFETY: the pool's domain.
        let Some(perms) = NonNull::new(unsafe { kvsan_nvtx_permissions_create(self.domain) })
        else {
            return;
        };
        let mut starts = Vec::new();
        let mut flags = Vec::new();
        for (i, holder) in self.held.iter().enumerate() {
            let Some(holder) = holder else { continue };
            let flag = if owners.contains(&holder.owner) {
                PERMISSION_READ_WRITE
            } else {
                PERMISSION_NONE
            };
            for start in self.starts(i) {
                starts.push(start);
                flags.push(flag);
            }
        }
        // SAFETY: `starts` and `flags` hold one registered region start and
        // one flag word each; `perms` was just created in this domain.
        unsafe {
            kvsan_nvtx_permissions_assign(
                self.domain,
                perms.as_ptr(),
                starts.as_ptr(),
                flags.as_ptr(),
                starts.len(),
            );
            kvsan_nvtx_permissions_bind_stream(self.domain, perms.as_ptr());
        }
        self.bound = Some(perms);
    }

    /// Ends the binding made by [`NvtxPool::bind`], if any.
    pub fn unbind(&mut self) {
        if let Some(perms) = self.bound.take() {
            // SAFETY: `perms` was created and bound in this domain by `bind`.
            unsafe {
                kvsan_nvtx_permissions_unbind_stream(self.domain);
                kvsan_nvtx_permissions_destroy(self.domain, perms.as_ptr());
            }
        }
    }
}

impl Drop for NvtxPool {
    fn drop(&mut self) {
        self.unbind();
        for heap in &self.heaps {
            if !heap.handle.is_null() {
                // SAFETY: a heap this pool registered in its domain; its
                // regions go with it.
                unsafe { kvsan_nvtx_heap_unregister(self.domain, heap.handle) };
            }
        }
        // SAFETY: the domain this pool created; nothing uses it after this.
        unsafe { kvsan_nvtx_domain_destroy(self.domain) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn plane(base: u64, stride: u64, bytes: u64) -> NvtxPlane {
        NvtxPlane {
            base,
            page_stride: stride,
            page_bytes: bytes,
        }
    }

    #[test]
    fn planes_that_cannot_hold_pages_are_refused_by_index() {
        let cases = [
            (plane(0x1000, PAGE, 0), "page_bytes is 0"),
            (plane(0x1000, PAGE, PAGE + 1), "page_bytes is larger"),
            (plane(0, PAGE, PAGE), "null address"),
            (plane(u64::MAX - PAGE, PAGE, PAGE), "past the address space"),
        ];
        for (bad, problem) in cases {
            let err = NvtxPool::new("t", &[plane(0x10_0000, PAGE, PAGE), bad], 4).unwrap_err();
            match err {
                CudaError::NvtxPlane {
                    plane: 1,
                    problem: p,
                } => {
                    assert!(p.contains(problem), "{p} for {bad:?}")
                }
                other => panic!("{other:?} for {bad:?}"),
            }
        }
        assert!(matches!(
            NvtxPool::new("t", &[], 4),
            Err(CudaError::Length { .. })
        ));
        assert!(matches!(
            NvtxPool::new("t", &[plane(0x1000, PAGE, PAGE)], 0),
            Err(CudaError::ZeroDimension { .. })
        ));
    }

    #[test]
    fn interleaved_planes_pass_and_overlapping_ones_are_refused() {
        // vLLM's [num_blocks, 2, …] layout: K and V of a block side by side.
        let k = plane(0x10_0000, 2 * PAGE, PAGE);
        let v = plane(0x10_0000 + PAGE, 2 * PAGE, PAGE);
        let pool = NvtxPool::new("kv", &[k, v], 8).expect("interleaved planes");
        assert_eq!(pool.heaps.len(), 1, "one allocation, one heap");
        assert_eq!(pool.heaps[0].end - pool.heaps[0].start, 16 * PAGE);

        let shifted = plane(0x10_0000 + PAGE / 2, 2 * PAGE, PAGE);
        assert!(matches!(
            NvtxPool::new("kv", &[k, shifted], 8),
            Err(CudaError::NvtxPlanesOverlap {
                first: 0,
                second: 1
            })
        ));
        // Separate tensors: separate heaps.
        let other = plane(0x100_0000, PAGE, PAGE);
        let pool = NvtxPool::new("kv", &[plane(0x10_0000, PAGE, PAGE), other], 8).unwrap();
        assert_eq!(pool.heaps.len(), 2);
        // A different stride inside another plane's extent.
        assert!(matches!(
            NvtxPool::new("kv", &[k, plane(0x10_0000 + PAGE, PAGE, PAGE / 2)], 8),
            Err(CudaError::NvtxPlanesOverlap { .. })
        ));
    }

    #[test]
    fn given_heaps_must_hold_every_plane() {
        // A tensor inside a larger allocation (a caching allocator's segment).
        let k = plane(0x10_1000, PAGE, PAGE);
        let pool = NvtxPool::with_heaps("kv", &[k], 8, &[(0x10_0000, 64 * PAGE)]).unwrap();
        assert_eq!(
            (pool.heaps[0].start, pool.heaps[0].end),
            (0x10_0000, 0x10_0000 + 64 * PAGE)
        );
        assert!(matches!(
            NvtxPool::with_heaps("kv", &[k], 8, &[(0x10_0000, 4 * PAGE)]),
            Err(CudaError::NvtxPlane { plane: 0, .. })
        ));
    }

    #[test]
    fn without_a_tool_holding_and_releasing_is_bookkeeping_only() {
        // No NVTX_INJECTION64_PATH in a test run: no tool answers.
        let mut pool = NvtxPool::new("t", &[plane(0x10_0000, PAGE, PAGE)], 4).unwrap();
        assert!(!pool.tool_attached());
        let a = NvtxHolder {
            owner: RequestId(7),
            generation: Generation(1),
        };
        pool.hold(PageId(2), a).unwrap();
        pool.hold(PageId(2), a).unwrap();
        assert_eq!(pool.holder(PageId(2)), Some(a));
        assert_eq!(pool.held_pages(), vec![PageId(2)]);
        pool.bind(&[RequestId(7)]);
        pool.unbind();
        pool.release(PageId(2)).unwrap();
        pool.release(PageId(2)).unwrap();
        assert_eq!(pool.holder(PageId(2)), None);
        assert!(matches!(
            pool.hold(PageId(4), a),
            Err(CudaError::OutOfRange {
                value: 4,
                limit: 4,
                ..
            })
        ));
    }

    /// A sanitizer with one pool of 4 pages.
    fn sanitizer(
        options: kvsan_sanitizer::Options,
    ) -> (kvsan_sanitizer::Sanitizer, kvsan_sanitizer::PoolId) {
        use kvsan_sanitizer::{NodeRole, PoolGeometry, Sanitizer};
        let san = Sanitizer::with_writer(options, std::io::sink());
        let pool = san
            .pool_register(PoolGeometry {
                pages: 4,
                page_slots: 16,
                layers: 2,
                bytes_per_slot: 64,
                role: NodeRole::Unified,
                node: "nvtx-test".into(),
            })
            .unwrap();
        (san, pool)
    }

    #[test]
    fn sync_follows_the_sanitizers_records_through_alloc_free_and_reuse() {
        use kvsan_sanitizer::{Options, Owner};
        let (san, pool_id) = sanitizer(Options::default());
        let mut pool = NvtxPool::new("t", &[plane(0x10_0000, PAGE, PAGE)], 4).unwrap();
        let all = [PageId(0), PageId(1), PageId(2), PageId(3)];
        let (_, g1) = san.alloc(pool_id, PageId(1), Owner::new(7, 1), 0).unwrap();
        let registered_one = NvtxSync {
            registered: 1,
            unregistered: 0,
        };
        let synced = pool
            .sync(&san.kernel_shadow(pool_id).unwrap(), &all)
            .unwrap();
        assert_eq!(synced, registered_one);
        let seven = NvtxHolder {
            owner: RequestId(7),
            generation: g1,
        };
        assert_eq!(pool.holder(PageId(1)), Some(seven));
        // Nothing changed: nothing to do.
        let synced = pool
            .sync(&san.kernel_shadow(pool_id).unwrap(), &all)
            .unwrap();
        assert_eq!(synced, NvtxSync::default());

        let page = kvsan_ids::PageRef {
            page: PageId(1),
            generation: g1,
        };
        assert!(
            san.free(pool_id, Owner::new(7, 1), page, 0)
                .unwrap()
                .is_continue()
        );
        let synced = pool
            .sync(
                &san.kernel_shadow(pool_id).unwrap(),
                &[PageId(1), PageId(1)],
            )
            .unwrap();
        assert_eq!(
            synced,
            NvtxSync {
                registered: 0,
                unregistered: 1
            }
        );
        assert_eq!(pool.held_pages(), Vec::<PageId>::new());

        // Reused (quarantine off): held again, by the new owner, in the new generation.
        let mut options = Options::default();
        options.quarantine_pages = 0;
        let (san, pool_id) = sanitizer(options);
        let (_, g1) = san.alloc(pool_id, PageId(0), Owner::new(7, 1), 0).unwrap();
        pool.sync(&san.kernel_shadow(pool_id).unwrap(), &all)
            .unwrap();
        let page = kvsan_ids::PageRef {
            page: PageId(0),
            generation: g1,
        };
        assert!(
            san.free(pool_id, Owner::new(7, 1), page, 0)
                .unwrap()
                .is_continue()
        );
        let (_, g2) = san.alloc(pool_id, PageId(0), Owner::new(8, 2), 0).unwrap();
        let synced = pool
            .sync(&san.kernel_shadow(pool_id).unwrap(), &all)
            .unwrap();
        assert_eq!(synced, registered_one);
        assert_eq!(
            pool.holder(PageId(0)),
            Some(NvtxHolder {
                owner: RequestId(8),
                generation: g2
            })
        );
        // A shadow of another pool size is refused.
        let small = NvtxPool::new("t", &[plane(0x10_0000, PAGE, PAGE)], 2);
        assert!(matches!(
            small
                .unwrap()
                .sync(&san.kernel_shadow(pool_id).unwrap(), &[PageId(0)]),
            Err(CudaError::ShadowGeometry { .. })
        ));
    }
}
