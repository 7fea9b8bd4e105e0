/*
 * The NVTX memory calls kvsan makes, as plain C functions over integers
 * (feature `nvtx`; see nvtx.rs for what they are used for).
 *
 * NVTX is header-only: every nvtx* call below is an inline function of the
 * NVTX3 headers that, at its first call, looks for a tool (the library named
 * by NVTX_INJECTION64_PATH, which compute-sanitizer and Nsight set) and
 * becomes a no-op if there is none. This file is the one translation unit
 * of kvsan that includes them, so build.rs compiles it with the headers of
 * the CUDA toolkit or of the `nvidia-nvtx` wheel.
 *
 * Batches: one NVTX call takes at most BATCH descriptors (kept on the stack);
 * longer lists go in several calls.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtMem.h>

#define BATCH 64

static void const *address(uint64_t a) { return (void const *)(uintptr_t)a; }

void *kvsan_nvtx_domain_create(char const *name) { return (void *)nvtxDomainCreateA(name); }

void kvsan_nvtx_domain_destroy(void *domain) { nvtxDomainDestroy((nvtxDomainHandle_t)domain); }

/* A sub-allocator heap over [base, base + bytes): memcheck then reports an
 * access to any part of it that no registered region covers. NULL when no
 * tool is attached. */
void *kvsan_nvtx_heap_register(void *domain, uint64_t base, uint64_t bytes, char const *name)
{
    nvtxMemVirtualRangeDesc_t range;
    nvtxMemHeapDesc_t desc;
    nvtxMemHeapHandle_t heap;
    memset(&range, 0, sizeof range);
    memset(&desc, 0, sizeof desc);
    range.ptr = address(base);
    range.size = (size_t)bytes;
    desc.extCompatID = NVTX_EXT_COMPATID_MEM;
    desc.structSize = sizeof desc;
    desc.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
    desc.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    desc.typeSpecificDescSize = sizeof range;
    desc.typeSpecificDesc = &range;
    if (name != NULL) {
        desc.messageType = NVTX_MESSAGE_TYPE_ASCII;
        desc.message.ascii = name;
    }
    heap = nvtxMemHeapRegister((nvtxDomainHandle_t)domain, &desc);
    if (heap == NVTX_MEM_HEAP_HANDLE_NO_TOOL) {
        return NULL;
    }
    return (void *)heap;
}

void kvsan_nvtx_heap_unregister(void *domain, void *heap)
{
    nvtxMemHeapUnregister((nvtxDomainHandle_t)domain, (nvtxMemHeapHandle_t)heap);
}

/* Regions [starts[i], starts[i] + sizes[i]) inside `heap`. */
void kvsan_nvtx_regions_register(void *domain, void *heap, uint64_t const *starts,
                                 uint64_t const *sizes, size_t n)
{
    nvtxMemVirtualRangeDesc_t ranges[BATCH];
    nvtxMemRegionsRegisterBatch_t batch;
    size_t done = 0;
    while (done < n) {
        size_t count = n - done < BATCH ? n - done : BATCH;
        size_t i;
        for (i = 0; i < count; i++) {
            ranges[i].ptr = address(starts[done + i]);
            ranges[i].size = (size_t)sizes[done + i];
        }
        memset(&batch, 0, sizeof batch);
        batch.extCompatID = NVTX_EXT_COMPATID_MEM;
        batch.structSize = sizeof batch;
        batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
        batch.heap = (nvtxMemHeapHandle_t)heap;
        batch.regionCount = count;
        batch.regionDescElementSize = sizeof ranges[0];
        batch.regionDescElements = ranges;
        nvtxMemRegionsRegister((nvtxDomainHandle_t)domain, &batch);
        done += count;
    }
}

/* The regions starting at `starts[i]`, registered before. */
void kvsan_nvtx_regions_unregister(void *domain, uint64_t const *starts, size_t n)
{
    nvtxMemRegionRef_t refs[BATCH];
    nvtxMemRegionsUnregisterBatch_t batch;
    size_t done = 0;
    while (done < n) {
        size_t count = n - done < BATCH ? n - done : BATCH;
        size_t i;
        for (i = 0; i < count; i++) {
            refs[i].pointer = address(starts[done + i]);
        }
        memset(&batch, 0, sizeof batch);
        batch.extCompatID = NVTX_EXT_COMPATID_MEM;
        batch.structSize = sizeof batch;
        batch.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
        batch.refCount = count;
        batch.refElementSize = sizeof refs[0];
        batch.refElements = refs;
        nvtxMemRegionsUnregister((nvtxDomainHandle_t)domain, &batch);
        done += count;
    }
}

