// One output tile of a bf16 linear on Hopper tensor cores (issue 38, first step): TMA bulk tensor
// copies into an mbarrier-guarded shared-memory ring, warpgroup MMA (wgmma, sm_90a) through CuTe's
// SM90 GMMA atoms, f32 accumulation, bf16 stores.
//
//   out[m0:m0+BM, n0:n0+BN] = x[m0:m0+BM, :K] @ w[n0:n0+BN, :K]^T
//
// x [M, K] and w [N, K] are row-major bf16 (w: the PyTorch Linear weight layout), out [M, N] bf16 with
// row stride ldo. Both operands are K-major, the layout wgmma reads without a transpose.
//
// Needs the CUTLASS headers (the `nvidia-cutlass` wheel: cutlass_library/source/include), the CUDA
// toolkit's include/cccl (libcu++, which CuTe includes under NVRTC), -std=c++17, sm_90a and, under NVRTC,
// -default-device (CUTLASS has unannotated constexpr helpers). The megakernel's
// gemm kind (gemm.cuh, megaegg/blockops/gemm.py) calls it; so does scripts/dev/gemm_probe.py.
//
// Tile shape (BK = 64; BM and BN template parameters: 128 x 256, or 64 x 64 / 64 x 128 for a batch of
// at most ~64 rows, where a 128-row tile would be half zeros and too few tiles would share the weights):
// - BM = 128: the block's 256 threads are two warpgroups, each owning a 64-row half of the tile with
//   one wgmma m64nBNk16 per 16 of K (CuTe tiled MMA: the atom SM90_64xBNx16_F32BF16BF16_SS, 2x1x1).
// - BM = 64: warpgroup 0 alone runs the wgmmas (1x1x1) and the epilogue; warpgroup 1 waits at the end.
//   Such a tile is for memory-bound row counts: one warpgroup's MMAs take ~1/4 of a stage's copy time.
// - BK = 64: 64 bf16 = 128 bytes, one row of the 128-byte swizzle (GMMA::Layout_K_SW128_Atom; the
//   tensor maps use CU_TENSOR_MAP_SWIZZLE_128B, whose inner box may not exceed 128 bytes). A stage is
//   x's box {64, BM} (BM * 128 bytes) and the weight boxes (BN * 128 bytes): one box of BN rows (two of
//   128 for BN = 256), or for a gated tile one box of BN / 2 rows from each weight (GemmTile::w_box).
// - STAGES: as many as fit MEGA_SMEM after 1 KB of alignment slack and the barriers: with 120 KB,
//   BN = 128 -> 3 stages of 32 KB (96 KB), BN = 256 -> 2 stages of 48 KB (96 KB). At least 2.
//   Accumulators: BN / 2 f32 registers a thread (64 or 128).
//
// Pipeline (no producer warpgroup: the megakernel block is 256 threads, all of them consumers). Thread
// 0 issues the TMA copies. k-tile kt lives in slot kt % STAGES; each slot has two mbarriers:
// - full[s] (count 1): thread 0's arrive.expect_tx(bytes of both boxes) + the two copies' complete_tx.
//   k-tile kt completes phase kt / STAGES of full[kt % STAGES] (0-based): its consumers wait on that parity.
// - empty[s] (count: the warps running wgmmas): lane 0 of each such warp arrives once its warpgroup's wgmma of that k-tile
//   completed (wgmma.wait_group). Thread 0 loads k-tile j >= STAGES into slot s = j % STAGES only after
//   the release of k-tile j - STAGES, which completes phase (j - STAGES) / STAGES of empty[s]: it waits
//   on that parity.
// Iteration kt: wait full[kt]; issue the 4 wgmmas of k-tile kt (async); wait until at most 1 wgmma group
// is pending (so k-tile kt - 1's are done while kt's run); release slot (kt - 1) % STAGES; thread 0
// refills it with k-tile kt - 1 + STAGES. Parity waits cannot alias (a barrier two phases ahead of its
// waiter): a slot is only refilled after its release, and only released after it was waited full.
// The expect-tx count is always the full boxes: TMA counts a box's zero-filled out-of-bounds bytes
// too (ragged M, N and K edges; a ragged K reads zeros for both operands, adding nothing).
//
// __forceinline__, not __noinline__ like most bodies: out of line, ptxas serialises every wgmma ("C7510:
// wgmma pipeline crossing function boundary"). ptxas' C7517 note (an injected wgmma.wait_group) comes
// from the timeout's __trap path only (the main loop's SASS: TRYWAIT, WARPGROUP.ARRIVE, 4 HGMMA,
// WARPGROUP.DEPBAR.LE gsb0 1, the empty arrive, the refill).
//
// The barriers live for one call: initialised at the start, invalidated at the end, so a persistent
// loop over tiles (or another body using this shared memory next) starts clean. The cost: the ring
// drains at each tile's end (no overlap of the next tile's first loads with this tile's epilogue).
//
// Requirements (the host's tensor maps must satisfy them anyway): K % 8 == 0 (row strides a multiple
// of 16 bytes), x and w 16-byte aligned, each tensor map 64-byte aligned in global memory and encoded as
// gemm_probe.py's encode_tmap does (bf16, 2-D {K, rows}, box {64, 128} for every operand,
// SWIZZLE_128B, zero out-of-bounds fill).
#pragma once
#include "common.cuh"

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

