// kv_append: cache[:, pos, :] = new[Hkv, D] in place (blockops/kv_append.py). A position
// outside [0, Smax) reports MEGA_ERR_INDEX (detail: pos) and writes nothing.
#pragma once
#include "common.cuh"

template <class T>
__device__ __noinline__ void kv_append(Mat<const T> src, Ten3<T> cache, long long Hkv, long long Smax, long long D,
                                       long long pos) {
    in_global(src, cache);
    if (pos < 0 || pos >= Smax) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, pos);
        return;  // uniform
    }
    T* dst = cache.p + pos * cache.s1;
    constexpr int VEC = VecN<T>::value;
    if (src.s1 == 1 && cache.s2 == 1 && vec_rows_ok(src.p, src.s0, src.s1, D) && vec_rows_ok(dst, cache.s0, cache.s2, D)) {
        const long long dv = D / VEC;
        for (long long i = threadIdx.x; i < Hkv * dv; i += MEGA_THREADS) {
            const long long h = i / dv, v = i % dv;
            *reinterpret_cast<uint4*>(dst + h * cache.s0 + v * VEC) = ldcg16(src.p + h * src.s0 + v * VEC);
        }
    } else {
        for (long long i = threadIdx.x; i < Hkv * D; i += MEGA_THREADS) {
            const long long h = i / D, d = i % D;
            dst[h * cache.s0 + d * cache.s2] = ld_cg(src.p + h * src.s0 + d * src.s1);
        }
    }
}
