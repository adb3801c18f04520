// The weight page ring (MEGA_PAGES > 0): a loader warp streams the weight rows of the
// instances this block has claimed into MEGA_PAGES shared-memory pages of MEGA_PAGE_BYTES with
// bulk async copies (cp.async.bulk, completion on an mbarrier), running ahead of the body
// threads ACROSS op boundaries as far as free pages allow, and independent of the instances'
// activation inputs. Body threads consume the pages in the same order and free them.
//
// Protocol (docs/design.md, "Weight pages"): page k of the launch lives in slot k % MEGA_PAGES;
// full[s] completes one phase per fill (the loader's arrive + the copy's bytes), empty[s] one
// phase per release (one arrive per body warp). The loader fills page k only after empty[s] has
// completed the release of page k - MEGA_PAGES; a body reads page k only after full[s] has
// completed its fill. Both sides walk the same instance order, and each instance's streams in
// the same order (render.py: paged_streams): the interpreter hands the body the instance's
// first page number.
//
// A page holds whole rows: floor(MEGA_PAGE_BYTES / row bytes) of them (a stream is one weight
// operand's rows [first, first + n) of one instance).
#pragma once
#include "common.cuh"

#ifndef MEGA_PAGES
#define MEGA_PAGES 0
#endif
#ifndef MEGA_PAGE_BYTES
#define MEGA_PAGE_BYTES 16384
#endif
#ifndef MEGA_INFLIGHT
#define MEGA_INFLIGHT MEGA_PAGES  // pages the loader may have in flight (issued, not landed)
#endif

#if MEGA_PAGES > 0
#include "runtime.cuh"  // (only the interpreter defines MEGA_PAGES: body tests stub the runtime)

__shared__ __align__(8) unsigned long long mega_page_full[MEGA_PAGES], mega_page_empty[MEGA_PAGES];
__shared__ unsigned mega_page_head;  // the current instance's first page (set by the interpreter)

__device__ __forceinline__ unsigned mega_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mega_mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mega_smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mega_mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(mega_smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mega_mbar_arrive_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mega_smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mega_mbar_test(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(mega_smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}
// Wait for the phase of parity `parity` to complete. False: the block is stopping (abort flag)
// or the wait ran past MEGA_TIMEOUT_NS (error recorded, naming the instance).
__device__ __forceinline__ bool mega_mbar_wait(unsigned long long* bar, unsigned parity) {
    if (mega_mbar_test(bar, parity)) return true;
    const unsigned long long t0 = mega_globaltimer();
    while (!mega_mbar_test(bar, parity)) {
        if (*(volatile int*)&mega_abort_block) return false;
        if (mega_globaltimer() - t0 > MEGA_TIMEOUT_NS) {
            mega_body_error(MEGA_ERR_TIMEOUT, -1);
            mega_abort_block = 1;
            return false;
        }
    }
    return true;
}

__device__ __forceinline__ char* mega_page(unsigned k) {
    extern __shared__ __align__(128) char mega_dyn_smem[];
    return mega_dyn_smem + MEGA_SMEM + (k % MEGA_PAGES) * MEGA_PAGE_BYTES;
}

// ---- the loader (one thread) --------------------------------------------------------------

struct MegaLoader {
    unsigned issued;  // pages filled so far this launch
};

// Fill pages with rows [0, n) of a weight stream: row i at src + i * stride bytes, row_bytes
// each (multiples of 16, 16-byte aligned). False: the block is stopping.
__device__ bool mega_load_rows(MegaLoader& L, const void* src, long long stride, int row_bytes, long long n) {
    const int rpp = MEGA_PAGE_BYTES / row_bytes;
    const char* s = (const char*)src;
    for (long long r0 = 0; r0 < n; r0 += rpp) {
        const unsigned k = L.issued, slot = k % MEGA_PAGES;
        if (k >= MEGA_PAGES && !mega_mbar_wait(&mega_page_empty[slot], ((k / MEGA_PAGES) - 1) & 1)) return false;
        if (MEGA_INFLIGHT < MEGA_PAGES && k >= MEGA_INFLIGHT) {  // pacing: at most MEGA_INFLIGHT pages in flight
            const unsigned j = k - MEGA_INFLIGHT;
            if (!mega_mbar_wait(&mega_page_full[j % MEGA_PAGES], (j / MEGA_PAGES) & 1)) return false;
        }
        const int rows = (int)min_i64(rpp, n - r0);
        const unsigned bar = mega_smem_u32(&mega_page_full[slot]), dst = mega_smem_u32(mega_page(k));
        mega_mbar_arrive_tx(&mega_page_full[slot], (unsigned)(rows * row_bytes));
        if (stride == row_bytes) {
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(dst), "l"(s + r0 * stride), "r"((unsigned)(rows * row_bytes)), "r"(bar) : "memory");
        } else {
            for (int r = 0; r < rows; ++r)
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(dst + r * row_bytes), "l"(s + (r0 + r) * stride), "r"((unsigned)row_bytes), "r"(bar)
                             : "memory");
        }
        L.issued = k + 1;
    }
    return true;
}

// Before the block exits: every issued copy has landed (a copy must not outlive the block).
__device__ void mega_loader_drain(const MegaLoader& L) {
    for (unsigned k = L.issued > MEGA_PAGES ? L.issued - MEGA_PAGES : 0; k < L.issued; ++k)
        while (!mega_mbar_test(&mega_page_full[k % MEGA_PAGES], (k / MEGA_PAGES) & 1)) {
        }
}

// ---- the body side (MEGA_THREADS threads) ---------------------------------------------------

// Page k, once landed. nullptr: the block is stopping.
__device__ __forceinline__ const char* mega_page_acquire(unsigned k) {
    return mega_mbar_wait(&mega_page_full[k % MEGA_PAGES], (k / MEGA_PAGES) & 1) ? mega_page(k) : nullptr;
}
// This warp is done with page k (every warp calls it once per page).
__device__ __forceinline__ void mega_page_release(unsigned k) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mega_mbar_arrive(&mega_page_empty[k % MEGA_PAGES]);
}

#endif  // MEGA_PAGES > 0
