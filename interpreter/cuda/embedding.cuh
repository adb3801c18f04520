// embedding_row: out[c0, :] = table[ids[c0], :] (blockops/embedding.py). A token id
// outside [0, V) reports MEGA_ERR_INDEX (detail: the id) and writes nothing.
#pragma once
#include "common.cuh"

template <class T, class I>
__device__ __noinline__ void embedding_row(Mat<const T> table, Vec<const I> ids, long long V, long long D, Mat<T> out,
                                           long long c0) {
    in_global(table, ids, out);
    const long long row = (long long)ld_cg(ids.p + c0 * ids.s0);
    if (row < 0 || row >= V) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, row);
        return;  // uniform: every thread read the same id
    }
    const T* src = table.p + row * table.s0;
    T* dst = out.p + c0 * out.s0;
    constexpr int VEC = VecN<T>::value;
    if (table.s1 == 1 && out.s1 == 1 && D % VEC == 0 && aligned16(src) && aligned16(dst)) {
        for (long long v = threadIdx.x; v < D / VEC; v += MEGA_THREADS)
            *reinterpret_cast<uint4*>(dst + v * VEC) = ldcg16(src + v * VEC);
    } else {
        for (long long k = threadIdx.x; k < D; k += MEGA_THREADS) dst[k * out.s1] = ld_cg(src + k * table.s1);
    }
}