/* Names the region starting at `starts[i]` `names[i]` (NUL-terminated). */
void kvsan_nvtx_regions_name(void *domain, uint64_t const *starts, char const *const *names,
                             size_t n)
{
    nvtxMemRegionNameDesc_t descs[BATCH];
    nvtxMemRegionsNameBatch_t batch;
    size_t done = 0;
    while (done < n) {
        size_t count = n - done < BATCH ? n - done : BATCH;
        size_t i;
        memset(descs, 0, sizeof descs);
        for (i = 0; i < count; i++) {
            descs[i].regionRefType = NVTX_MEM_REGION_REF_TYPE_POINTER;
            descs[i].nameType = NVTX_MESSAGE_TYPE_ASCII;
            descs[i].region.pointer = address(starts[done + i]);
            descs[i].name.ascii = names[done + i];
        }
        memset(&batch, 0, sizeof batch);
        batch.extCompatID = NVTX_EXT_COMPATID_MEM;
        batch.structSize = sizeof batch;
        batch.regionCount = count;
        batch.regionElementSize = sizeof descs[0];
        batch.regionElements = descs;
        nvtxMemRegionsName((nvtxDomainHandle_t)domain, &batch);
        done += count;
    }
}

/* A new, empty permissions object; NULL when no tool is attached. */
void *kvsan_nvtx_permissions_create(void *domain)
{
    nvtxMemPermissionsHandle_t p =
        nvtxMemPermissionsCreate((nvtxDomainHandle_t)domain, NVTX_MEM_PERMISSIONS_CREATE_FLAGS_NONE);
    if (p == NVTX_MEM_PERMISSIONS_HANDLE_NO_TOOL) {
        return NULL;
    }
    return (void *)p;
}

/* Sets, in `permissions`, the region starting at `starts[i]` to `flags[i]`
 * (NVTX_MEM_PERMISSIONS_REGION_FLAGS_*: 0 none, 1 read, 2 write, 4 atomic). */
void kvsan_nvtx_permissions_assign(void *domain, void *permissions, uint64_t const *starts,
                                   uint32_t const *flags, size_t n)
{
    nvtxMemPermissionsAssignRegionDesc_t descs[BATCH];
    nvtxMemPermissionsAssignBatch_t batch;
    size_t done = 0;
    while (done < n) {
        size_t count = n - done < BATCH ? n - done : BATCH;
        size_t i;
        memset(descs, 0, sizeof descs);
        for (i = 0; i < count; i++) {
            descs[i].flags = flags[done + i];
            descs[i].regionRefType = NVTX_MEM_REGION_REF_TYPE_POINTER;
            descs[i].region.pointer = address(starts[done + i]);
        }
        memset(&batch, 0, sizeof batch);
        batch.extCompatID = NVTX_EXT_COMPATID_MEM;
        batch.structSize = sizeof batch;
        batch.permissions = (nvtxMemPermissionsHandle_t)permissions;
        batch.regionCount = count;
        batch.regionElementSize = sizeof descs[0];
        batch.regionElements = descs;
        nvtxMemPermissionsAssign((nvtxDomainHandle_t)domain, &batch);
        done += count;
    }
}

/* Binds `permissions` to the CUDA work this thread enqueues from now on. */
void kvsan_nvtx_permissions_bind_stream(void *domain, void *permissions)
{
    nvtxMemPermissionsBind((nvtxDomainHandle_t)domain, (nvtxMemPermissionsHandle_t)permissions,
                           NVTX_MEM_PERMISSIONS_BIND_SCOPE_CUDA_STREAM,
                           NVTX_MEM_PERMISSIONS_BIND_FLAGS_NONE);
}

void kvsan_nvtx_permissions_unbind_stream(void *domain)
{
    nvtxMemPermissionsUnbind((nvtxDomainHandle_t)domain, NVTX_MEM_PERMISSIONS_BIND_SCOPE_CUDA_STREAM);
}

void kvsan_nvtx_permissions_destroy(void *domain, void *permissions)
{
    nvtxMemPermissionsDestroy((nvtxDomainHandle_t)domain, (nvtxMemPermissionsHandle_t)permissions);
}
