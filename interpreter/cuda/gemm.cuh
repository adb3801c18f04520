// gemm: one output tile of out = x @ w^T on Hopper tensor cores (megaegg/blockops/gemm.py): 128 x 256
// or 128 x 128 for a prompt, 64 x 64 or 64 x 128 for a batch of ~64 rows.
// The tile itself is gemm_tile.cuh's. A gemm entry's case only fills a GemmJob (its tile, operands,
// waits and signals); the interpreter runs the job after its switch, in ONE place for every gemm op
// (gemm_run): the tile is ~40 KB of machine code, and it must be inlined into the kernel itself (a
// wgmma pipeline does not cross a call), so inlining it into each case would multiply that and NVRTC's
// time by the number of gemm cases. gemm_run holds one copy per tile shape the kernel image uses (its
// TILES mask, written by the renderer: interpreter/render.py deferred_slots). The barrier wait on x's
// producer is taken after the first weight copies are in flight, so they overlap the hand-off.
// Split over K (blockops/gemm.py, `splits` S > 1, at most BM x rows): instance (c0, c1, c2) runs the tile
// over K columns [c2*K/S, +K/S) into its f32 partial tile part[(c0*S + c2) * BM * BN ...] ([row][col]),
// arrives at the weight tile's counter arrive[c0] (common.cuh: mega_last_arrival), and the last of the S
// sums the partials in split order (the same sum whichever arrives last) and applies the epilogue (the
// unsplit tile's rounding, residual and gate) into out. Past BM rows c2 is 0 and the tile is unsplit.
#pragma once
#include "common.cuh"
#include "gemm_tile.cuh"

// The tile shapes (BM x BN weight rows; a gated tile: BN / 2 of w and of w2), one bit each.
enum GemmTileShape : unsigned {
    GEMM_TILE_128x256 = 1u, GEMM_TILE_64x64 = 2u, GEMM_TILE_64x128 = 4u, GEMM_TILE_128x128 = 8u
};
template <int BM, int BN> constexpr unsigned gemm_tile_shape() {
    static_assert((BM == 128 && (BN == 128 || BN == 256)) || (BM == 64 && (BN == 64 || BN == 128)), "gemm: no such tile shape");
    return BM == 128 ? (BN == 256 ? GEMM_TILE_128x256 : GEMM_TILE_128x128) : BN == 64 ? GEMM_TILE_64x64 : GEMM_TILE_64x128;
}
#ifndef MEGA_MAX_SIGNALS
#define MEGA_MAX_SIGNALS 4  // (the interpreter defines it: the most barrier sets one entry signals)
#endif

// Tensor map i of the kernel's table (interpreter/tensor_maps.py: 128 bytes each).
__device__ __forceinline__ const CUtensorMap* mega_tmap(const char* table, long long i) {
    return reinterpret_cast<const CUtensorMap*>(table + 128LL * i);
}

// In shared memory: thread 0 of the case fills it, every thread reads it (after a block barrier).
struct GemmJob {
    bool ok;         // its operands' layout is one the tile takes
    int epi;         // GemmEpi
    unsigned shape;  // GemmTileShape
    const CUtensorMap *tmap_x, *tmap_w, *tmap_w2;
    GemmTileOut o;
    int K, k0, m0, n0;
    float* part;       // a split tile: the weight tile's S partial tiles (this split's: part + split * BM * BN)
    unsigned* arrive;  // ... and its arrival counter
    int splits, split;
    MegaWaits wl;                          // x's producers (and r's), waited for after the weights' first copies
    unsigned* sig[MEGA_MAX_SIGNALS];       // counters to signal once the tile is stored
    int nsig;
};

// What a gemm entry's case calls: its BM x BN tile of out [M, N] (BN columns, BN / 2 gated), r the
// residual (EPI == GEMM_RESID); m_tile / n_tile: the instance's tile. Strides are in elements. The
// caller then sets job.wl and job.sig.
template <int EPI, int BM, int BN>
__device__ __forceinline__ void gemm(GemmJob& job, const CUtensorMap* tmap_x, const CUtensorMap* tmap_w,
                                     const CUtensorMap* tmap_w2, Mat<const __nv_bfloat16> r, Mat<__nv_bfloat16> out,
                                     long long M, long long N, int K, long long m_tile, long long n_tile, float* part,
                                     unsigned* arrive, int splits, long long split) {
    constexpr int N_OUT = EPI == GEMM_GATED ? BN / 2 : BN;  // (a gated tile stores half its columns)
    const long long m0 = m_tile * BM, n0 = n_tile * N_OUT;
    job.epi = EPI;
    job.shape = gemm_tile_shape<BM, BN>();
    job.tmap_x = tmap_x;
    job.tmap_w = tmap_w;
    job.tmap_w2 = tmap_w2;
    job.o = GemmTileOut{out.p + m0 * out.s0 + n0, out.s0, EPI == GEMM_RESID ? r.p + m0 * r.s0 + n0 : nullptr, r.s0,
                        (int)min_i64(M - m0, BM), (int)min_i64(N - n0, N_OUT), nullptr};
    // split over K only while the rows are one tile (the launch count makes c2 = 0 past it)
    job.splits = M <= BM ? splits : 1;
    job.split = (int)split;
    job.K = K / job.splits;
    job.k0 = job.K * job.split;
    job.part = job.splits > 1 ? part + n_tile * splits * (BM * BN) : nullptr;
    job.arrive = arrive + n_tile;
    job.m0 = (int)m0;
    job.n0 = (int)n0;
    // rows of contiguous elements (the rewrite gives them; tensor_maps.py checks the inputs)
    job.ok = out.s1 == 1 && (EPI != GEMM_RESID || r.s1 == 1);
}

