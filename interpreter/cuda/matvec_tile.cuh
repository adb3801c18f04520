// matvec into the reserved epilogue tile: the top 4 KB of dynamic shared memory, which the
// matvec body never touches. Fused kinds (matvec_heads, matvec_argmax) compute their
// instance's ROWS products there, then post-process them in place.
#pragma once
#include "common.cuh"
#include "matvec.cuh"

template <class T, int K, int ROWS, bool HAS_NORM>
__device__ __forceinline__ T* matvec_to_tile(char* smem, const T* x, long long x_s0, long long x_s1,  //
                                             const T* g, long long g_s0, float eps,                    //
                                             const T* w, long long w_s0, long long w_s1, long long N, long long n_tile) {
    static_assert(ROWS * sizeof(T) <= 4096, "matvec_to_tile: the rows must fit the reserved 4 KB");
    T* tile = reinterpret_cast<T*>(smem + MEGA_SMEM - 4096);
    // row n lands at tile[n - n_tile * ROWS]: a generic pointer into shared memory
    matvec<T, 1, K, ROWS, HAS_NORM, false, false, true>(smem, x, x_s0, x_s1, g, g_s0, eps, w, w_s0, w_s1, nullptr, 0,
                                                                0, nullptr, 0, 0, nullptr, 0, 0, nullptr, 0, 0,
                                                                tile - n_tile * ROWS, 0, 1, N, n_tile, 1,
                                                                MegaWaits{});
    mega_sync();
    return tile;
}
