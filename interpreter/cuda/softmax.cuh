// softmax_rows: out[r] = T(exp(x[r] - max) * (1 / sum exp(x[r] - max))) for rows
// [c0*rows_per, min(c0*rows_per + rows_per, rows)) of x[rows, D] (blockops/softmax.py;
// the order follows torch's CPU kernel: max, sum of exps, multiply by the reciprocal).
// D is a runtime value: a warp per row when D <= 1024, else the block per row. Three
// passes over the row (max, sum, write); the later two hit L2.
#pragma once
#include "common.cuh"

namespace softmax_impl {

template <class T, int TEAM>
__device__ __forceinline__ void rows(float* red, const T* x, long long x_s0, long long x_s1, T* out, long long out_s0,
                                     long long out_s1, long long D, long long r0, long long r1) {
    const int t = TEAM == 32 ? (threadIdx.x & 31) : threadIdx.x;
    const int team = TEAM == 32 ? (threadIdx.x >> 5) : 0, nteams = MEGA_THREADS / TEAM;
#pragma unroll 1
    for (long long r = r0 + team; r < r1; r += nteams) {
        const T* xr = x + r * x_s0;
        float mx = MEGA_NEG_INF;
#pragma unroll 4
        for (long long k = t; k < D; k += TEAM) mx = fmaxf(mx, ld_f32(xr + k * x_s1));
        mx = TEAM == 32 ? warp_max(mx) : block_reduce_max(mx, red);
        float sum = 0.0f;
#pragma unroll 4
        for (long long k = t; k < D; k += TEAM) sum += expf(ld_f32(xr + k * x_s1) - mx);
        sum = TEAM == 32 ? warp_sum(sum) : block_reduce_sum(sum, red);
        const float inv = 1.0f / sum;
#pragma unroll 4
        for (long long k = t; k < D; k += TEAM) out[r * out_s0 + k * out_s1] = from_f32<T>(expf(ld_f32(xr + k * x_s1) - mx) * inv);
    }
}

}  // namespace softmax_impl

template <class T>
__device__ __noinline__ void softmax_rows(char* smem, Mat<const T> x, Mat<T> out, long long D, long long rows,
                                          int rows_per, long long c0) {
    in_global(x, out);
    const long long r0 = c0 * rows_per, r1 = min_i64(r0 + rows_per, rows);
    float* red = shared_ptr<float>(smem);
    if (D <= 1024)
        softmax_impl::rows<T, 32>(red, x.p, x.s0, x.s1, out.p, out.s0, out.s1, D, r0, r1);
    else
        softmax_impl::rows<T, MEGA_THREADS>(red, x.p, x.s0, x.s1, out.p, out.s0, out.s1, D, r0, r1);
}
