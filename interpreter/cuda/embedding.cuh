// embedding_row: out[c0, :] = table[ids[c0], :] (blockops/embedding.py). A token id
// outside [0, V) reports MEGA_ERR_INDEX (detail: the id) and writes nothing.
#pragma once
#include "common.cuh"

template <class T, class I>
__device__ __noinline__ void embedding_row(const T* table, long long t_s0, long long t_s1, const I* ids,
                                              long long ids_s0, long long V, long long D, T* out, long long out_s0,
                                              long long out_s1, long long c0) {
    const long long row = (long long)ld_cg(ids + c0 * ids_s0);
    if (row < 0 || row >= V) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, row);
        return;  // uniform: every thread read the same id
    }
    const T* src = table + row * t_s0;
    T* dst = out + c0 * out_s0;
    constexpr int VEC = VecN<T>::value;
    if (t_s1 == 1 && out_s1 == 1 && D % VEC == 0 && aligned16(src) && aligned16(dst)) {
        for (long long v = threadIdx.x; v < D / VEC; v += MEGA_THREADS)
            *reinterpret_cast<uint4*>(dst + v * VEC) = ldcg16(src + v * VEC);
    } else {
        for (long long k = threadIdx.x; k < D; k += MEGA_THREADS) dst[k * out_s1] = ld_cg(src + k * t_s1);
    }
}