// CuTe turns its TMA / wgmma / mbarrier wrappers into no-ops (or traps) when the target lacks them:
// make a build for anything but sm_90a fail here instead of hanging on a barrier at run time.
#if defined(__CUDA_ARCH__) && !(defined(CUTE_ARCH_TMA_SM90_ENABLED) && defined(CUTE_ARCH_MMA_SM90A_ENABLED))
#error "gemm_tile.cuh needs sm_90a (compute_90a): TMA and wgmma"
#endif

// The driver's tensor map type. NVRTC has no <cuda.h>; this is its layout (128 bytes, 64-byte aligned).
#if !defined(__cuda_cuda_h__)
typedef struct CUtensorMap_st {
    alignas(64) unsigned long long opaque[16];
} CUtensorMap;
#endif

// A barrier wait that has not completed after this long is a bug (a wrong expect-tx count, a tensor
// map the TMA unit rejected): fail loudly instead of hanging the GPU.
#ifndef GEMM_TILE_TIMEOUT_NS
#define GEMM_TILE_TIMEOUT_NS 2000000000ULL
#endif
#ifndef GEMM_TILE_ON_TIMEOUT
#define GEMM_TILE_ON_TIMEOUT() __trap()
#endif

namespace gemm_tile_detail {

constexpr int BK = 64;   // 64 bf16 = 128 bytes: one 128-byte swizzle row

// Bytes of one ring slot (both operands' boxes) and the most stages MEGA_SMEM holds.
__host__ __device__ constexpr int stage_bytes(int bm, int bn) { return (bm + bn) * BK * 2; }
__host__ __device__ constexpr int smem_needed(int bm, int bn, int stages) {
    return 1024 /* align the ring to 1024 */ + stages * stage_bytes(bm, bn) + 2 * stages * 8 /* mbarriers */;
}
__host__ __device__ constexpr int max_stages(int bm, int bn) {
    return cmin(8, (MEGA_SMEM - 1024 - 2 * 8 * 8) / stage_bytes(bm, bn));  // (barriers: at most 8 stages)
}
// Rows of a weight box: a gated tile takes BN / 2 rows of each weight, a plain one its BN rows in boxes
// of at most 128 (the host encodes each weight's tensor map with this box: blockops/gemm.py w_box_rows).
__host__ __device__ constexpr int w_box(int bn, bool gated) { return gated ? bn / 2 : cmin(bn, 128); }

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// --- mbarriers (shared::cta addresses) ---------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(uint32_t bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// One arrival (the producer's) that also raises the phase's expected transaction bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok != 0;
}
// Wait until the phase of parity `parity` has completed (acquire: the TMA writes it counted are visible).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    if (mbar_try_wait(bar, parity)) return;
    const unsigned long long t0 = globaltimer();
    while (!mbar_try_wait(bar, parity)) {
        if (globaltimer() - t0 > GEMM_TILE_TIMEOUT_NS) GEMM_TILE_ON_TIMEOUT();
    }
}

// The tiled MMA: two warpgroups stacked along M, each a 64 x BN x 16 wgmma reading A and B from
// shared memory (SS), both K-major.
template <int BN> struct Mma;
template <> struct Mma<64> {
    using Atom = cute::SM90_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;
};
template <> struct Mma<128> {
    using Atom = cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;
};
template <> struct Mma<256> {
    using Atom = cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;
};

}  // namespace gemm_tile_detail

