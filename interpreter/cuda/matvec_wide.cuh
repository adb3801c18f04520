// The runtime-M matvec's wide tile: up to 64 x rows against ROWS weight rows on tensor cores, both
// operands staged through a cp.async ring in shared memory (megaegg/blockops/matvec.py: WIDE_MROWS;
// docs/perf-notes.md #79). matvec() runs it when a tile of 64 x rows has more valid rows than the
// staged body (run_mma) takes; a batch of 17-64 rows then reads each weight tile once, where 16-row
// tiles read it once per 16 rows. Included by matvec.cuh (MmaKind, MEGA_SMEM_RESERVED).
//
// Per stage (BK = 128 columns of K where 4 stages fit, else 64): the tile's weight rows (RG groups of
// 16, padded; with w2 the up rows follow the gate rows) and XM x rows (32 when at most 32 are valid:
// twice the stages in the same shared memory), each row BK + 8 elements (16-byte aligned, ldmatrix
// without bank conflicts), and with the norm the stage's BK elements of g. The weights of the first STAGES - 1 stages are
// issued before the barrier wait (they depend on no producer).
//
// Warps: WG x WN x WK = 8; warp (wg, wn, wk) owns weight groups [wg*GW, +GW), x tiles of 8 rows
// [wn*NW, +NW) and every WK-th k16 step of a stage (mma.sync m16n8k16 with the weights as A, x as B:
// C's rows are output columns, its columns x rows); the epilogue sums the WK partial products. x
// tiles past the valid rows are skipped.
//
// RMSNorm (NORM): a stage's x is scaled by g in place once it lands (T(x * g)), and each thread sums
// the squares of the raw values it scaled; the products are scaled by 1 / rms(x) at the end. Rounding
// therefore differs from the unfused ops' T(T(x * rinv) * g) by about one rounding of T (the GPU
// tests compare at T's tolerance), and an unnormalised x * g could overflow f16: the compiler fuses the
// norm into a wide tile for bf16 only (megaegg/blockops/matvec.py: MatVecTerm.fits).
#pragma once
#include "common.cuh"

