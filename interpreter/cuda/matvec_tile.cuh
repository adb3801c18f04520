// matvec into the reserved epilogue tile: the top 4 KB of dynamic shared memory, which the
// matvec body never touches. Fused kinds (matvec_heads, matvec_argmax) compute their
// instance's ROWS products there, then post-process them in place.
#pragma once
#include "common.cuh"
#include "matvec.cuh"

template <class T, int K, int ROWS, bool HAS_NORM>
__device__ __forceinline__ T* matvec_to_tile(char* smem, Mat<const T> x, Vec<const T> g, float eps, Mat<const T> w,
                                             long long N, long long n_tile) {
    static_assert(ROWS * sizeof(T) <= 4096, "matvec_to_tile: the rows must fit the reserved 4 KB");
    T* tile = reinterpret_cast<T*>(smem + MEGA_SMEM - 4096);
    // row n lands at tile[n - n_tile * ROWS]: a generic pointer into shared memory
    matvec<T, 1, K, ROWS, HAS_NORM, false, false, true>(smem, x, g, eps, w, Mat<const T>{}, Mat<const T>{},
                                                        Mat<const float>{}, Mat<const float>{},
                                                        Mat<T>{tile - n_tile * ROWS, 0, 1}, N, n_tile, 1, MegaWaits{});
    mega_sync();
    return tile;
}