// After the switch: the tile, then its signals (the block barrier orders every thread's stores before
// thread 0's releases, as every case's signals). On an abort or a layout error it stops early (the
// interpreter then sees mega_abort_block or the error record). TILES: the shapes this image's cases use.
template <int BM, int BN>
__device__ void gemm_combine(const GemmJob& job);

template <int BM, int BN>
__device__ __forceinline__ bool gemm_run_shape(const GemmJob& job, char* smem) {
    GemmTileOut o = job.o;
    if (job.part != nullptr) o.part = job.part + job.split * (BM * BN);
    if (!gemm_tile<BM, BN>(job.epi, job.tmap_x, job.tmap_w, job.tmap_w2, o, job.K, job.k0, job.m0, job.n0, smem,
                           [&] { return mega_wait_all(job.wl); }))
        return false;
    if constexpr (BM == 64) {  // (only 64-row tiles split: blockops/gemm.py GEMM_SPLITS)
        if (job.part != nullptr && mega_last_arrival(job.arrive, (unsigned)job.splits)) gemm_combine<BM, BN>(job);
    }
    return true;
}

// The last split of a tile: its S partial tiles summed in split order (common.cuh:
// mega_combine_partials), then the unsplit tile's epilogue (gemm_tile.cuh: store), 4 columns a store.
template <int BM, int BN, int S>
__device__ __noinline__ void gemm_combine_s(const GemmJob& job) {
    const GemmTileOut& o = job.o;
    const auto epi = [&](int r, int c, const float (&y)[4], const float (&u)[4], const float (&res)[4]) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = __bfloat162float(__float2bfloat16_rn(y[j]));
            if (job.epi == GEMM_GATED) {
                const float sv = __bfloat162float(__float2bfloat16_rn(v[j] / (1.0f + __expf(-v[j]))));
                v[j] = sv * __bfloat162float(__float2bfloat16_rn(u[j]));
            } else if (job.epi == GEMM_RESID) {
                v[j] += res[j];
            }
        }
        __nv_bfloat16* p = o.out + (long long)r * o.ldo + c;
        if (c + 3 < o.cols && (reinterpret_cast<unsigned long long>(p) & 7ull) == 0) {
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
            *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
        } else {
            for (int j = 0; j < 4 && c + j < o.cols; ++j) p[j] = __float2bfloat16_rn(v[j]);
        }
    };
    const __nv_bfloat16* r = job.epi == GEMM_RESID ? o.r : nullptr;
    if (job.epi == GEMM_GATED)
        mega_combine_partials<S, true>(job.part, BN, BM * BN, o.rows, o.cols, BN / 2, r, o.ldr, 1, epi);
    else
        mega_combine_partials<S, false>(job.part, BN, BM * BN, o.rows, o.cols, 0, r, o.ldr, 1, epi);
}

template <int BM, int BN>
__device__ void gemm_combine(const GemmJob& job) {
    if (job.splits == 2) gemm_combine_s<BM, BN, 2>(job);
    else if (job.splits == 4) gemm_combine_s<BM, BN, 4>(job);
    else if (job.splits == 8) gemm_combine_s<BM, BN, 8>(job);
    else __trap();  // (blockops/gemm.py: GEMM_SPLITS, which GemmTerm.fits keeps to)
}

template <unsigned TILES>
__device__ __forceinline__ void gemm_run(const GemmJob& job, char* smem) {
    if (!job.ok || (job.shape & TILES) == 0) {  // a layout the tile does not take (or a shape not compiled in)
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_LAYOUT, 0);
        mega_wait_all(job.wl);
        return;
    }
    bool done = false;
    if constexpr ((TILES & GEMM_TILE_128x256) != 0)
        if (job.shape == GEMM_TILE_128x256) done = gemm_run_shape<128, 256>(job, smem);
    if constexpr ((TILES & GEMM_TILE_128x128) != 0)
        if (job.shape == GEMM_TILE_128x128) done = gemm_run_shape<128, 128>(job, smem);
    if constexpr ((TILES & GEMM_TILE_64x64) != 0)
        if (job.shape == GEMM_TILE_64x64) done = gemm_run_shape<64, 64>(job, smem);
    if constexpr ((TILES & GEMM_TILE_64x128) != 0)
        if (job.shape == GEMM_TILE_64x128) done = gemm_run_shape<64, 128>(job, smem);
    if (!done) return;
    mega_sync();
    if (threadIdx.x == 0)
        for (int i = 0; i < job.nsig; ++i) mega_red_release(job.sig[i], 1u);
}