// Where a tile's results go. `out` and `r` point at the tile's first element (row m0, its first output
// column); `rows` x `cols` of it are stored (the rest of the tile lies past M or N).
struct GemmTileOut {
    __nv_bfloat16* out;
    long long ldo;
    const __nv_bfloat16* r;  // RESID: the residual, out = T(r + T(acc)); else unused
    long long ldr;
    int rows, cols;
    // A split of K (gemm.cuh), else nullptr: the f32 accumulators as they are, part[row * BN + col] for the
    // tile's first `rows` rows (a gated tile's w2 half at columns BN / 2 ..), instead of the epilogue into out.
    // (No default member initialiser: the job holding this struct is a __shared__ variable, which may not
    // be dynamically initialised.)
    float* part;
};

// What the tile's epilogue computes from the f32 accumulators (rounded as the unfused ops store):
// PLAIN out = T(acc); RESID out = T(r + T(acc)); GATED (BN = 256: columns [0, 128) are x w^T, [128, 256)
// x w2^T for the same 128 weight rows; in general the tile's BN / 2 rows of each) out = T(T(silu(T(y))) *
// T(u)), BN / 2 output columns.
enum GemmEpi { GEMM_PLAIN = 0, GEMM_RESID = 1, GEMM_GATED = 2 };

namespace gemm_tile_detail {
// The epilogue: a thread holds pairs of adjacent columns (c, c + 1) of one row: one 4-byte store each
// where out allows it. (Each quad of lanes writes 16 contiguous bytes of a row; a shared-memory staged,
// 16-byte-per-lane or TMA store is the next step.)
template <int EPI, int BN, class Acc, class Coords>
__device__ __forceinline__ void store(const Acc& acc, const Coords& tCcC, const GemmTileOut& o) {
    using namespace cute;
    const bool vec = (o.ldo % 2 == 0) && ((reinterpret_cast<unsigned long long>(o.out) & 3ull) == 0) &&
                     (EPI != GEMM_RESID || ((o.ldr % 2 == 0) && ((reinterpret_cast<unsigned long long>(o.r) & 3ull) == 0)));
    // GATED: the accumulators of columns [BN / 2, BN) are the second half of a thread's (the m64nBN atom's
    // values run over N last: value v + size / 2 is column c + BN / 2 of the same row; checked below)
    constexpr int NV = EPI == GEMM_GATED ? decltype(size(acc))::value / 2 : decltype(size(acc))::value;
    static_assert(NV % 2 == 0, "gemm_tile: accumulators come in column pairs");
    auto value = [&](int i) -> float {
        float y = __bfloat162float(__float2bfloat16_rn(acc(i)));
        if constexpr (EPI == GEMM_GATED) {
            const float u = __bfloat162float(__float2bfloat16_rn(acc(i + NV)));
            const float sy = __bfloat162float(__float2bfloat16_rn(y / (1.0f + __expf(-y))));
            y = sy * u;
        }
        return y;
    };
    CUTE_UNROLL
    for (int i = 0; i < NV; i += 2) {
        const int r = get<0>(tCcC(i)), c = get<1>(tCcC(i));
        const int r1 = get<0>(tCcC(i + 1)), c1 = get<1>(tCcC(i + 1));
        if constexpr (EPI == GEMM_GATED) {  // (compiles away: the layout is known at compile time)
            if (get<1>(tCcC(i + NV)) != c + BN / 2 || get<0>(tCcC(i + NV)) != r) __trap();
        }
        float v0 = value(i), v1 = value(i + 1);
        __nv_bfloat16* p = o.out + (long long)r * o.ldo + c;
        if (vec && c % 2 == 0 && r1 == r && c1 == c + 1 && r < o.rows && c1 < o.cols) {
            if constexpr (EPI == GEMM_RESID) {
                const float2 rv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o.r + (long long)r * o.ldr + c));
                v0 += rv.x;
                v1 += rv.y;
            }
            *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
        } else {
            if (r < o.rows && c < o.cols) {
                if constexpr (EPI == GEMM_RESID) v0 += __bfloat162float(o.r[(long long)r * o.ldr + c]);
                *p = __float2bfloat16_rn(v0);
            }
            if (r1 < o.rows && c1 < o.cols) {
                if constexpr (EPI == GEMM_RESID) v1 += __bfloat162float(o.r[(long long)r1 * o.ldr + c1]);
                o.out[(long long)r1 * o.ldo + c1] = __float2bfloat16_rn(v1);
            }
        }
    }
}

