// rms_norm_rows: out[r] = T(T(x[r] * rsqrt(mean(x[r]^2) + eps)) * g) for rows
// [c0*rows_per, min(c0*rows_per + rows_per, rows)) of x[rows, D] (blockops/rownorm.py).
// A warp per row when D <= 1024, or D <= 4096 and the op's instances take 4 rows or more (rows_per,
// chosen at compile time: no block barrier, 8 rows in flight), else the whole block per row (a block
// barrier a row: a 16-row instance of D = 2048 took ~16 us that way, perf-notes #83; one row of D = 4096
// on one warp made qwen3-8b's batch-1 step ~6% slower). The row stays in registers between the
// reduction and the write (g too where a lane holds at most 32 elements, else g is read again for the
// write); 16-byte loads/stores when the rows allow, element by element otherwise.
#pragma once
#include "common.cuh"

namespace rownorm_impl {

template <class T, int D, int TEAM>
__device__ __forceinline__ void rows(float* red, const T* x, long long x_s0, long long x_s1, const T* g,
                                     long long g_s0, float eps, T* out, long long out_s0, long long out_s1,
                                     long long r0, long long r1, bool vec) {
    constexpr int VEC = VecN<T>::value;
    constexpr int NV = cdiv(cdiv(D, VEC), TEAM);        // vectors per thread (vector path)
    constexpr int NS = cdiv(D, TEAM);                   // elements per thread (scalar path)
    constexpr int NE = cmax(NV * VEC, NS);
    constexpr bool KEEP_G = NE <= 32;                  // g's elements in registers too
    constexpr int NG = KEEP_G ? NE : 1;
    static_assert(NE <= 128, "rms_norm: row too long to keep in registers");
    const int t = TEAM == 32 ? (threadIdx.x & 31) : threadIdx.x;
    const int team = TEAM == 32 ? (threadIdx.x >> 5) : 0, nteams = MEGA_THREADS / TEAM;
#pragma unroll 1
    for (long long r = r0 + team; r < r1; r += nteams) {
        float xv[NE], gv[NG];
        float ss = 0.0f;
        if (vec) {
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int vi = i * TEAM + t;
                if (vi * VEC < D) {
                    load16_f32(x + r * x_s0 + vi * VEC, xv + i * VEC);
                    if constexpr (KEEP_G) load16_f32(g + vi * VEC, gv + i * VEC);
                }
            }
#pragma unroll
            for (int i = 0; i < NV; ++i)
                if ((i * TEAM + t) * VEC < D)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) ss += xv[i * VEC + e] * xv[i * VEC + e];
        } else {
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int k = i * TEAM + t;
                if (k < D) {
                    xv[i] = ld_f32(x + r * x_s0 + k * x_s1);
                    if constexpr (KEEP_G) gv[i] = ld_f32(g + k * g_s0);
                    ss += xv[i] * xv[i];
                }
            }
        }
        ss = TEAM == 32 ? warp_sum(ss) : block_reduce_sum(ss, red);
        const float rinv = 1.0f / sqrtf(ss / (float)D + eps);
        if (vec) {
#pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int vi = i * TEAM + t;
                if (vi * VEC < D) {
                    float y[VEC], gw[VEC];
                    if constexpr (KEEP_G) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) gw[e] = gv[i * VEC + e];
                    } else {
                        load16_f32(g + vi * VEC, gw);
                    }
#pragma unroll
                    for (int e = 0; e < VEC; ++e) y[e] = round_to<T>(xv[i * VEC + e] * rinv) * gw[e];
                    *reinterpret_cast<uint4*>(out + r * out_s0 + vi * VEC) = pack16<T>(y);
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int k = i * TEAM + t;
                if (k < D) {
                    float gk;
                    if constexpr (KEEP_G) gk = gv[i];
                    else gk = ld_f32(g + k * g_s0);
                    out[r * out_s0 + k * out_s1] = from_f32<T>(round_to<T>(xv[i] * rinv) * gk);
                }
            }
        }
    }
}

}  // namespace rownorm_impl

// TEAM: 32 (a warp a row) or MEGA_THREADS (the block a row), the host's choice (blockops/rownorm.py:
// norm_team) from D and rows_per; one path an instantiation (the two in one function made ptxas schedule
// the warp path's loads worse: a 2048-token prefill 4% slower, perf-notes #83).
template <class T, int D, int TEAM>
__device__ __noinline__ void rms_norm_rows(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<T> out,
                                           long long rows, int rows_per, long long c0) {
    static_assert(TEAM == 32 || TEAM == MEGA_THREADS, "rms_norm: a warp or the block a row");
    in_global(x, g, out);
    const long long r0 = c0 * rows_per, r1 = min_i64(r0 + rows_per, rows);
    const bool vec = D % VecN<T>::value == 0 && vec_rows_ok(x.p, x.s0, x.s1, D) && vec_rows_ok(out.p, out.s0, out.s1, D) &&
                     g.s0 == 1 && aligned16(g.p);
    float* red = shared_ptr<float>(smem);
    rownorm_impl::rows<T, D, TEAM>(red, x.p, x.s0, x.s1, g.p, g.s0, eps, out.p, out.s0, out.s1, r0, r1, vec);
}
