// argmax in two block ops (blockops/argmax.py); ties resolve to the lowest index.
// argmax_partial: instance c0 scans columns [c0*chunk, min(c0*chunk + chunk, N)) of every
//   row of x[M, N] and writes part[m, c0, 0] = best value, part[m, c0, 1] = float(index).
// argmax_reduce: instance c0 picks row c0's best over the T chunk partials (first chunk
//   holding the max = lowest index) and writes the i32 index to out[c0].
// A row of -inf gives its first index (the partial writes -inf at the chunk's first column). A NaN
// reports MEGA_ERR_NAN (detail: the row, megaegg.sampling.NaNError on the CPU); the partial skips it,
// so the index written is still in [0, N).
#pragma once
#include "common.cuh"

#ifndef MEGA_ERR_NAN
#define MEGA_ERR_NAN 4  // (runtime.cuh)
#endif

namespace argmax_impl {

// (v, i) beats (bv, bi): larger value, or equal value at a lower index.
__device__ __forceinline__ bool better(float v, long long i, float bv, long long bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index); every thread gets it. red: >= 2 * MEGA_WARPS * 8 bytes.
__device__ __forceinline__ void block_best(float& bv, long long& bi, char* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(MEGA_FULL_MASK, bv, o);
        const long long i = __shfl_xor_sync(MEGA_FULL_MASK, bi, o);
        if (better(v, i, bv, bi)) bv = v, bi = i;
    }
    float* rv = reinterpret_cast<float*>(red);
    long long* ri = reinterpret_cast<long long*>(red + 8 * MEGA_WARPS);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    mega_sync();
    if (lane == 0) rv[warp] = bv, ri[warp] = bi;
    mega_sync();
    bv = lane < MEGA_WARPS ? rv[lane] : MEGA_NEG_INF;
    bi = lane < MEGA_WARPS ? ri[lane] : 0x7fffffffffffffffll;
    __syncwarp();  // (converged after the lane-0 store: one copy of the shuffles)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(MEGA_FULL_MASK, bv, o);
        const long long i = __shfl_xor_sync(MEGA_FULL_MASK, bi, o);
        if (better(v, i, bv, bi)) bv = v, bi = i;
    }
}

}  // namespace argmax_impl

// Each thread visits its columns in increasing order, so within a thread a strictly larger value is
// the only way to win (ties keep the earlier, lower index); indices are int offsets from the chunk's
// first column (a chunk is far below 2^31 columns), made absolute for the block-wide comparison.
template <class T>
__device__ __noinline__ void argmax_partial(char* smem, Mat<const T> x, long long M, long long N, long long chunk,
                                            Mat<float> part, long long c0) {
    in_global(x, part);
    constexpr int VEC = VecN<T>::value;
    const long long k0 = c0 * chunk;
    const int n = (int)(min_i64(k0 + chunk, N) - k0);
    long long nan_row = -1;  // a row where this thread met a NaN
    for (long long m = 0; m < M; ++m) {
        const T* xr = x.p + m * x.s0 + k0 * x.s1;
        float bv = MEGA_NEG_INF;
        int bo = 0x7fffffff;
        bool nan = false;
        if (x.s1 == 1 && aligned16(xr) && n % VEC == 0) {
#pragma unroll 4
            for (int k = threadIdx.x * VEC; k < n; k += MEGA_THREADS * VEC) {
                float f[VEC];
                load16_f32(xr + k, f);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    nan |= f[e] != f[e];
                    if (f[e] > bv) bv = f[e], bo = k + e;
                }
            }
        } else {
#pragma unroll 4
            for (int k = threadIdx.x; k < n; k += MEGA_THREADS) {
                const float v = ld_f32(xr + k * x.s1);
                nan |= v != v;
                if (v > bv) bv = v, bo = k;
            }
        }
        if (nan) nan_row = m;
        long long bi = bo == 0x7fffffff ? 0x7fffffffffffffffll : k0 + bo;
        __syncwarp();  // the compiler then knows the warp converged: one copy of the shuffles, not two
        argmax_impl::block_best(bv, bi, shared_ptr(smem));
        if (threadIdx.x == 0) {
            part.p[m * part.s0 + c0 * part.s1] = bv;
            part.p[m * part.s0 + c0 * part.s1 + 1] = (float)(bi < N ? bi : k0);  // (no value above -inf: the first column)
        }
    }
    if (nan_row >= 0) mega_body_error(MEGA_ERR_NAN, nan_row);
}

__device__ __noinline__ void argmax_reduce(char* smem, Mat<const float> part, long long T, Vec<int> out, long long c0) {
    in_global(part, out);
    float bv = MEGA_NEG_INF;
    long long bi = 0x7fffffffffffffffll;  // chunk number: the first best chunk has the lowest index
    for (long long t = threadIdx.x; t < T; t += MEGA_THREADS) {
        const float v = ld_cg(part.p + c0 * part.s0 + t * part.s1);
        if (argmax_impl::better(v, t, bv, bi)) bv = v, bi = t;
    }
    argmax_impl::block_best(bv, bi, shared_ptr(smem));
    if (threadIdx.x == 0) out.p[c0 * out.s0] = bi < T ? (int)ld_cg(part.p + c0 * part.s0 + bi * part.s1 + 1) : 0;
}