// A split's f32 products into o.part (row stride BN): two adjacent columns a store (8 bytes).
template <int BN, class Acc, class Coords>
__device__ __forceinline__ void store_partial(const Acc& acc, const Coords& tCcC, const GemmTileOut& o) {
    using namespace cute;
    constexpr int NV = decltype(size(acc))::value;
    CUTE_UNROLL
    for (int i = 0; i < NV; i += 2) {
        const int r = get<0>(tCcC(i)), c = get<1>(tCcC(i));
        if (get<0>(tCcC(i + 1)) != r || get<1>(tCcC(i + 1)) != c + 1 || c % 2) __trap();  // (compiles away)
        if (r < o.rows) *reinterpret_cast<float2*>(o.part + r * BN + c) = make_float2(acc(i), acc(i + 1));
    }
}
}  // namespace gemm_tile_detail

// The block's 256 threads (two warpgroups) compute one output tile; all must call it with the same
// arguments. `smem`: the dynamic shared memory (MEGA_SMEM bytes; used whole for the call's duration).
// tmap_x / tmap_w / tmap_w2: tensor maps of x [M, K] and w, w2 [N, K] in global memory, with boxes
// {64, BM} (x) and {64, w_box(BN, gated)} (the weights). The tile's B operand is BN weight rows: w's
// rows [n0, n0 + BN), or (GATED) w's and w2's rows [n0, n0 + BN / 2), over K columns [k0, k0 + K) (a split:
// with o.part, the f32 products go there instead of the epilogue). K == 0 stores zeros (PLAIN).
// `wait_inputs`: called by every thread after the weights' first copies are issued and before x's: the
// barrier wait on x's producer (the megakernel's mega_wait_all); it returns false to abort, and then the
// tile drains its copies and returns false without storing.
// `epi`: a GemmEpi, a runtime value (the megakernel inlines one tile for every gemm op: one copy of
// its code, each epilogue's store loop once).
template <int BM, int BN, int STAGES = gemm_tile_detail::max_stages(BM, BN), class WaitInputs>
__device__ __forceinline__ bool gemm_tile(int epi, const CUtensorMap* tmap_x, const CUtensorMap* tmap_w,
                                          const CUtensorMap* tmap_w2, const GemmTileOut& o, int K, int k0, int m0,
                                          int n0, char* smem, WaitInputs&& wait_inputs) {
    using namespace cute;
    using namespace gemm_tile_detail;
    static_assert(MEGA_THREADS == 256, "gemm_tile: two warpgroups, 256 threads");
    static_assert(BM == 64 || BM == 128, "gemm_tile: BM is 64 or 128");
    static_assert(BN == 64 || BN == 128 || BN == 256, "gemm_tile: BN is 64, 128 or 256");
    static_assert(STAGES >= 2, "gemm_tile: the ring needs 2 stages (refill of slot kt-1 waits on iteration kt)");
    static_assert(smem_needed(BM, BN, STAGES) <= MEGA_SMEM, "gemm_tile: the ring does not fit MEGA_SMEM");
    using T = cute::bfloat16_t;
    constexpr uint32_t A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    constexpr uint32_t TX_BYTES = A_BYTES + B_BYTES;  // full boxes, zero-filled parts included
    constexpr int MMA_THREADS = BM / 64 * 128;        // the warpgroups running wgmmas (one per 64 rows)

    // --- shared memory: [pad to 1024][A ring: STAGES x BM*128][B ring: STAGES x BN*128][full][empty] ---
    // 128-byte swizzle is a function of the shared address bits 4-9: each operand buffer must start
    // 1024-byte aligned for the TMA's swizzle and the wgmma descriptors' (base offset 0) to agree.
    const uint32_t s0 = (uint32_t)__cvta_generic_to_shared(smem);
    char* base = smem + ((1024u - (s0 & 1023u)) & 1023u);
    T* ring_a = reinterpret_cast<T*>(base);
    T* ring_b = reinterpret_cast<T*>(base + STAGES * A_BYTES);
    uint64_t* bar_ptr = reinterpret_cast<uint64_t*>(base + STAGES * (A_BYTES + B_BYTES));  // full[STAGES], empty[STAGES]
    const uint32_t bars = (uint32_t)__cvta_generic_to_shared(bar_ptr);
    auto full = [&](int s) { return bars + 8u * (uint32_t)s; };  // shared::cta addresses
    auto empty = [&](int s) { return bars + 8u * (uint32_t)(STAGES + s); };

    const int tid = threadIdx.x, lane = tid & 31;
    const int KT = (K + BK - 1) / BK;  // k-tiles; the last may be ragged (zero-filled by the TMA)

    // Order this block's earlier generic-proxy accesses of this shared memory (another body, the last
    // tile's epilogue) before the TMA's async-proxy writes into it.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), MMA_THREADS / 32);
        }
        // make the initialised barriers visible to the async proxy (the TMA unit's complete_tx)
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        // the host rewrites a tensor map in place when a caller's pointer changes: drop any stale copy
        // the TMA unit cached, then fetch the current one
        for (const CUtensorMap* m : {tmap_x, tmap_w, tmap_w2}) {
            if (m == nullptr) continue;
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(m) : "memory");
            cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(m));
        }
    }
    mega_sync();

    // k-tile kt -> slot kt % STAGES: one arrive.expect_tx (the whole slot), the weight boxes, and x's box
    // (coordinates innermost first: {k, row}). Thread 0 only. The first stages' weights go out before
    // the wait on x's producer, x's after it.
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    const bool gated = epi == GEMM_GATED;
    const int wb = w_box(BN, gated);  // a gated tile: w's box, then w2's
    auto issue_w = [&](int kt) {
        const int s = kt % STAGES;
        mbar_arrive_expect_tx(full(s), TX_BYTES);
        for (int b = 0; b < BN / wb; ++b) {
            const CUtensorMap* m = gated && b == 1 ? tmap_w2 : tmap_w;
            const int row = gated ? n0 : n0 + wb * b;
            SM90_TMA_LOAD_2D::copy(m, bar_ptr + s, hint, ring_b + s * (BN * BK) + b * (wb * BK), k0 + kt * BK, row);
        }
    };
    auto issue_x = [&](int kt) {
        const int s = kt % STAGES;
        SM90_TMA_LOAD_2D::copy(tmap_x, bar_ptr + s, hint, ring_a + s * (BM * BK), k0 + kt * BK, m0);
    };
    const int first = cmin(STAGES, KT);
    if (tid == 0) {
        for (int kt = 0; kt < first; ++kt) issue_w(kt);
    }
    const bool go = wait_inputs();
    if (tid == 0) {
        // x was written by other blocks' generic stores, made visible by the wait's acquire; the TMA reads
        // it through the async proxy
        asm volatile("fence.proxy.async.global;" ::: "memory");
        for (int kt = 0; kt < first; ++kt) issue_x(kt);
    }
    // Retire the barriers (every thread, once every wait on them has passed), freeing the memory.
    auto retire = [&] {
        mega_sync();
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_inval(full(s));
                mbar_inval(empty(s));
            }
        }
        mega_sync();
    };
    if (!go) {  // drain what was issued (a CTA must not exit with copies in flight), retire, report
        for (int kt = 0; kt < first; ++kt) mbar_wait(full(kt), 0);
        retire();
        return false;
    }

    // --- CuTe views: the rings as swizzled K-major tensors, the tiled MMA, this thread's fragments ---
    using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<BM>{}, Int<BK>{}, Int<STAGES>{})));
    using LayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<BN>{}, Int<BK>{}, Int<STAGES>{})));
    static_assert(cosize_v<LayoutA> == STAGES * BM * BK && cosize_v<LayoutB> == STAGES * BN * BK,
                  "gemm_tile: the smem layouts must be the dense rings the TMA fills");
    // What the TMA writes with SWIZZLE_128B: box row r (128 bytes) at r * 128 bytes, its 16-byte chunks
    // permuted by address bits [4:6] ^= [7:9]; boxes (stages) one after another. CuTe's form of it: the
    // unswizzled layout dense in that order, composed with Swizzle<3,4,3> applied to byte addresses
    // (smem_ptr_flag; CuTe's own TMA code maps Swizzle<3,4,3> to SWIZZLE_128B: get_tma_swizzle_bits).
    // A B slot of two boxes (256 rows, or a gated tile's two halves) holds them one after the other: the
    // same dense order (each box a multiple of 8 rows: whole 1024-byte swizzle atoms).
    static_assert(is_same_v<remove_cvref_t<decltype(LayoutA{}.layout_a())>, Swizzle<3, 4, 3>> &&
                      is_same_v<remove_cvref_t<decltype(LayoutB{}.layout_a())>, Swizzle<3, 4, 3>>,
                  "gemm_tile: the smem layouts must use the 128-byte swizzle (the tensor maps' SWIZZLE_128B)");
    static_assert(LayoutA{}.layout_b()(1, 0, 0) == BK && LayoutA{}.layout_b()(9, 5, 0) == 9 * BK + 5 &&
                      LayoutA{}.layout_b()(BM - 1, BK - 1, 1) == 2 * BM * BK - 1 &&
                      LayoutB{}.layout_b()(1, 0, 0) == BK && LayoutB{}.layout_b()(BN - 1, BK - 1, 1) == 2 * BN * BK - 1,
                  "gemm_tile: the smem layouts must be the TMA boxes' order: rows of BK, then stages");
    Tensor sA = make_tensor(make_smem_ptr(ring_a), LayoutA{});  // (BM, BK, STAGES)
    Tensor sB = make_tensor(make_smem_ptr(ring_b), LayoutB{});  // (BN, BK, STAGES)
    auto tiled_mma = make_tiled_mma(typename Mma<BN>::Atom{}, Layout<Shape<Int<BM / 64>, _1, _1>>{});
    // (BM = 64: warpgroup 1 goes to the end. The warpgroup index through a shuffle, as CUTLASS's
    // canonical_warp_group_idx: ptxas then knows the branch is warp-uniform and keeps the wgmmas async.)
    if (BM == 128 || __shfl_sync(0xffffffffu, tid / 128, 0) * 128 < MMA_THREADS) {
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor tCsA = thr_mma.partition_A(sA);          // (MMA, MMA_M, MMA_K, STAGES)
    Tensor tCsB = thr_mma.partition_B(sB);          // (MMA, MMA_N, MMA_K, STAGES)
    Tensor tCrA = thr_mma.make_fragment_A(tCsA);    // wgmma smem descriptors
    Tensor tCrB = thr_mma.make_fragment_B(tCsB);
    Tensor acc = partition_fragment_C(tiled_mma, make_shape(Int<BM>{}, Int<BN>{}));  // (MMA, MMA_M, MMA_N) f32
    static_assert(size<2>(tCrA) == BK / 16, "gemm_tile: 4 wgmma k-blocks a stage");
    clear(acc);

    // --- main loop ---------------------------------------------------------------------------------
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(full(s), (uint32_t)((kt / STAGES) & 1));
        // (no __syncwarp here: every lane reads the same barrier phase, and one made ptxas serialise the
        // wgmmas, C7518, over the timeout's divergent __trap path; CUTLASS's consumer_wait has none either)
        warpgroup_fence_operand(acc);
        warpgroup_arrive();  // wgmma.fence: acc's (and the descriptors') register writes before the wgmmas
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb)
            cute::gemm(tiled_mma, tCrA(_, _, kb, s), tCrB(_, _, kb, s), acc);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // k-tile kt - 1's wgmmas are done (kt's may still run)
        warpgroup_fence_operand(acc);
        if (kt > 0) {
            const int sp = (kt - 1) % STAGES;
            if (lane == 0) mbar_arrive(empty(sp));  // this warp no longer reads slot sp
            if (tid == 0 && kt - 1 + STAGES < KT) {
                mbar_wait(empty(sp), (uint32_t)(((kt - 1) / STAGES) & 1));  // all 8 warps released k-tile kt - 1
                issue_w(kt - 1 + STAGES);
                issue_x(kt - 1 + STAGES);
            }
            __syncwarp();  // reconverge warp 0 before the next .aligned wgmma instructions
        }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);

    // --- epilogue: f32 -> bf16, straight from the accumulators to global memory --------------------
    Tensor cC = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
    Tensor tCcC = thr_mma.partition_C(cC);  // the (row, col) of each accumulator
    if (o.part != nullptr) gemm_tile_detail::store_partial<BN>(acc, tCcC, o);
    else if (epi == GEMM_GATED) gemm_tile_detail::store<GEMM_GATED, BN>(acc, tCcC, o);
    else if (epi == GEMM_RESID) gemm_tile_detail::store<GEMM_RESID, BN>(acc, tCcC, o);
    else gemm_tile_detail::store<GEMM_PLAIN, BN>(acc, tCcC, o);
    }  // (the warpgroups running wgmmas)

    retire();  // (every warp's wgmmas are done and every barrier wait passed)
    return true;
}
