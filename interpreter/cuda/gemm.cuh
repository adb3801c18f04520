// gemm: one 128 x 256 output tile of out = x @ w^T on Hopper tensor cores (megaegg/blockops/gemm.py).
// The tile itself is gemm_tile.cuh's. A gemm entry's case only fills a GemmJob (its tile, operands,
// waits and signals); the interpreter runs the job after its switch, in ONE place for every gemm op
// (gemm_run): the tile is ~40 KB of machine code, and it must be inlined into the kernel itself (a
// wgmma pipeline does not cross a call), so inlining it into each case would multiply that and NVRTC's
// time by the number of gemm cases. The barrier wait on x's producer is taken after the first weight
// copies are in flight, so they overlap the hand-off.
#pragma once
#include "common.cuh"
#include "gemm_tile.cuh"

#define MEGA_GEMM_BN 256  // weight rows of a tile (a gated tile: 128 of w and 128 of w2)
#ifndef MEGA_MAX_SIGNALS
#define MEGA_MAX_SIGNALS 4  // (the interpreter defines it: the most barrier sets one entry signals)
#endif

// Tensor map i of the kernel's table (interpreter/tensor_maps.py: 128 bytes each).
__device__ __forceinline__ const CUtensorMap* mega_tmap(const char* table, long long i) {
    return reinterpret_cast<const CUtensorMap*>(table + 128LL * i);
}

// In shared memory: thread 0 of the case fills it, every thread reads it (after a block barrier).
struct GemmJob {
    bool ok;   // its operands' layout is one the tile takes
    int epi;   // GemmEpi
    const CUtensorMap *tmap_x, *tmap_w, *tmap_w2;
    GemmTileOut o;
    int K, m0, n0;
    MegaWaits wl;                          // x's producers (and r's), waited for after the weights' first copies
    unsigned* sig[MEGA_MAX_SIGNALS];       // counters to signal once the tile is stored
    int nsig;
};

// What a gemm entry's case calls: its tile of out [M, N] (N_OUT columns a tile: 256, or 128 gated), r the
// residual (EPI == GEMM_RESID); m_tile / n_tile: the instance's tile. Strides are in elements. The
// caller then sets job.wl and job.sig.
template <int EPI, int N_OUT>
__device__ __forceinline__ void gemm(GemmJob& job, const CUtensorMap* tmap_x, const CUtensorMap* tmap_w,
                                     const CUtensorMap* tmap_w2, Mat<const __nv_bfloat16> r, Mat<__nv_bfloat16> out,
                                     long long M, long long N, int K, long long m_tile, long long n_tile) {
    static_assert(N_OUT == (EPI == GEMM_GATED ? MEGA_GEMM_BN / 2 : MEGA_GEMM_BN), "gemm: a gated tile stores half its columns");
    const long long m0 = m_tile * gemm_tile_detail::BM, n0 = n_tile * N_OUT;
    job.epi = EPI;
    job.tmap_x = tmap_x;
    job.tmap_w = tmap_w;
    job.tmap_w2 = tmap_w2;
    job.o = GemmTileOut{out.p + m0 * out.s0 + n0, out.s0, EPI == GEMM_RESID ? r.p + m0 * r.s0 + n0 : nullptr, r.s0,
                        (int)min_i64(M - m0, gemm_tile_detail::BM), (int)min_i64(N - n0, N_OUT)};
    job.K = K;
    job.m0 = (int)m0;
    job.n0 = (int)n0;
    // rows of contiguous elements (the rewrite gives them; tensor_maps.py checks the inputs)
    job.ok = out.s1 == 1 && (EPI != GEMM_RESID || r.s1 == 1);
}

// After the switch: the tile, then its signals (the block barrier orders every thread's stores before
// thread 0's releases, as every case's signals). On an abort or a layout error it stops early (the
// interpreter then sees mega_abort_block or the error record).
__device__ __forceinline__ void gemm_run(const GemmJob& job, char* smem) {
    if (!job.ok) {  // a layout the tile does not take
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        mega_wait_all(job.wl);
        return;
    }
    if (!gemm_tile<MEGA_GEMM_BN>(job.epi, job.tmap_x, job.tmap_w, job.tmap_w2, job.o, job.K, job.m0, job.n0, smem,
                                 [&] { return mega_wait_all(job.wl); }))
        return;
    mega_sync();
    if (threadIdx.x == 0)
        for (int i = 0; i < job.nsig; ++i) mega_red_release(job.sig[i], 1u);
}
