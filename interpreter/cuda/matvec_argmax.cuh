// matvec_argmax (megaegg/blockops/matvec_argmax.py is the definition): the matvec body
// computes this instance's ROWS logits into the reserved top 4 KB of shared memory; the
// block reduces them to (max, lowest index of the max) and writes part[j] = {max, index}: the
// tile's first row when every logit is -inf; a NaN logit reports MEGA_ERR_NAN (detail: row 0) and
// is skipped, so the index stays in [0, N).
#pragma once
#include "common.cuh"
#include "matvec_tile.cuh"

#ifndef MEGA_ERR_NAN
#define MEGA_ERR_NAN 4  // (runtime.cuh)
#endif

template <class T, int K, int ROWS, bool HAS_NORM>
__device__ __noinline__ void matvec_argmax(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                           Vec<float> part, long long N, long long n_tile) {
    in_global(x, w, part);  // (not the optional g: an absent view is nullptr)
    __shared__ float warp_best[MEGA_THREADS / 32];
    __shared__ int warp_index[MEGA_THREADS / 32];
    const T* tile = matvec_to_tile<T, K, ROWS, HAS_NORM>(smem, x, g, eps, w, N, n_tile);
    const long long n0 = n_tile * ROWS;
    const int nrows = (int)min_i64(ROWS, N - n0);
    float best = MEGA_NEG_INF;
    int index = 0x7fffffff;
    bool nan = false;
    for (int i = threadIdx.x; i < nrows; i += MEGA_THREADS) {
        const float v = to_f32(tile[i]);
        nan |= v != v;
        if (v > best || (v == best && i < index)) best = v, index = i;
    }
    if (nan) mega_body_error(MEGA_ERR_NAN, 0);
    for (int o = 16; o > 0; o >>= 1) {  // ties keep the lowest index, as torch.argmax
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, index, o);
        if (ov > best || (ov == best && oi < index)) best = ov, index = oi;
    }
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best, warp_index[threadIdx.x >> 5] = index;
    mega_sync();
    if (threadIdx.x == 0) {
        for (int i = 1; i < MEGA_THREADS / 32; ++i)
            if (warp_best[i] > best || (warp_best[i] == best && warp_index[i] < index)) best = warp_best[i], index = warp_index[i];
        part.p[n_tile * part.s0] = best;
        part.p[n_tile * part.s0 + 1] = (float)(n0 + (index < nrows ? index : 0));
    }
    mega_sync();  // the tile is reused by the next instance
}
