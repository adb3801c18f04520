// kv_store: cache[slot[i], c0, pos[i], :] = new[i, c0, :] for every row i < n (blockops/kv_store.py).
// A slot or position outside the cache reports MEGA_ERR_INDEX (detail: the value) and writes
// nothing for that row.
#pragma once
#include "common.cuh"

template <class T>
__device__ __noinline__ void kv_store(const T* src, long long n_s0, long long n_s1, long long n_s2,  //
                                      const int* pos, long long pos_s0, const int* slot, long long slot_s0, long long n,
                                      T* cache, long long c_s0, long long c_s1, long long c_s2, long long c_s3,
                                      long long slots, long long max_len, long long D, long long c0) {
    constexpr int VEC = VecN<T>::value;
    const bool vec = n_s2 == 1 && c_s3 == 1 && D % VEC == 0 && aligned16(src) && aligned16(cache) &&
                     ((n_s0 * (long long)sizeof(T)) & 15) == 0 && ((n_s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((c_s0 * (long long)sizeof(T)) & 15) == 0 && ((c_s1 * (long long)sizeof(T)) & 15) == 0 &&
                     ((c_s2 * (long long)sizeof(T)) & 15) == 0;
    const long long per_row = vec ? D / VEC : D;
    for (long long k = threadIdx.x; k < n * per_row; k += MEGA_THREADS) {
        const long long i = k / per_row, e = k - i * per_row;
        const long long p = pos[i * pos_s0], s = slot[i * slot_s0];
        if (p < 0 || p >= max_len || s < 0 || s >= slots) {
            if (e == 0) mega_body_error(MEGA_ERR_INDEX, p < 0 || p >= max_len ? p : s);
            continue;
        }
        const T* from = src + i * n_s0 + c0 * n_s1;
        T* to = cache + s * c_s0 + c0 * c_s1 + p * c_s2;
        if (vec)
            *reinterpret_cast<uint4*>(to + e * VEC) = ldcg16(from + e * VEC);
        else
            to[e * c_s3] = ld_cg(from + e * n_s2);
    }
}
