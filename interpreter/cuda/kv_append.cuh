// kv_append: cache[:, pos, :] = new[Hkv, D] in place (blockops/kv_append.py). A position
// outside [0, Smax) reports MEGA_ERR_INDEX (detail: pos) and writes nothing.
#pragma once
#include "common.cuh"

template <class T>
__device__ __noinline__ void kv_append(const T* src, long long n_s0, long long n_s1, T* cache, long long c_s0,
                                          long long c_s1, long long c_s2, long long Hkv, long long Smax, long long D,
                                          long long pos) {
    if (pos < 0 || pos >= Smax) {
        if (threadIdx.x == 0) mega_body_error(MEGA_ERR_INDEX, pos);
        return;  // uniform
    }
    T* dst = cache + pos * c_s1;
    constexpr int VEC = VecN<T>::value;
    if (n_s1 == 1 && c_s2 == 1 && vec_rows_ok(src, n_s0, n_s1, D) && vec_rows_ok(dst, c_s0, c_s2, D)) {
        const long long dv = D / VEC;
        for (long long i = threadIdx.x; i < Hkv * dv; i += MEGA_THREADS) {
            const long long h = i / dv, v = i % dv;
            *reinterpret_cast<uint4*>(dst + h * c_s0 + v * VEC) = ldcg16(src + h * n_s0 + v * VEC);
        }
    } else {
        for (long long i = threadIdx.x; i < Hkv * D; i += MEGA_THREADS) {
            const long long h = i / D, d = i % D;
            dst[h * c_s0 + d * c_s2] = ld_cg(src + h * n_s0 + d * n_s1);
        }
    }
}