namespace matvec_impl {

__host__ __device__ constexpr int cgcd(int a, int b) { return b == 0 ? a : cgcd(b, a % b); }

template <class T, int K, int ROWS, bool NORM, bool GLU, int XM_>
struct WidePlan {
    static constexpr int XM = XM_;                         // x rows a tile (32 or 64)
    static constexpr int RG = cdiv(ROWS, 16);              // weight row groups of 16
    static constexpr int WROWS = RG * 16 * (GLU ? 2 : 1);  // weight rows a stage (gate, then up)
    static constexpr int BUDGET = MEGA_SMEM - MEGA_SMEM_RESERVED - (NORM ? XM * 4 : 0);
    // K columns a stage: 128 where 4 stages of them fit (half the block barriers of 64), else 64
    static constexpr int BK = K % 128 == 0 && 4 * ((WROWS + XM) * 136 * (int)sizeof(T) + (NORM ? 256 : 0)) <= BUDGET ? 128 : 64;
    static constexpr int LD = BK + 8;                      // shared row stride, elements (16-byte aligned rows
                                                           // 4 banks apart: ldmatrix without bank conflicts)
    static constexpr int NK = K / BK;                      // stages a tile
    static constexpr int CPR = BK / 8;                     // 16-byte copies a row
    static constexpr int WG = cgcd(RG, MEGA_WARPS);        // warps along the weight groups
    static constexpr int WN = cmin(MEGA_WARPS / WG, XM / 8);  // ... along the x tiles of 8 rows
    static constexpr int WK = MEGA_WARPS / (WG * WN);      // ... along a stage's 4 k16 steps
    static constexpr int GW = RG / WG;                     // weight groups a warp
    static constexpr int NW = (XM / 8) / WN;               // x tiles a warp
    static constexpr int SUMS = WK * (GLU ? 2 : 1);        // f32 product tiles the epilogue sums
    static constexpr int STAGE = (WROWS + XM) * LD * (int)sizeof(T) + (NORM ? BK * (int)sizeof(T) : 0);
    static constexpr int EP = RG * 16 + 4;                 // epilogue tile row stride (f32)
    static constexpr int STAGES = cmin(16, BUDGET / STAGE);
    static_assert(K % BK == 0 && (BK / 16) % WK == 0 && WG * WN * WK == MEGA_WARPS && XM * BK % (8 * MEGA_THREADS) == 0,
                  "matvec (wide): K a multiple of 64");
    static_assert(GW * NW * (GLU ? 2 : 1) <= 16, "matvec (wide): at most 64 accumulators a thread");
    static_assert(STAGES >= 2, "matvec (wide): two stages do not fit in shared memory");
    static_assert(SUMS * XM * EP * 4 <= STAGES * STAGE, "matvec (wide): the epilogue tiles do not fit in the ring");
};

// Whether a tile of this shape can be wide (mirrors megaegg/blockops/matvec.py: wide_fits): a warp holds
// RG accumulator fragments (GW x NW), two sets when gated.
template <class T, int K, int ROWS, bool GLU>
__host__ __device__ constexpr bool wide_fits() {
    return MmaKind<T>::ok && K % 64 == 0 && cdiv(ROWS, 16) * (GLU ? 2 : 1) <= 16;
}

// The x rows the staged body (run_mma) takes in a wide tile's place when no more are valid (mirrors
// megaegg/blockops/matvec.py: MMA_STAGE_BYTES): 16, or 8 when 16 normalised rows do not fit its
// staging; 0 when neither does (the wide tile takes every row count).
template <class T, int K, bool NORM>
__host__ __device__ constexpr int staged_rows() {
    return !NORM || 16 * (K + 8) * (int)sizeof(T) <= 80 * 1024 ? 16 : 8 * (K + 8) * (int)sizeof(T) <= 80 * 1024 ? 8 : 0;
}

// O: the output's element type, T (rounded, with the epilogue) or float (a split's partial products)
template <class T, int K, int ROWS, bool NORM, bool GLU, bool RES, int XM, class O = T>
__device__ __noinline__ bool run_wide(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                      Mat<const T> w2, Mat<const T> r, Mat<O> out, long long N, long long n_tile,
                                      const MegaWaits wl, int mv) {
    using P = WidePlan<T, K, ROWS, NORM, GLU, XM>;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
    const int wg = warp / (P::WN * P::WK), wn = warp / P::WK % P::WN, wk = warp % P::WK;
    const long long row0 = n_tile * ROWS;
    T* ring = reinterpret_cast<T*>(smem);
    float* rinv = reinterpret_cast<float*>(smem + P::STAGES * P::STAGE);  // (NORM: after the ring)
    const auto stage_w = [&](int s) { return ring + s * (P::STAGE / (int)sizeof(T)); };
    const auto stage_x = [&](int s) { return stage_w(s) + P::WROWS * P::LD; };
    const auto stage_g = [&](int s) { return stage_x(s) + P::XM * P::LD; };

    // the weight rows of stage s (k-tile kt): CPR 16-byte copies a row; rows past the tile or N are zeros
    const auto load_w = [&](int s, int kt) {
        T* dst = stage_w(s);
#pragma unroll 2
        for (int i = tid; i < P::WROWS * P::CPR; i += MEGA_THREADS) {
            const int lr = i / P::CPR, c = (i % P::CPR) * 8;
            const bool up = GLU && lr >= P::RG * 16;
            const int local = up ? lr - P::RG * 16 : lr;
            const bool ok = local < ROWS && row0 + local < N;
            const T* src = (up ? w2.p + (row0 + local) * w2.s0 : w.p + (row0 + local) * w.s0) + kt * P::BK + c;
            cp_async16(dst + lr * P::LD + c, ok ? src : w.p, ok ? 16 : 0);
        }
    };
    // the x rows (past mv: zeros) and, with the norm, g's columns of stage s
    const auto load_x = [&](int s, int kt) {
        T* dst = stage_x(s);
#pragma unroll 2
        for (int i = tid; i < P::XM * P::CPR; i += MEGA_THREADS) {
            const int m = i / P::CPR, c = (i % P::CPR) * 8;
            const bool ok = m < mv;
            cp_async16(dst + m * P::LD + c, ok ? x.p + m * x.s0 + kt * P::BK + c : x.p, ok ? 16 : 0);
        }
        if (NORM && tid < P::CPR) cp_async16(stage_g(s) + tid * 8, g.p + kt * P::BK + tid * 8, 16);
    };

#pragma unroll 1
    for (int s = 0; s < P::STAGES - 1 && s < P::NK; ++s) load_w(s, s);  // no producer: before the wait
    if (!mega_wait_all(wl)) {
        cp_async_commit();  // (wait_group counts committed groups only: the weights' copies join one)
        cp_async_wait<0>();  // nothing may land in shared memory after the body returns
        return false;
    }
#pragma unroll 1
    for (int s = 0; s < P::STAGES - 1; ++s) {
        if (s < P::NK) load_x(s, s);
        cp_async_commit();  // one group a stage (empty past NK): the wait below counts groups
    }

    float acc[P::GW][P::NW][4], acc2[GLU ? P::GW : 1][GLU ? P::NW : 1][4];
#pragma unroll
    for (int i = 0; i < P::GW; ++i)
#pragma unroll
        for (int n = 0; n < P::NW; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.0f, acc2[GLU ? i : 0][GLU ? n : 0][e] = 0.0f;
    float ss = 0.0f;  // NORM: sum of squares of the x row this thread scales
    const int nt0 = wn * P::NW;  // the warp's first x tile

#pragma unroll 1
    for (int kt = 0; kt < P::NK; ++kt) {
        const int s = kt % P::STAGES;
        cp_async_wait<P::STAGES - 2>();
        mega_sync();  // stage kt landed for every thread; every warp is done with stage kt - 1
        if constexpr (NORM) {  // x <- T(x * g) in place; the raw squares summed
            constexpr int CPT = P::XM * P::BK / MEGA_THREADS, TPR = P::BK / CPT;  // columns a thread, threads a row
            T* xr = stage_x(s) + (tid / TPR) * P::LD + (tid % TPR) * CPT;
            const T* gr = stage_g(s) + (tid % TPR) * CPT;
#pragma unroll
            for (int h = 0; h < CPT / 8; ++h) {
                float f[8], gf[8];
                unpack16<T>(*reinterpret_cast<const uint4*>(xr + h * 8), f);
                unpack16<T>(*reinterpret_cast<const uint4*>(gr + h * 8), gf);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss += f[e] * f[e], f[e] = round_to<T>(f[e] * gf[e]);
                *reinterpret_cast<uint4*>(xr + h * 8) = pack16<T>(f);
            }
            mega_sync();
        }
        const int next = kt + P::STAGES - 1;  // into the slot stage kt - 1 left
        if (next < P::NK) {
            load_w(next % P::STAGES, next);
            load_x(next % P::STAGES, next);
        }
        cp_async_commit();
        if (nt0 * 8 < mv) {
            const T* ws = stage_w(s);
            const T* xs = stage_x(s);
#pragma unroll
            for (int kq = 0; kq < P::BK / 16 / P::WK; ++kq) {
                const int kk = kq * P::WK + wk;
                unsigned b[P::NW][2];
#pragma unroll
                for (int n = 0; n < P::NW; n += 2) {
                    if constexpr (P::NW % 2 == 0) {  // two x tiles a load: (tile n, k lo), (n, k hi), (n + 1, lo), (n + 1, hi)
                        const int q = lane >> 3;
                        unsigned f[4];
                        ldmatrix_x4(f, xs + ((nt0 + n + (q >> 1)) * 8 + (lane & 7)) * P::LD + kk * 16 + (q & 1) * 8);
                        b[n][0] = f[0], b[n][1] = f[1], b[n + 1][0] = f[2], b[n + 1][1] = f[3];
                    } else {
                        unsigned f[2];
                        ldmatrix_x2(f, xs + ((nt0 + n) * 8 + (lane & 7)) * P::LD + kk * 16 + ((lane >> 3) & 1) * 8);
                        b[n][0] = f[0], b[n][1] = f[1];
                    }
                }
#pragma unroll
                for (int i = 0; i < P::GW; ++i) {
                    const int grp = wg * P::GW + i;
                    unsigned a[4];
                    ldmatrix_x4(a, ws + (grp * 16 + (lane & 15)) * P::LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                    for (int n = 0; n < P::NW; ++n)
                        if ((nt0 + n) * 8 < mv) mma16816<T>(acc[i][n], a[0], a[1], a[2], a[3], b[n][0], b[n][1]);
                    if constexpr (GLU) {
                        unsigned a2[4];
                        ldmatrix_x4(a2, ws + ((P::RG + grp) * 16 + (lane & 15)) * P::LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                        for (int n = 0; n < P::NW; ++n)
                            if ((nt0 + n) * 8 < mv)
                                mma16816<T>(acc2[GLU ? i : 0][GLU ? n : 0], a2[0], a2[1], a2[2], a2[3], b[n][0], b[n][1]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    if constexpr (NORM) {  // the TPR neighbouring threads of a row hold its squares
        constexpr int TPR = MEGA_THREADS / P::XM;
#pragma unroll
        for (int o = 1; o < TPR; o <<= 1) ss += __shfl_xor_sync(MEGA_FULL_MASK, ss, o);
        if (tid % TPR == 0) rinv[tid / TPR] = 1.0f / sqrtf(ss / (float)K + eps);
    }
    mega_sync();  // the ring is free (every copy landed, every warp done): the epilogue tile goes there

    // each warp's f32 products into e[k part][gate / up][x row][tile row]; then summed, scaled by 1 / rms,
    // gated, rounded and stored with the residual
    float* e = reinterpret_cast<float*>(smem);
    const auto tile = [&](int part, int which) { return e + (part * (GLU ? 2 : 1) + which) * P::XM * P::EP; };
#pragma unroll
    for (int i = 0; i < P::GW; ++i)
#pragma unroll
        for (int n = 0; n < P::NW; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int lr = (wg * P::GW + i) * 16 + gq + (c >> 1) * 8, m = (nt0 + n) * 8 + 2 * t4 + (c & 1);
                tile(wk, 0)[m * P::EP + lr] = acc[i][n][c];
                if constexpr (GLU) tile(wk, 1)[m * P::EP + lr] = acc2[i][n][c];
            }
    mega_sync();
    for (int i = tid; i < P::XM * ROWS; i += MEGA_THREADS) {
        const int m = i / ROWS, local = i % ROWS;
        const long long n = row0 + local;
        if (m >= mv || n >= N) continue;
        float d = 0.0f, d2 = 0.0f;
#pragma unroll
        for (int part = 0; part < P::WK; ++part) {
            d += tile(part, 0)[m * P::EP + local];
            if (GLU) d2 += tile(part, GLU ? 1 : 0)[m * P::EP + local];
        }
        if (NORM) d *= rinv[m], d2 *= rinv[m];
        store_mma_output<T, GLU, RES>(d, d2, r, out, m, n);
    }
    return true;
}

}  // namespace matvec_impl
